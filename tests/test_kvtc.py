"""kvtc: bit allocation, group quantizer, blob format, round trips, prefix store, bad input (tiny models)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvpack.hf.dense import to_dynamic_cache
from kvpack.ops.bitalloc import Allocation, aligned_group_errors, allocate_bits, group_cost
from kvpack.ops.bitpack import pack_bitstream, pack_bitstream_fast, unpack_bitstream, unpack_bitstream_fast
from kvpack.ops.group_quant import dequantize_groups, quantize_groups
from kvpack.storage.kvtc.calibration import Calibration, CalibrationSettings, calibrate
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache, iter_decompressed_layers
from kvpack.storage.kvtc.session import compress_tokens, continue_from_blob, prefill
from kvpack.store.format import MAGIC, Blob, BlobError, pack_blob

from .helpers import TINY_KVTC_SETTINGS, tiny_gemma3, tiny_kvtc, tiny_kvtc_chunks, tiny_llama, token_ids

# ------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------


def _brute_force(errors, n, budget, sizes, widths):
    best = np.inf

    def rec(i, bits, err):
        nonlocal best
        if i == n:
            best = min(best, err)
            return
        for g in sizes:
            if i % g or i + g > n:
                continue
            for j, w in enumerate(widths):
                c = group_cost(g, w)
                if bits + c <= budget:
                    rec(i + g, bits + c, err + errors[g][i // g, j])

    rec(0, 0, 0.0)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_brute_force_and_meets_budget(seed):
    torch.manual_seed(seed)
    sizes, widths = (1, 2, 4), (0, 1, 2, 3, 5)
    x = torch.randn(300, 8) * torch.logspace(1, -1, 8) + torch.randn(8)
    errors = aligned_group_errors(x, sizes=sizes, widths=widths)
    for budget in (0, 20, 45, 70, 101, 160, 250):
        alloc = allocate_bits(errors, 8, budget, widths=widths)
        alloc.check()  # tiles [0, 8), used bits recomputed and within budget
        assert alloc.used_bits <= budget
        assert alloc.error == pytest.approx(_brute_force(errors, 8, budget, sizes, widths), rel=1e-12, abs=1e-12)
        # The recorded error is the sum of its groups' measured errors (dropped runs: every
        # component's own error at width 0).
        recomputed = sum(errors[s][st // s, widths.index(w)] if w else errors[1][st:st + s, 0].sum()
                         for st, s, w in alloc.groups)
        assert recomputed == pytest.approx(alloc.error, rel=1e-9, abs=1e-12)


def test_dp_error_falls_as_budget_grows_and_widths_follow_variance():
    torch.manual_seed(3)
    x = torch.randn(2000, 256) * torch.logspace(1, -2, 256)
    errors = aligned_group_errors(x)
    allocs = [allocate_bits(errors, 256, 256 * 16 // r) for r in (64, 32, 16, 8, 4)]
    errs = [a.error for a in allocs]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    w = allocs[2].widths()
    assert w[0] >= w[64] >= w[-1] and w[-1] == 0  # high-variance components get more bits; the tail none


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 13, 64, 8 * 257])
def test_bitstream_roundtrip_exact(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    packed = pack_bitstream(codes, bits)
    assert packed.numel() == (n * bits + 7) // 8
    assert torch.equal(unpack_bitstream(packed, bits, n), codes)
    assert torch.equal(unpack_bitstream_fast(packed, bits, n), codes)  # the torch-only decoder, same codes
    if n % 8 == 0:
        assert torch.equal(pack_bitstream_fast(codes, bits), packed)  # the torch-only encoder, same bytes


@pytest.mark.parametrize("width", [1, 3, 8])
def test_group_quantizer_within_half_step(width):
    torch.manual_seed(4)
    x = torch.randn(50, 16) * 3
    codes, shift, scale = quantize_groups(x, width)
    assert shift.dtype == scale.dtype == torch.float16 and codes.dtype == torch.uint8
    back = dequantize_groups(codes, shift, scale)
    step = scale.float()[:, None]
    # Half a step, plus the fp16 rounding of the shift (the top level is measured from it).
    slack = (shift.float() - x.amin(-1)).abs()[:, None] + 1e-5
    assert ((back - x).abs() <= step / 2 + slack + 1e-3 * step).all()


def test_group_quantizer_refuses_nan_and_fp16_overflow():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_groups(torch.tensor([[1.0, float("nan")]]), 4)
    with pytest.raises(ValueError, match="fp16"):
        quantize_groups(torch.tensor([[1e6, 0.0]]), 4)


# ------------------------------------------------------------------------------------------------
# Tiny-model pipeline
# ------------------------------------------------------------------------------------------------

SETTINGS = TINY_KVTC_SETTINGS
_chunks = tiny_kvtc_chunks
_ids = token_ids


@pytest.fixture(scope="module")
def tiny():
    return tiny_kvtc()


def _kv_error(model, calib, ids, ratio):
    cache = prefill(model, ids)
    restored, _ = decompress_cache(compress_cache(cache, calib, ratio, ids, model=model), calib, model)
    err = sum(float((restored.layers[i].keys - cache.layers[i].keys).pow(2).sum()
                    + (restored.layers[i].values - cache.layers[i].values).pow(2).sum()) for i in range(2))
    ref = sum(float(cache.layers[i].keys.pow(2).sum() + cache.layers[i].values.pow(2).sum()) for i in range(2))
    return err / ref


def test_calibration_structure(tiny, tmp_path):
    model, calib = tiny
    assert calib.features == 2 * 2 * 16 and calib.layers == [0, 1]
    for kind, basis in (("keys", calib.key_basis), ("values", calib.value_basis)):
        eye = torch.eye(basis.shape[1])
        torch.testing.assert_close(basis.T @ basis, eye, atol=1e-4, rtol=0)  # orthonormal directions
        for key in calib.allocations:
            a = calib.allocations[key][kind]
            a.check()
            assert a.used_bits <= 16 * calib.features / float(key)
            assert a.n_components <= basis.shape[1]
    calib.save(tmp_path / "cal")
    again = Calibration.load(tmp_path / "cal")
    assert again.calibration_id == calib.calibration_id
    assert torch.equal(again.key_basis, calib.key_basis)


def test_roundtrip_error_falls_as_ratio_relaxes(tiny):
    model, calib = tiny
    ids = _ids(80)
    errs = [_kv_error(model, calib, ids, r) for r in (16, 8, 4, 2)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-3, errs  # 8-bit groups on every component


def test_highest_quality_generation_equals_uncompressed(tiny):
    model, calib = tiny
    ids = _ids(70, seed=11)
    blob = compress_tokens(model, calib, ids[:-1], 2)
    assert Blob(blob).meta["coded_tokens"] == 69 - 2 - 8  # the coded middle really exists
    got = continue_from_blob(model, _NoTokenizer(), calib, blob, ids[-1:], max_new_tokens=10)
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
    assert got.token_ids == ref[0, len(ids):].tolist()


class _NoTokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_sinks_and_window_are_lossless(tiny):
    model, calib = tiny
    ids = _ids(60)
    cache = prefill(model, ids)
    restored, got_ids = decompress_cache(compress_cache(cache, calib, 16, ids, model=model), calib, model)
    assert got_ids == ids
    for i in range(2):
        for a, b in ((restored.layers[i].keys, cache.layers[i].keys),
                     (restored.layers[i].values, cache.layers[i].values)):
            assert torch.equal(a[:, :, :2], b[:, :, :2]) and torch.equal(a[:, :, -8:], b[:, :, -8:])
            assert not torch.equal(a[:, :, 2:-8], b[:, :, 2:-8])  # the middle is coded (lossy)


def test_streaming_decompression_builds_one_layer_at_a_time(tiny, monkeypatch):
    import kvpack.storage.kvtc.coder as coder

    model, calib = tiny
    ids = _ids(50)
    blob = compress_cache(prefill(model, ids), calib, 8, ids, model=model)
    calls = []
    real = coder.layer_out
    monkeypatch.setattr(coder, "layer_out", lambda *a, **k: calls.append(1) or real(*a, **k))
    stream = iter_decompressed_layers(blob, calib, model)
    i, k, v = next(stream)
    assert i == 0 and len(calls) == 2  # layer 0's keys and values only; layer 1 not reconstructed yet
    full, _ = decompress_cache(blob, calib, model)
    assert torch.equal(k, full.layers[0].keys) and torch.equal(v, full.layers[0].values)


@pytest.mark.parametrize("backend", ["zlib", "zstd", "none"])
def test_backends_roundtrip_identically(tiny, backend):
    model, calib = tiny
    ids = _ids(60)
    cache = prefill(model, ids)
    ref, _ = decompress_cache(compress_cache(cache, calib, 8, ids, model=model, backend="none"), calib, model)
    blob = compress_cache(cache, calib, 8, ids, model=model, backend=backend)
    got, _ = decompress_cache(blob, calib, model)
    for a, b in zip(got.layers, ref.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert Blob(blob).meta["backend"] == backend


def test_blob_ratio_counts_every_byte(tiny):
    model, calib = tiny
    ids = _ids(90)
    cache = prefill(model, ids)
    blob = compress_cache(cache, calib, 8, ids, model=model)
    parsed = Blob(blob)
    header_and_digest = len(blob) - sum(s["size"] for s in parsed.sections.values())
    assert header_and_digest > 0  # the header, magic and checksum are part of the size reported
    assert parsed.meta["dense_bf16_bytes"] == 2 * 2 * 2 * 90 * 16 * 2  # layers · (K,V) · heads · T · d · bf16


def test_sliding_window_model_roundtrip_continues_exactly_at_high_quality():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny_gemma3()
    calib = calibrate(model, None, CalibrationSettings(ratios=(2,), **SETTINGS), chunks=_chunks(), progress=False)
    assert calib.layers == [1, 3]
    ids = _ids(60, seed=5)
    blob = compress_tokens(model, calib, ids[:-1], 2)
    dense, ids_back = decompress_cache(blob, calib, model)
    restored = to_dynamic_cache(model, dense, len(ids_back))
    assert isinstance(restored.layers[0], DynamicSlidingWindowLayer)
    assert restored.get_seq_length() == 59 and restored.layers[0].cumulative_length == 59
    got = continue_from_blob(model, _NoTokenizer(), calib, blob, ids[-1:], max_new_tokens=8)
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
    assert got.token_ids == ref[0, 60:].tolist()


def test_second_turn_reuses_a_first_turn_whose_last_tokens_it_does_not_share(tiny, tmp_path):
    """Issue 17, item 8: turn 1 stored with a closing it does not share with turn 2 (a chat template
    closing the user turn, a trailing space) is found through its leading tokens and restored cut to
    them; the continuation equals the uncompressed one (ratio 2: 8-bit groups everywhere)."""
    from kvpack.storage.kvtc.session import continue_from_store
    from kvpack.store import PrefixStore

    model, calib = tiny
    base, closing, question = _ids(40, seed=21), [5, 6, 7, 8, 9], _ids(7, seed=22)
    store = PrefixStore(tmp_path / "store")
    store.put(compress_tokens(model, calib, base + closing, 2), base + closing)
    turn2 = base + question
    got = continue_from_store(store, model, _NoTokenizer(), calib, turn2, max_new_tokens=8)
    assert got.restored_tokens == 40 and got.prefilled_tokens == 7  # before: no stored prefix (None)
    x = torch.tensor([turn2])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
    assert got.token_ids == ref[0, len(turn2):].tolist()
    assert continue_from_store(store, model, _NoTokenizer(), calib, _ids(30, seed=23)) is None


def test_a_sliding_window_cache_is_not_cut_and_an_exact_prefix_is_used_instead(tmp_path):
    from kvpack.storage.base import PrefixCutError
    from kvpack.storage.kvtc.session import continue_from_store
    from kvpack.store import PrefixStore

    model = tiny_gemma3()  # sliding window 16
    calib = calibrate(model, None, CalibrationSettings(ratios=(2,), **SETTINGS), chunks=_chunks(), progress=False)
    base, closing, question = _ids(40, seed=21), [5, 6, 7], _ids(5, seed=22)
    blob = compress_tokens(model, calib, base + closing, 2)
    dense, _ = decompress_cache(blob, calib, model)
    with pytest.raises(PrefixCutError, match="sliding window"):
        dense.leading(40)
    store = PrefixStore(tmp_path / "store")
    store.put(blob, base + closing)
    assert continue_from_store(store, model, _NoTokenizer(), calib, base + question) is None  # nothing exact
    store.put(compress_tokens(model, calib, base[:30], 2), base[:30])
    with pytest.warns(UserWarning, match="cannot be cut back"):
        got = continue_from_store(store, model, _NoTokenizer(), calib, base + question, max_new_tokens=4)
    assert got.restored_tokens == 30
    short = compress_tokens(model, calib, base[:12], 2)  # 12 tokens: every layer holds all of them
    kept = decompress_cache(short, calib, model)[0].leading(10)
    assert all(layer.keys.shape[2] == 10 for layer in kept.layers)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_bytes(tiny):
    model, calib = tiny
    ids = _ids(40)
    return compress_cache(prefill(model, ids), calib, 8, ids, model=model)


def _rewrite_digest(body: bytes) -> bytes:
    import hashlib

    return body + hashlib.sha256(body).digest()


def test_truncated_blob_refused(tiny, blob_bytes):
    model, calib = tiny
    for cut in (5, 100, len(blob_bytes) - 1):
        with pytest.raises(BlobError, match="truncated|checksum"):
            decompress_cache(blob_bytes[:cut], calib, model)


def test_flipped_byte_refused_by_checksum(tiny, blob_bytes):
    model, calib = tiny
    data = bytearray(blob_bytes)
    data[len(data) // 2] ^= 0x10
    with pytest.raises(BlobError, match="checksum"):
        decompress_cache(bytes(data), calib, model)


def test_wrong_magic_and_unknown_version_refused(tiny, blob_bytes):
    model, calib = tiny
    body = blob_bytes[:-32]
    with pytest.raises(BlobError, match="not a kvpack blob"):
        decompress_cache(_rewrite_digest(b"GARBAGE!" + body[8:]), calib, model)
    newer = body[:8] + struct.pack("<H", 99) + body[10:]
    with pytest.raises(BlobError, match="version 99 is not supported"):
        decompress_cache(_rewrite_digest(newer), calib, model)
    assert blob_bytes.startswith(MAGIC)


def test_blob_and_calibration_of_another_model_refused(tiny, blob_bytes):
    model, calib = tiny
    other = tiny_llama(q_heads=4, kv_heads=2, head_dim=16, layers=2, seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="another model"):
        decompress_cache(blob_bytes, calib, other)
    with pytest.raises(ValueError, match="another model"):
        compress_tokens(other, calib, _ids(30), 8)
    other_calib = calibrate(other, None, CalibrationSettings(ratios=(8,), **SETTINGS), chunks=_chunks(), progress=False)
    with pytest.raises(ValueError, match="calibration"):
        decompress_cache(blob_bytes, other_calib, model)


def test_ratio_without_allocation_and_empty_prompts_refused(tiny, blob_bytes):
    model, calib = tiny
    with pytest.raises(ValueError, match="no bit allocation for ratio 12; calibrated ratios: 2, 4, 8, 16"):
        compress_tokens(model, calib, _ids(30), 12)
    with pytest.raises(ValueError, match="empty prompt"):
        compress_tokens(model, calib, [], 8)
    with pytest.raises(ValueError, match="empty prompt"):
        continue_from_blob(model, _NoTokenizer(), calib, blob_bytes, [], max_new_tokens=2)


def test_nothing_is_unpickled(tiny, blob_bytes, monkeypatch, tmp_path):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    model, calib = tiny
    calib.save(tmp_path / "c")
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    decompress_cache(blob_bytes, Calibration.load(tmp_path / "c"), model)


def test_corrupted_calibration_refused(tiny, tmp_path):
    _, calib = tiny
    d = calib.save(tmp_path / "c")
    tensors = d / "kvtc_calibration.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    tensors.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not belong together or were modified"):
        Calibration.load(d)
    tensors.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ValueError, match="corrupted or truncated"):
        Calibration.load(d)
    with pytest.raises(FileNotFoundError, match="not a kvtc calibration"):
        Calibration.load(tmp_path / "nowhere")


@pytest.mark.parametrize("edit", [
    lambda m: m.update(layers=m["layers"][::-1]),  # the bases' row blocks read as other layers
    lambda m: m.update(kv_heads=m["kv_heads"] * 2, head_dim=m["head_dim"] // 2),  # same p, other split
    lambda m: m["settings"].update(sinks=m["settings"]["sinks"] + 1),
    lambda m: m["settings"].update(key_rope="post"),
])
def test_calibration_id_covers_geometry_and_settings(tiny, tmp_path, edit):
    """Issue 17, item 4: a calibration whose JSON was edited but kept its recorded id is refused
    (before: a reversed `layers` list loaded with the same id and decoded other layers' features)."""
    import json

    _, calib = tiny
    d = calib.save(tmp_path / "c")
    meta_path = d / "kvtc_calibration.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not belong together or were modified"):
        Calibration.load(d)


def test_calibration_of_the_older_format_is_refused_with_the_fix(tiny, tmp_path):
    import json

    _, calib = tiny
    d = calib.save(tmp_path / "c")
    meta_path = d / "kvtc_calibration.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "version": 1}))
    with pytest.raises(ValueError, match="older kvpack .* make it again with `kvpack calibrate`"):
        Calibration.load(d)


@pytest.mark.parametrize("field,value,match", [
    ("ratios", (1.0,), "> 1"), ("chunk_tokens", 100, "exceed sinks"), ("pca_dim", 0, "pca_dim must be >= 1"),
    ("samples", 1, "samples"),
])
def test_bad_calibration_settings(field, value, match):
    kwargs = {"tokens": 1024, "chunk_tokens": 512, "sinks": 4, "window": 128, field: value}
    with pytest.raises(ValueError, match=match):
        CalibrationSettings(**kwargs)


def test_pack_blob_refuses_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        pack_blob({}, {"x": torch.zeros(3)}, backend="lz4")


def test_allocation_from_dict_refuses_bad_groups():
    with pytest.raises(ValueError, match="invalid allocation group"):
        Allocation.from_dict({"groups": [[0, 4, 2], [5, 4, 2]], "budget_bits": 100, "used_bits": 80, "error": 0})
    with pytest.raises(ValueError, match="budget"):
        Allocation.from_dict({"groups": [[0, 4, 8]], "budget_bits": 10, "used_bits": 64, "error": 0})


def test_blob_of_a_float32_model_continues_in_bfloat16(tiny):
    """Issue 17, item 3: a cache stored from a float32 model is restored into the dtype of the model
    that continues (before: "Expected query, key, and value to have the same dtype")."""
    import copy

    model, calib = tiny
    ids = _ids(40)
    blob = compress_tokens(model, calib, ids[:-1], 8)  # the model is float32
    half = copy.deepcopy(model).to(torch.bfloat16)
    got = continue_from_blob(half, _NoTokenizer(), calib, blob, ids[-1:], max_new_tokens=4, min_new_tokens=4)
    assert len(got.token_ids) == 4
    restored, n = decompress_cache(blob, calib, half)
    assert to_dynamic_cache(half, restored, len(n)).layers[0].keys.dtype == torch.bfloat16
