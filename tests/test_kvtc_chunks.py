"""kvtc for fixed-size KV chunks (what serving engines store): exact sizes, the same reconstruction as
kvpack's blob path, both chunk layouts, and refusal of anything corrupted or foreign."""

from __future__ import annotations

import pytest
import torch

from kvpack.hf.dense import prefill
from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate
from kvpack.storage.kvtc.chunk import DIGEST_BYTES, HEADER_BYTES, ChunkCodec, ChunkError, ChunkShape
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache

from .helpers import TINY_KVTC_SETTINGS, kv_chunk, tiny_kvtc, tiny_kvtc_chunks, tiny_llama, token_ids


@pytest.fixture(scope="module")
def post_rope():
    """A tiny model and a calibration of its keys as cached (after RoPE)."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=16, layers=2)
    calib = calibrate(model, None, CalibrationSettings(ratios=(2, 4, 8), key_rope="post", **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(), progress=False)
    return model, calib


def test_chunk_reconstruction_is_the_blob_paths_token_for_token(post_rope):
    """Coding is per token (per-token shift/scale), so a chunk's tokens come back exactly as kvpack's own
    blob path gives them when it codes every token (no lossless sinks or window). In fp32: a bf16
    inverse PCA rounds its products per GEMM, and the two paths' GEMMs are shaped differently."""
    model, calib = post_rope
    ids = token_ids(96)
    cache = prefill(model, ids)
    codec = ChunkCodec(calib, 4, exact_tokens=0, precision="float32")
    chunk = kv_chunk(cache)
    got = codec.decode(codec.encode(chunk))
    blob = compress_cache(cache, calib, 4, ids, model=model, backend="none", sinks=0, window=0)
    restored, _ = decompress_cache(blob, calib, model, precision="float32")
    torch.testing.assert_close(got, kv_chunk(restored), rtol=0, atol=0)
    err = float((got - chunk).norm() / chunk.norm())
    assert 0 < err < 0.5, err  # lossy, and not garbage


def fused(separate: torch.Tensor, order: str, head_dim: int = 16, block: int = 128) -> torch.Tensor:
    """``[2, L, T, W]`` as a fused ``[1, L, T, 2W]`` chunk, built independently of the codec.

    ``halves``: rows ``[all K | all V]``. ``vllm_cpu``: vLLM's CPU memory per (block, head) — keys
    transposed ``[d, BS]`` then values ``[BS, d]`` — read by LMCache as rows of ``2d`` per head."""
    if order == "halves":
        return torch.cat([separate[0], separate[1]], dim=-1)[None]
    L, T, W = separate.shape[1:]
    H, nb = W // head_dim, T // block
    out = torch.empty(1, L, T, 2 * W, dtype=separate.dtype)
    for layer in range(L):
        for b in range(nb):
            for h in range(H):
                k = separate[0, layer, b * block:(b + 1) * block, h * head_dim:(h + 1) * head_dim]  # [BS, d]
                v = separate[1, layer, b * block:(b + 1) * block, h * head_dim:(h + 1) * head_dim]
                region = torch.cat([k.T.flatten(), v.flatten()])  # vLLM: K [d, BS], then V [BS, d]
                out[0, layer, b * block:(b + 1) * block, h * 2 * head_dim:(h + 1) * 2 * head_dim] = \
                    region.reshape(block, 2 * head_dim)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order,tokens", [("vllm_cpu", 256), ("vllm_cpu", 128), ("halves", 256), ("halves", 37)])
def test_size_is_exact_and_data_independent_and_layouts_agree(post_rope, dtype, order, tokens, monkeypatch):
    _, calib = post_rope
    # the layout arithmetic, on every dtype: as on a CPU without AMX (with AMX, vLLM lays bf16 blocks out
    # otherwise and such chunks are refused: test_lmcache_serde.py)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    g = torch.Generator().manual_seed(tokens)
    codec = ChunkCodec(calib, 8, fused_order=order)
    for scale in (1e-3, 1.0, 40.0):
        separate = (torch.randn(2, 2, tokens, 32, generator=g) * scale).to(dtype)
        a, b = codec.encode(separate), codec.encode(fused(separate, order))
        assert len(a) == len(b) == codec.serialized_size(codec.shape_of(separate.shape), dtype)
        start = HEADER_BYTES + DIGEST_BYTES
        assert a[start:] == b[start:] and a[:start] != b[:start]  # the same codes; the header says which layout
        back_separate, back_fused = codec.decode(a), codec.decode(b)
        assert back_separate.dtype == dtype and back_separate.shape == separate.shape
        torch.testing.assert_close(fused(back_separate, order), back_fused, rtol=0, atol=0)
    dense_bf16 = 2 * 2 * tokens * 32 * 2
    assert codec.coded_size(tokens) <= dense_bf16 / 8  # the ratio is a bound on the coded bytes
    exact = min(4, tokens)
    assert codec.payload_size(tokens, dtype) == codec.coded_size(tokens) + exact * (2 + 2 * 2 * 32 * dtype.itemsize)


def test_fused_orders_are_not_mixed_up(post_rope):
    _, calib = post_rope
    separate = torch.randn(2, 2, 256, 32, generator=torch.Generator().manual_seed(1))
    vllm, halves = ChunkCodec(calib, 8, "vllm_cpu"), ChunkCodec(calib, 8, "halves")
    with pytest.raises(ChunkError, match="expects"):
        halves.decode(vllm.encode(fused(separate, "vllm_cpu")), halves.shape_of((1, 2, 256, 64)))
    with pytest.raises(ValueError, match="whole 128-token blocks"):
        vllm.encode(torch.zeros(1, 2, 100, 64))


@pytest.mark.parametrize("exact", [1, 4, 9])
def test_worst_coded_tokens_are_kept_exactly(post_rope, exact):
    """The exact tokens are the ones the coding reconstructs worst; they come back bit for bit and
    everything else as without them."""
    model, calib = post_rope
    chunk = kv_chunk(prefill(model, token_ids(80, seed=4))).bfloat16()
    plain = ChunkCodec(calib, 8, exact_tokens=0)
    coded = plain.decode(plain.encode(chunk))
    error = (coded.float() - chunk.float()).square().sum(dim=(0, 1, 3))  # per token
    worst = set(error.topk(exact).indices.tolist())
    codec = ChunkCodec(calib, 8, exact_tokens=exact)
    back = codec.decode(codec.encode(chunk))
    for t in range(chunk.shape[2]):
        expected = chunk[:, :, t] if t in worst else coded[:, :, t]
        torch.testing.assert_close(back[:, :, t], expected, rtol=0, atol=0)
    assert len(codec.encode(chunk)) == codec.serialized_size(codec.shape_of(chunk.shape), torch.bfloat16)


def test_corrupted_truncated_and_foreign_chunks_are_refused(post_rope):
    model, calib = post_rope
    codec = ChunkCodec(calib, 4)
    cache = prefill(model, token_ids(64))
    data = codec.encode(kv_chunk(cache))
    shape = codec.shape_of(kv_chunk(cache).shape)
    for at in (0, 40, 70, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(ChunkError):
            codec.decode(bytes(bad), shape)
    with pytest.raises(ChunkError, match="truncated|shorter"):
        codec.decode(data[:-5], shape)
    with pytest.raises(ChunkError, match="at ratio"):
        ChunkCodec(calib, 8).decode(data, shape)
    with pytest.raises(ChunkError, match="exact tokens"):
        ChunkCodec(calib, 4, exact_tokens=2).decode(data, shape)
    other = calibrate(model, None, CalibrationSettings(ratios=(4,), key_rope="post", seed=1, **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(seed=5), progress=False)
    with pytest.raises(ChunkError, match="made with calibration"):
        ChunkCodec(other, 4).decode(data, shape)
    with pytest.raises(ChunkError, match="expects"):
        codec.decode(data, ChunkShape("separate", 2, 63, 32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(torch.full((2, 2, 8, 32), float("nan")))
    with pytest.raises(ValueError, match="does not fit the calibration"):
        codec.encode(torch.zeros(2, 3, 8, 32))
    with pytest.raises(ValueError, match="a KV chunk is"):
        codec.encode(torch.zeros(3, 2, 8, 32))


def test_pre_rope_calibration_is_refused_for_chunks():
    _, calib = tiny_kvtc(ratios=(4,))
    with pytest.raises(ValueError, match="without their token positions.*--key-rope post"):
        ChunkCodec(calib, 4)


def test_keyed_chunks_cannot_be_forged_or_served_under_another_key(post_rope):
    """Issue 17, item 9: with a MAC key a chunk's digest is an HMAC over the engine's key for it,
    header and payload, in the same fixed size."""
    import hashlib

    model, calib = post_rope
    chunk = kv_chunk(prefill(model, token_ids(64)))
    key = b"k" * 32
    keyed, plain = ChunkCodec(calib, 4, mac_key=key), ChunkCodec(calib, 4)
    data = keyed.encode(chunk, context=b"chunk-A")
    assert len(data) == len(plain.encode(chunk)) == keyed.serialized_size(keyed.shape_of(chunk.shape), chunk.dtype)
    torch.testing.assert_close(keyed.decode(data, context=b"chunk-A"), plain.decode(plain.encode(chunk)))
    with pytest.raises(ChunkError, match="MAC does not verify"):
        keyed.decode(data, context=b"chunk-B")  # a valid chunk served under another chunk's key
    with pytest.raises(ChunkError, match="MAC does not verify"):
        ChunkCodec(calib, 4, mac_key=b"x" * 32).decode(data, context=b"chunk-A")
    with pytest.raises(ChunkError, match="has no MAC"):
        keyed.decode(plain.encode(chunk), context=b"chunk-A")
    with pytest.raises(ChunkError, match="set KVPACK_STORE_KEY"):
        plain.decode(data)
    # A writer without the key who changes the payload and recomputes a SHA-256 in the digest slot.
    forged = bytearray(data)
    forged[-1] ^= 1
    head, payload = bytes(forged[:HEADER_BYTES]), bytes(forged[HEADER_BYTES + DIGEST_BYTES:])
    forged[HEADER_BYTES:HEADER_BYTES + DIGEST_BYTES] = hashlib.sha256(head + payload).digest()
    with pytest.raises(ChunkError, match="MAC does not verify"):
        keyed.decode(bytes(forged), context=b"chunk-A")
