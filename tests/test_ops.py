import pytest
import torch

from kvpack.ops.int4 import INT4_MAX, dequantize_int4, pack_nibbles, quantize_int4, unpack_nibbles
from kvpack.ops.lowrank import gram_eigh_factors
from kvpack.ops.rope import apply_rope, invert_rope

from .helpers import tiny_gemma3, tiny_llama


@pytest.mark.parametrize("P,d,rank", [(32, 64, 13), (17, 40, 5), (16, 16, 16), (8, 64, 1)])
def test_gram_eigh_matches_truncated_svd(P, d, rank):
    torch.manual_seed(0)
    # Pages with a decaying spectrum, like real KV pages.
    x = torch.randn(5, P, d, dtype=torch.float64) @ torch.diag(torch.logspace(0, -2, d, dtype=torch.float64))
    left, right, sigma = gram_eigh_factors(x, rank)
    assert left.shape == (5, P, rank) and right.shape == (5, rank, d)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    best = u[..., :rank] @ torch.diag_embed(s[..., :rank]) @ vh[..., :rank, :]
    err_gram = torch.linalg.matrix_norm(x - left @ right)
    err_svd = torch.linalg.matrix_norm(x - best)
    torch.testing.assert_close(err_gram, err_svd, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(sigma, s[..., :rank], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(left.transpose(-1, -2) @ left, torch.eye(rank, dtype=torch.float64).expand(5, -1, -1),
                               rtol=0, atol=1e-8)


def test_gram_eigh_fp32_reconstruction_close_to_svd():
    torch.manual_seed(1)
    x = torch.randn(64, 32, 64)
    left, right, _ = gram_eigh_factors(x, 12)
    s = torch.linalg.svdvals(x.double())
    best_err = s[..., 12:].pow(2).sum(-1).sqrt()
    err = torch.linalg.matrix_norm((x - left @ right).double())
    torch.testing.assert_close(err, best_err, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rank", [0, 33, -1])
def test_gram_eigh_rejects_bad_rank(rank):
    with pytest.raises(ValueError, match="rank"):
        gram_eigh_factors(torch.randn(2, 32, 64), rank)


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_nibble_pack_roundtrip_exact(n):
    codes = torch.randint(0, 16, (3, 5, n), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, (n + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed, n), codes)


@pytest.mark.parametrize("dim", [-1, -2])
def test_int4_error_within_half_step(dim):
    torch.manual_seed(2)
    x = torch.randn(4, 9, 13)
    packed, scale = quantize_int4(x, dim=dim)
    back = dequantize_int4(packed, scale, 13)
    step = scale.float()
    # Half a quantization step, plus the clamp of values the fp16 scale rounding pushes past 7 steps.
    bound = step * 0.5 + (x.abs().amax(dim=dim, keepdim=True) - INT4_MAX * step).clamp_min(0)
    assert ((x - back).abs() <= bound + 1e-6).all()
    # 4 bits: SQNR of a Gaussian about 20 dB or better with per-slice scales.
    sqnr = 20 * torch.log10(x.norm() / (x - back).norm())
    assert sqnr > 17


def test_rope_inverse_roundtrip():
    torch.manual_seed(3)
    d, T = 16, 11
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = torch.randn(2, T, d)
    torch.testing.assert_close(invert_rope(apply_rope(x, cos, sin), cos, sin), x, rtol=1e-5, atol=1e-5)


def test_rotary_table_keeps_half_rows_and_gives_the_modules_cos_sin():
    """With equal halves (rotate_half convention) the table holds [size, d/2]; cos_sin still returns
    exactly the module's full-width rows, and a later position grows the table."""
    from kvpack.ops.rope import LlamaRotary, RotaryTable

    d = 16
    module = LlamaRotary(d)
    table = RotaryTable(module, d)
    pos = torch.tensor([0, 5, 300, 17])
    cos, sin = table.cos_sin(pos)
    ref_cos, ref_sin = module(torch.zeros(1), pos[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    c, s = table.table(301, pos.device)
    assert table.halves_equal and c.shape[1] == d // 2 and c.shape[0] >= 301
    assert torch.equal(c[pos], ref_cos[0][:, : d // 2]) and torch.equal(s[pos], ref_sin[0][:, : d // 2])


def test_rotary_table_keeps_full_rows_when_halves_differ():
    from kvpack.ops.rope import RotaryTable

    class Interleaved(torch.nn.Module):  # a rotary whose halves differ: the table must keep both
        def forward(self, x, position_ids):
            ang = position_ids[..., None].float() * torch.linspace(1.0, 0.01, 8)
            return ang.cos(), ang.sin()

    table = RotaryTable(Interleaved(), 8)
    cos, sin = table.cos_sin(torch.arange(10))
    assert not table.halves_equal and table.table(10, cos.device)[0].shape[1] == 8
    ref = Interleaved()(torch.zeros(1), torch.arange(10)[None])
    assert torch.equal(cos, ref[0][0]) and torch.equal(sin, ref[1][0])


def test_cache_layers_share_one_rotary_table_per_layer_type():
    from kvpack.hf.cache import KVPackCache


    llama = KVPackCache(tiny_llama(layers=3), "full")
    tables = {id(layer.layout.rope) for layer in llama.kvpack_layers}
    assert len(llama.kvpack_layers) == 3 and len(tables) == 1
    gemma = KVPackCache(tiny_gemma3(), "full")  # full-attention layers 1 and 3 share one type
    assert len({id(layer.layout.rope) for layer in gemma.kvpack_layers}) == 1


def test_rotary_table_follows_the_callers_device():
    """A table built on one device is moved (once) when asked for on another, never handed out on
    the wrong one (a kernel would get a pointer it cannot read)."""
    from kvpack.ops.rope import LlamaRotary, RotaryTable

    table = RotaryTable(LlamaRotary(8), 8)
    table.cos_sin(torch.arange(5))
    cos, sin = table.table(5, torch.device("meta"))
    assert cos.device.type == "meta" and sin.device.type == "meta"


def test_residual_codec_keeps_its_tensors_per_device():
    from kvpack.ops.residual_codec import HadamardLloydMax

    codec = HadamardLloydMax(16, seed=0)
    first = codec.on(torch.device("cpu"))
    assert all(a is b for a, b in zip(first, codec.on("cpu")))  # copied once, then reused
    m16, factor = codec.kernel_matrix
    assert torch.equal(first[2], m16) and torch.equal(m16.float() * factor, codec.matrix)


@pytest.mark.parametrize("name,bits", [("hadamard_lloyd_max", 2), ("hadamard_lloyd_max", 4), ("naive", 2)])
def test_residual_codes_are_the_levels_bucketize_gives(name, bits):
    """encode's codes (one compare per threshold) equal torch.bucketize's over the same unit values."""
    from kvpack.ops.bitpack import unpack_bits
    from kvpack.ops.residual_codec import make_residual_codec

    codec = make_residual_codec(name, 64, seed=3, bits=bits)
    r = torch.randn(257, 64, generator=torch.Generator().manual_seed(1))
    y = codec.rotate(r)
    unit = y / codec._scale(y).clamp_min(1e-30)[:, None]
    packed, _ = codec.encode(r)
    want = torch.bucketize(unit.contiguous(), torch.tensor(codec.thresholds))
    assert want.unique().numel() == 2 ** bits  # every level is used
    assert torch.equal(unpack_bits(packed, bits, 64).long(), want)
