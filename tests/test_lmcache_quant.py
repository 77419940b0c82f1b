"""lmcache_quant: LMCache's TurboQuant and fp8 serdes as a storage peer.

The kernel ports against LMCache's own Triton kernels (run by Triton's interpreter: conftest sets
TRITON_INTERPRET=1 on machines without a GPU), byte for byte; the codec's round trip against the serde's own
arithmetic and quality; bad blobs, settings and models refused by name."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lmcache")

from kvpack.hf.dense import prefill  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.storage.lmcache_quant import kernels  # noqa: E402
from kvpack.storage.lmcache_quant.codec import LMCacheQuantCodec, LMCacheQuantConfig, _Obj  # noqa: E402
from kvpack.store.schema import BlobError, ForeignBlobError  # noqa: E402

from .helpers import tiny_gemma3, tiny_llama, token_ids  # noqa: E402

MSE_PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
PRESETS = ("turboquant_k8v4", *MSE_PRESETS)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and
                                       not torch.cuda.is_available(),
                                       reason="LMCache's kernels need a GPU or TRITON_INTERPRET=1")


def lmcache_chunk(layers=3, tokens=32, heads=2, d=64, seed=0, fp8_keys=False):
    """``[2, layers, tokens, heads·d]`` bf16 with channels of unequal scale (LMCache's chunk layout); with
    ``fp8_keys`` the keys are values fp8 holds exactly (Triton's interpreter casts to fp8 unlike the GPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, layers, tokens, heads * d, generator=g) * torch.linspace(0.2, 5.0, heads * d)
    x = x.to(torch.bfloat16)
    if fp8_keys:
        x[0] = x[0].to(torch.float8_e4m3fn).to(torch.bfloat16)
    return x


def serde_run(preset, kernel_choice, x, buf=None, **settings):
    """``(bytes, decoded)``: LMCache's serializer (unless ``buf`` is given) and deserializer with the given
    kernels."""
    codec = LMCacheQuantCodec(LMCacheQuantConfig(preset=preset, kernels=kernel_choice, **settings))
    serializer, deserializer, size = codec._serde(x.shape[-1] // 2)
    with codec._on_device(torch.device("cpu")):
        if buf is None:
            buf = torch.zeros(size(x.shape, x.dtype), dtype=torch.uint8)
            assert serializer.serialize(_Obj(x), _Obj(buf), None) == buf.numel()
        out = torch.empty_like(x)
        deserializer.deserialize(_Obj(buf.clone()), _Obj(out), None)
    return buf, out


@needs_interpreter
@pytest.mark.parametrize("preset", PRESETS)
def test_kernel_ports_write_the_bytes_lmcache_kernels_write(preset):
    # 2 heads of 64 (SmolLM2's and Qwen2.5's head dim); 32 tokens, two whole blocks (a partial block's padding
    # slots hold whatever LMCache's torch.empty held); layer 0 kept raw by the serde
    x = lmcache_chunk(fp8_keys=preset == "turboquant_k8v4")
    port, _ = serde_run(preset, "torch", x, skip_first_layers=1, skip_last_layers=0)
    lmcache, _ = serde_run(preset, "triton", x, skip_first_layers=1, skip_last_layers=0)
    assert port.numel() == lmcache.numel()
    assert torch.equal(port, lmcache), f"{int((port != lmcache).sum())} of {port.numel()} bytes differ"


@needs_interpreter
@pytest.mark.parametrize("preset", PRESETS)
def test_dequant_port_decodes_as_lmcache_kernel(preset):
    x = lmcache_chunk(tokens=40, seed=1)  # 40 tokens: a partial last block
    buf, port = serde_run(preset, "torch", x, skip_first_layers=0, skip_last_layers=1)
    _, lmcache = serde_run(preset, "triton", x, buf=buf, skip_first_layers=0, skip_last_layers=1)
    # the same codes; with norm correction a sum over the head dim may round in another order: one fp16 step
    torch.testing.assert_close(port.float(), lmcache.float(), rtol=2 ** -9, atol=1e-6)
    assert torch.equal(port[:, -1], x[:, -1])  # the raw last layer
    if preset == "turboquant_k8v4":
        assert torch.equal(port, lmcache)


def test_fp8_keys_cast_as_the_gpu_does():
    # cvt.rn.satfinite: ties to even (17 -> 16, 1.0625 -> 1.0), subnormals kept, saturation at 448
    keys = torch.tensor([[17.0, 1.0625, 0.001, 500.0, -1000.0, 3.3] + [0.0] * 58], dtype=torch.bfloat16)
    cache = torch.zeros(keys.shape[1] + 36, dtype=torch.uint8)
    kernels.STORE_FP8[(1,)](keys, torch.zeros_like(keys), cache, torch.zeros(1, dtype=torch.int32),
                            stride_cache_block=100, stride_cache_pos=100, stride_cache_head=100, D=64, H=1,
                            BLOCK_SIZE=16, BLOCK_D=64, KPS=64, VQB=4, VAL_DATA_BYTES=32, BLOCK_VAL=32)
    got = cache[:6].view(torch.float8_e4m3fn).float().tolist()
    assert got == [16.0, 1.0, 2 ** -9, 448.0, -448.0, 3.25]


@pytest.mark.parametrize("bits", [3, 4])
def test_code_packing_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (5, 64))
    packed = kernels.pack_codes(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert torch.equal(kernels.unpack_codes(packed, bits, 64), codes)


def test_value_quantization_is_the_kernels_min_max_grid():
    v = torch.tensor([[0.0, 1.5, 3.0, 0.7] * 16, [2.0] * 64])
    codes, scale, low = kernels._quantize_values(v, 4)
    assert scale[0].item() == pytest.approx(3.0 / 15) and low[0].item() == 0.0
    assert codes[0, :4].tolist() == [0, 8, 15, 4]  # int((x - min) / scale + 0.5)
    assert scale[1].item() == pytest.approx(1e-8) and codes[1].eq(0).all()  # a flat row: the 1e-8 floor


# -- the codec --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(q_heads=4, kv_heads=2, head_dim=64, layers=6).to(torch.bfloat16)


def roundtrip(model, ids, **settings):
    method = get_method("lmcache_quant", **settings)
    cache = prefill(model, ids)
    blob = method.codec.compress(model, cache, ids)
    dense, back = method.codec.decompress(model, blob)
    assert back == ids
    return cache, dense, blob, method


# Lloyd–Max's mean squared error of a unit Gaussian at 3 and 4 bits: a rotated unit key's coordinates are close to
# N(0, 1/d), so the relative key error is close to its square root (TurboQuant's premise); fp8 keys: 3 mantissa bits
LLOYD_MAX_MSE = {3: 0.03454, 4: 0.009497}
KEY_BITS = {"turboquant_k8v4": None, "turboquant_4bit_nc": 4, "turboquant_k3v4_nc": 3, "turboquant_3bit_nc": 3}
VALUE_ERROR = {"turboquant_k8v4": 0.11, "turboquant_4bit_nc": 0.11, "turboquant_k3v4_nc": 0.11,
               "turboquant_3bit_nc": 0.22}  # min/max codes of 64 values: measured 0.085-0.091 (4) and 0.18-0.19 (3)


@pytest.mark.parametrize("preset", PRESETS)
def test_turboquant_round_trip_error_and_bytes(model, preset):
    ids = token_ids(300)  # two LMCache chunks (256 + 44)
    cache, dense, blob, method = roundtrip(model, ids, preset=preset)
    bits = KEY_BITS[preset]
    for i, layer in enumerate(cache.layers):
        for side, ref, got in (("keys", layer.keys, dense.layers[i].keys), ("values", layer.values,
                                                                              dense.layers[i].values)):
            assert got.shape == ref.shape and got.dtype == ref.dtype
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if i < 2 or i >= 4:  # LMCache's default: the first two and last two layers raw
                assert err == 0.0, (i, side)
            elif side == "values":
                assert 0.0 < err < VALUE_ERROR[preset], (i, side, err)
            elif bits is None:
                assert 0.0 < err < 0.04, (i, side, err)
            else:
                assert 0.85 < err / LLOYD_MAX_MSE[bits] ** 0.5 < 1.1, (i, side, err)
    # bytes: 2 raw + 2 coded layers; a coded (token, head) slot as TurboQuant lays it out; the container's ids
    from lmcache.v1.distributed.serde.turboquant.turboquant import TurboQuantSerdeConfig

    slot = TurboQuantSerdeConfig(preset=preset, head_dim=64).slot_size_aligned
    coded = 2 * (256 + 48) * 2 * slot  # the 44-token chunk padded to 48 (blocks of 16)
    raw = 4 * 2 * 300 * 2 * 64 * 2
    payload = coded + raw + 300 * 4
    assert payload < len(blob) < payload + 2048
    assert method.codec.dense_bytes(blob) == 6 * 2 * 300 * 2 * 64 * 2
    # deterministic: the slots TurboQuant leaves unwritten (a partial block's missing tokens) are zeroed
    assert method.codec.compress(model, cache, ids) == blob


def test_fp8_round_trip_is_the_cast(model):
    ids = token_ids(70)
    cache, dense, blob, _ = roundtrip(model, ids, serde="fp8")
    for ref, got in zip(cache.layers, dense.layers, strict=True):
        assert torch.equal(got.keys, ref.keys.to(torch.float8_e4m3fn).to(torch.bfloat16))
        assert torch.equal(got.values, ref.values.to(torch.float8_e4m3fn).to(torch.bfloat16))
    assert 6 * 2 * 70 * 128 < len(blob) < 6 * 2 * 70 * 128 + 70 * 4 + 2048


def test_generation_continues_from_the_decoded_cache(model):
    class Ids:  # the tiny model has no tokenizer: only the ids matter
        pad_token_id = eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    ids = token_ids(90)
    method = get_method("lmcache_quant", serde="fp8")
    blob = method.compress(model, ids[:-1])
    result = method.resume(model, Ids(), blob, ids[-1:], max_new_tokens=4, min_new_tokens=4)
    assert result.new_tokens == 4 and result.restored_tokens == 89 and result.kv_bytes == len(blob)
    assert result.dense_kv_bytes == 6 * 2 * 89 * 128 * 2


def test_a_blob_of_other_settings_or_another_model_is_refused(model):
    ids = token_ids(40)
    _, _, blob, _ = roundtrip(model, ids, preset="turboquant_4bit_nc")
    other = get_method("lmcache_quant", preset="turboquant_3bit_nc").codec
    with pytest.raises(ForeignBlobError, match="other lmcache_quant settings.*preset"):
        other.decompress(model, blob)
    other_model = tiny_llama(q_heads=4, kv_heads=2, head_dim=64, layers=6, seed=1).to(torch.bfloat16)
    with pytest.raises(ForeignBlobError, match="another model"):
        get_method("lmcache_quant", preset="turboquant_4bit_nc").codec.decompress(other_model, blob)


def test_corrupted_and_truncated_blobs_are_refused(model):
    ids = token_ids(40)
    _, _, blob, method = roundtrip(model, ids)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    for bad in (bytes(flipped), blob[:-100], blob[:20]):
        with pytest.raises(BlobError):
            method.codec.decompress(model, bad)


def test_bad_settings_inputs_and_models_are_refused(model, monkeypatch):
    with pytest.raises(ValueError, match="budget 0.3 is not a setting of lmcache_quant"):
        get_method("lmcache_quant", budget=0.3)
    with pytest.raises(ValueError, match="preset"):
        get_method("lmcache_quant", preset="turboquant_2bit")
    codec = get_method("lmcache_quant").codec
    with pytest.raises(ValueError, match="sliding-window layers"):
        codec.check_model(tiny_gemma3())
    with pytest.raises(ValueError, match="power of two"):
        codec.check_model(tiny_llama(q_heads=2, kv_heads=2, head_dim=48, layers=2))
    ids = token_ids(20)
    cache = prefill(model, ids)
    cache.layers[3].values[0, 1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.compress(model, cache, ids)
    with pytest.raises(ValueError, match=r"layer 0 keys: expected \[1, 2, 21, 64\]"):
        codec.compress(model, prefill(model, ids), ids + [1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    triton_codec = get_method("lmcache_quant", kernels="triton").codec
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            triton_codec.compress(model, prefill(model, ids), ids)


def test_its_presets_are_frontier_peers_measured_beside_kvpack():
    from kvpack.eval.frontier import is_peer, is_storage
    from kvpack.presets import PRESETS

    names = {p.name for p in PRESETS if p.method == "lmcache_quant"}
    assert names == {"turboquant-k8v4", "turboquant-4bit-nc", "turboquant-k3v4-nc", "turboquant-3bit-nc", "fp8-e4m3"}
    assert is_peer("lmcache_quant") and not is_storage({"family": "lmcache_quant"})
    for name in names:  # each a name kvpack resolves, with no budget (its bytes follow the serde)
        assert get_method(name).config.budget is None
