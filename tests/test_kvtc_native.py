"""kvtc's native passes against the PyTorch path, and the bf16 inverse PCA against fp32.

``kvtc_quantize`` (coefficient columns -> fp16 shift/scale and a bit stream) must give the PyTorch path's
bytes; ``kvtc_dequantize`` (bit stream -> dequantized coefficient columns) and ``kvtc_layer_out`` (inverse-PCA
output + mean, RoPE, transpose, cast into a cache tensor's rows) must give the PyTorch path's bits
exactly (the same fp32 products and sums, the same round-to-nearest-even casts), on every code width,
odd token counts, column slices and each cache dtype; a whole blob decoded with the kernels must equal
the PyTorch decode. The bf16 inverse PCA is lossy by design: its error is bounded against fp32's.
"""

from __future__ import annotations

import pytest
import torch

from kvpack import native_build
from kvpack.hf.dense import prefill
from kvpack.methods import get_method
from kvpack.ops.bitpack import pack_bitstream
from kvpack.ops.group_quant import quantize_groups
from kvpack.ops.rope import LlamaRotary, RotaryTable, apply_rope
from kvpack.storage.kvtc import native as kvtc_native
from kvpack.storage.kvtc.coder import (
    _checked,
    _decoded_layers,
    compress_cache,
    decode_coefficients,
    decompress_cache,
    encode_coefficients,
    inverse_dtype,
    rope_logits,
)

from .helpers import tiny_kvtc, token_ids

if native_build.native_disabled():
    pytest.skip(f"{native_build.NATIVE_ENV}=0: the native code is turned off", allow_module_level=True)


@pytest.fixture(scope="module")
def lib():
    built = kvtc_native.native()
    assert built is not None, "kvtc's native passes did not build (see the warning): g++ and ninja are needed"
    return built


@pytest.fixture(scope="module")
def tiny():
    return tiny_kvtc()


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("tokens,size", [(1, 1), (7, 3), (33, 16), (129, 64)])
def test_dequantize_is_the_pytorch_path_bit_for_bit(lib, width, tokens, size):
    g = torch.Generator().manual_seed(width * 1000 + tokens)
    codes = torch.randint(0, 2 ** width, (tokens, size), dtype=torch.uint8, generator=g)
    stream = pack_bitstream(codes, width)
    shift = (torch.randn(tokens, generator=g) * 3).half()
    scale = torch.rand(tokens, generator=g).half()
    ref = codes.float() * scale.float()[:, None] + shift.float()[:, None]  # ops.group_quant.dequantize_groups
    matrix = torch.full((tokens, size + 5), 7.0)
    lib.kvtc_dequantize(stream, width, shift, scale, matrix[:, 2:2 + size])  # a column slice, as the decoder
    assert torch.equal(matrix[:, 2:2 + size], ref)
    assert (matrix[:, :2] == 7).all() and (matrix[:, 2 + size:] == 7).all()  # nothing outside the group
    as_bf16 = torch.zeros(tokens, size, dtype=torch.bfloat16)
    lib.kvtc_dequantize(stream, width, shift, scale, as_bf16)
    assert torch.equal(as_bf16, ref.to(torch.bfloat16))


@pytest.mark.parametrize("width", [1, 3, 6, 8])
@pytest.mark.parametrize("tokens,size", [(1, 1), (33, 16), (129, 64)])
def test_dequantize_into_scattered_columns_is_the_gathered_matrix(lib, width, tokens, size):
    """``kvtc_dequantize_columns`` writes code ``c`` to column ``columns[c]``: the contiguous pass, permuted."""
    g = torch.Generator().manual_seed(width * 1000 + tokens + 1)
    codes = torch.randint(0, 2 ** width, (tokens, size), dtype=torch.uint8, generator=g)
    stream = pack_bitstream(codes, width)
    shift, scale = (torch.randn(tokens, generator=g) * 3).half(), torch.rand(tokens, generator=g).half()
    ref = codes.float() * scale.float()[:, None] + shift.float()[:, None]
    columns = torch.randperm(size + 7, generator=g)[:size]  # into a wider matrix, in a shuffled order
    for dtype in (torch.float32, torch.bfloat16):
        matrix = torch.full((tokens, size + 7), 7.0, dtype=dtype)
        lib.kvtc_dequantize_columns(stream, width, shift, scale, matrix, columns)
        assert torch.equal(matrix[:, columns], ref.to(dtype))
        untouched = torch.ones(size + 7, dtype=torch.bool)
        untouched[columns] = False
        assert (matrix[:, untouched] == 7).all()
    with pytest.raises(RuntimeError, match="outside"):
        lib.kvtc_dequantize_columns(stream, width, shift, scale, torch.zeros(tokens, size), columns + size + 7)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_coefficients_decoded_in_another_order_are_the_same_coefficients(tiny, backend):
    """``decode_coefficients(columns=...)`` (native scatter or PyTorch) is the decoded matrix, permuted; a
    ``columns`` that is not a permutation is refused; ``out`` receives it."""
    model, calib = tiny
    alloc = calib.allocation(4.0)["keys"]
    n = 37
    x = torch.randn(n, calib.features, generator=torch.Generator().manual_seed(5))
    sections = encode_coefficients(x, calib.key_mean, calib.key_basis, alloc, "keys")
    plain = decode_coefficients(sections.__getitem__, alloc, "keys", n, backend=backend)
    columns = torch.randperm(alloc.coded_extent, generator=torch.Generator().manual_seed(6))
    out = torch.zeros(n, alloc.coded_extent)
    got = decode_coefficients(sections.__getitem__, alloc, "keys", n, backend=backend, columns=columns, out=out)
    assert got is out and torch.equal(got[:, columns], plain)
    with pytest.raises(ValueError, match="permutation"):
        decode_coefficients(sections.__getitem__, alloc, "keys", n, backend=backend, columns=columns.clamp(max=0))
    with pytest.raises(ValueError, match="out must be"):
        decode_coefficients(sections.__getitem__, alloc, "keys", n, backend=backend, out=torch.zeros(n, 1))


def test_dequantize_refuses_a_short_stream_and_bad_arguments(lib):
    codes = torch.zeros(10, 4, dtype=torch.uint8)
    stream = pack_bitstream(codes, 5)
    half = torch.zeros(10, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="shorter than"):
        lib.kvtc_dequantize(stream[:-1], 5, half, half, torch.zeros(10, 4))
    with pytest.raises(RuntimeError, match="width must be in 1..8"):
        lib.kvtc_dequantize(stream, 9, half, half, torch.zeros(10, 4))
    with pytest.raises(RuntimeError, match="fp16"):
        lib.kvtc_dequantize(stream, 5, half.float(), half, torch.zeros(10, 4))


def _torch_layer_out(x, mean, cos_sin, heads, d):
    y = (x.float() + mean).reshape(x.shape[0], heads, d).permute(1, 0, 2)
    return apply_rope(y, *cos_sin) if cos_sin is not None else y


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,d,tokens", [(3, 64, 97), (2, 128, 17), (1, 256, 1), (4, 32, 300)])
@pytest.mark.parametrize("rope", [True, False])
def test_layer_out_is_the_pytorch_path_bit_for_bit(lib, in_dtype, out_dtype, heads, d, tokens, rope):
    g = torch.Generator().manual_seed(heads * d + tokens)
    x = (torch.randn(tokens, heads * d, generator=g) * 4).to(in_dtype)
    mean = torch.randn(heads * d, generator=g)
    cos_sin = None
    if rope:
        positions = torch.arange(5, 5 + tokens)
        cos_sin = RotaryTable(LlamaRotary(d), d).cos_sin(positions)
    cache = torch.full((heads, tokens + 9, d), 3.0, dtype=out_dtype)  # sinks | coded rows | window
    lib.kvtc_layer_out(x, mean, *(cos_sin or (torch.empty(0), torch.empty(0))), cache[:, 4:4 + tokens])
    ref = _torch_layer_out(x, mean, cos_sin, heads, d).to(out_dtype)
    assert torch.equal(cache[:, 4:4 + tokens], ref)
    assert (cache[:, :4] == 3).all() and (cache[:, 4 + tokens:] == 3).all()


def test_layer_out_refuses_mismatched_shapes(lib):
    out = torch.zeros(2, 10, 16)
    with pytest.raises(RuntimeError, match="matching out"):
        lib.kvtc_layer_out(torch.zeros(9, 32), torch.zeros(32), torch.empty(0), torch.empty(0), out)
    with pytest.raises(RuntimeError, match="cos and sin"):
        lib.kvtc_layer_out(torch.zeros(10, 32), torch.zeros(32), torch.zeros(10, 8), torch.zeros(10, 8), out)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,rows,d,tokens", [(3, 3, 64, 97), (2, 7, 128, 17), (1, 1, 32, 1), (4, 2, 64, 300)])
@pytest.mark.parametrize("rope", [True, False])
def test_rope_logits_are_the_logits_against_layer_outs_keys(lib, in_dtype, heads, rows, d, tokens, rope):
    """``kvtc_rope_logits`` = ``q · kᵀ · scaling`` for the fp32 keys ``kvtc_layer_out`` writes, in fp64, within
    fp32 summation error; the PyTorch fallback of :func:`rope_logits` the same."""
    g = torch.Generator().manual_seed(heads * d + tokens + rows)
    x = (torch.randn(tokens, heads * d, generator=g) * 4).to(in_dtype)
    mean = torch.randn(heads * d, generator=g)
    q = torch.randn(heads, rows, d, generator=g)
    cos_sin = RotaryTable(LlamaRotary(d), d).cos_sin(torch.arange(5, 5 + tokens)) if rope else None
    keys = torch.empty(heads, tokens, d)
    lib.kvtc_layer_out(x, mean, *(cos_sin or (torch.empty(0), torch.empty(0))), keys)
    want = q.double() @ keys.double().transpose(1, 2) * 0.125
    bound = 1e-5 * float(q.abs().sum(-1).max() * keys.abs().max()) * 0.125
    for got in (lib.kvtc_rope_logits(x, mean, *(cos_sin or (torch.empty(0), torch.empty(0))), q, 0.125),
                rope_logits(None, x, mean, cos_sin, q, 0.125)):
        assert got.shape == (heads, rows, tokens) and got.dtype == torch.float32
        assert float((got.double() - want).abs().max()) <= bound


def test_rope_logits_refuse_mismatched_shapes(lib):
    q = torch.zeros(2, 3, 16)
    with pytest.raises(RuntimeError, match="matching q"):
        lib.kvtc_rope_logits(torch.zeros(10, 48), torch.zeros(32), torch.empty(0), torch.empty(0), q, 1.0)
    with pytest.raises(RuntimeError, match="cos and sin"):
        lib.kvtc_rope_logits(torch.zeros(10, 32), torch.zeros(32), torch.zeros(9, 16), torch.zeros(9, 16), q, 1.0)
    with pytest.raises(RuntimeError, match="fp32"):
        lib.kvtc_rope_logits(torch.zeros(10, 32), torch.zeros(32), torch.empty(0), torch.empty(0), q.double(), 1.0)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_blob_decoded_with_the_kernels_equals_the_pytorch_decode(tiny, precision, model_dtype):
    model, calib = tiny
    model = model.to(model_dtype)
    try:
        ids = token_ids(75)
        blob = compress_cache(prefill(model, ids), calib, 8, ids, model=model)
        native_cache, _ = decompress_cache(blob, calib, model, precision=precision)
        parts = _decoded_layers(*_checked(blob, calib, model), calib, model, None, precision=precision,
                                kernels="torch")
        for got, (_, k, v) in zip(native_cache.layers, parts):
            assert got.keys.dtype == model_dtype
            assert torch.equal(got.keys, k) and torch.equal(got.values, v)
    finally:
        model.float()


def test_bf16_inverse_pca_stays_far_below_the_coding_error(tiny):
    """bf16 operands (fp32 accumulation) vs the fp32 reference, at the finest calibrated ratio (where
    the coding loses least): the extra relative squared error is of bf16's rounding (< 2e-5 of the
    cache's energy; SmolLM2 at 16x measures 5e-6) and < 10% of what the coding itself loses."""
    model, calib = tiny
    ids = token_ids(90, seed=3)
    cache = prefill(model, ids)
    blob = compress_cache(cache, calib, 2, ids, model=model)
    exact, _ = decompress_cache(blob, calib, model, precision="float32")
    fast, _ = decompress_cache(blob, calib, model, precision="bfloat16")
    def squared(xs, ys, attr):
        return sum(float((getattr(a, attr) - getattr(b, attr)).pow(2).sum()) for a, b in zip(xs.layers, ys.layers))

    for attr in ("keys", "values"):
        coding, extra = squared(exact, cache, attr), squared(exact, fast, attr)
        energy = sum(float(getattr(c, attr).pow(2).sum()) for c in cache.layers)
        assert 0 < extra < 2e-5 * energy and extra < 0.1 * coding, (attr, extra / energy, extra / coding)


def test_decode_precision_is_checked():
    assert inverse_dtype("float32") == torch.float32 and inverse_dtype("bfloat16") == torch.bfloat16
    assert inverse_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="decode precision must be one of"):
        inverse_dtype("fp8")
    with pytest.raises(ValueError, match="decode_precision"):
        get_method("kvtc", decode_precision="half")


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                       (False, False, torch.float32)])
def test_auto_decode_precision_is_bf16_where_the_cpu_multiplies_bf16(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert inverse_dtype("auto") == expected


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("tokens,size", [(1, 1), (7, 1), (13, 3), (33, 16), (129, 64)])
def test_quantize_and_pack_give_the_pytorch_paths_bytes(lib, width, tokens, size):
    g = torch.Generator().manual_seed(width * 100 + tokens)
    coeffs = torch.randn(tokens, size + 7, generator=g) * 5
    coeffs[0, 3:3 + size] = 1.25  # a constant group: scale 0, every code 0
    stream, shift, scale = lib.kvtc_quantize(coeffs, 3, size, width)
    codes, ref_shift, ref_scale = quantize_groups(coeffs[:, 3:3 + size], width)
    assert torch.equal(shift, ref_shift) and torch.equal(scale, ref_scale)
    assert torch.equal(stream, pack_bitstream(codes, width))


def test_blob_encoded_with_the_kernels_equals_the_pytorch_encode(tiny):
    from kvpack.storage.kvtc import coder

    model, calib = tiny
    x = torch.randn(40, calib.features) * 3
    alloc = calib.allocation(8)["keys"]
    fast = coder.encode_coefficients(x, calib.key_mean, calib.key_basis, alloc, "keys")
    slow = coder.encode_coefficients(x, calib.key_mean, calib.key_basis, alloc, "keys", backend="torch")
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)
    with pytest.raises(ValueError, match="NaN or Inf"):
        coder.encode_coefficients(x * float("nan"), calib.key_mean, calib.key_basis, alloc, "keys")
