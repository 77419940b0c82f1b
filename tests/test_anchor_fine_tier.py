"""anchor_plus's fine tier (issue 16, beyond the paper): past the 2-bit saturation point the budget
upgrades the top-ranked token-sides to 4-bit residuals, then buys anchors. Codec, budget arithmetic,
what the store chooses, bytes against the tensors held, and attention over both tiers."""

import math

import pytest
import torch

from kvpack.attention.reference import reference_attention
from kvpack.ops.bitpack import unpack_bits
from kvpack.ops.residual_codec import HadamardLloydMax, NaiveTwoBit, make_residual_codec
from kvpack.resident import get_resident_method
from kvpack.resident.anchor import (
    anchors_above_saturation,
    fine_residual_slots,
    fine_tier_bytes,
    residual_bytes,
    saturation_cost,
)

from .helpers import anchor_layout, clustered_kv

H, GROUP, S, D, SCALING = 2, 3, 1024, 64, 0.125
M_FULL = S * H * D * 2 * 2  # dense bf16 keys and values


def _inputs(seed=0):
    k, v = clustered_kv(H, S, D, seed=seed), clustered_kv(H, S, D, seed=seed + 1)
    q = torch.randn(H * GROUP, S, D, generator=torch.Generator().manual_seed(seed + 2))
    return k, v, q


def _compressed(k, v, q, **cfg):
    codec = get_resident_method("anchor", **{"storage_dtype": "bfloat16", "budget": 0.3,
                                             "above_saturation": "residual4", **cfg})
    store = codec.new_store(anchor_layout(H, GROUP, D))
    store.append(k, v, q, store.attend(q, k, v, SCALING))
    return store


def _held(store):
    return sum(t.numel() * t.element_size() for t in store.tensors().values())


def test_four_bit_codec_shares_the_rotation_and_reaches_the_lloyd_max_distortion():
    r = torch.randn(4000, D, generator=torch.Generator().manual_seed(0))
    coarse, fine = HadamardLloydMax(D, seed=3), HadamardLloydMax(D, seed=3, bits=4)
    assert torch.equal(coarse.matrix, fine.matrix) and torch.equal(coarse.signs, fine.signs)
    codes, scale = fine.encode(r)
    assert codes.shape == (4000, D // 2) and codes.dtype == torch.uint8
    mse = float((fine.decode(codes, scale) - r).square().sum() / r.square().sum())
    assert mse == pytest.approx(0.0095, abs=0.0015)  # the 16-level Gaussian Lloyd–Max distortion (0.0095010)
    assert len(fine.levels) == 16 and list(fine.levels) == sorted(fine.levels)
    # The naive form: 16 evenly spaced levels over [−absmax, absmax]; an on-grid vector decodes exactly.
    naive = NaiveTwoBit(D, bits=4)
    assert naive.levels[0] == -1.0 and naive.levels[-1] == 1.0
    grid = torch.tensor([[(2 * (i % 16) - 15) / 15 * 3 for i in range(D)]])
    torch.testing.assert_close(naive.decode(*naive.encode(grid)), grid, rtol=1e-3, atol=1e-3)
    assert residual_bytes(D, 4) == D // 2 + 4 and residual_bytes(D) == D // 4 + 4
    with pytest.raises(ValueError, match="2 or 4 bits"):
        make_residual_codec("hadamard_lloyd_max", D, seed=0, bits=3)


def test_fine_slots_arithmetic():
    k0 = 32
    idle = saturation_cost(S, H, D, k0)  # every non-anchor token-side 2-bit
    step = residual_bytes(D, 4) - residual_bytes(D)
    meta = fine_tier_bytes(S, H)
    assert meta == 2 * H * (S // 8 + S // 32 * 4)
    # Below saturation plus the tier's metadata plus one upgrade: nothing.
    assert fine_residual_slots((idle + meta + step - 1) / M_FULL, S, H, D, k0) == 0
    assert fine_residual_slots((idle + meta + step) / M_FULL, S, H, D, k0) == 1
    theta = (idle + meta + 1000 * step + step // 2) / M_FULL
    assert fine_residual_slots(theta, S, H, D, k0) == 1000
    # Capped at every candidate; the rest then buys anchors (each anchor replaces a 4-bit residual).
    assert fine_residual_slots(0.9, S, H, D, k0) == 2 * H * (S - k0)
    k = anchors_above_saturation(0.5, S, H, D, k0, bits=4)
    assert k > k0
    assert saturation_cost(S, H, D, k, bits=4) <= 0.5 * M_FULL < saturation_cost(S, H, D, k + 1, bits=4)


@pytest.mark.parametrize("ranking", ["residual_norm", "utility"])
def test_fine_tier_upgrades_the_top_ranked_token_sides_within_the_budget(ranking):
    k, v, q = _inputs()
    store = _compressed(k, v, q, ranking=ranking, storage_dtype="float32")  # fp32: residuals recomputable
    seg = store.segments[0]
    expected = fine_residual_slots(0.3, S, H, D, store.n_anchors, anchor_bytes=4)
    assert 0 < sum(store.n_fine) == expected < 2 * H * (S - store.n_anchors)  # a partial upgrade
    assert store.n_fine == (expected // 2, expected - expected // 2)  # the paper's K/V split
    held = _held(store)
    assert store.nbytes() == held <= 0.3 * M_FULL < held + (residual_bytes(D, 4) - residual_bytes(D))
    assert seg["fine_res_k"].shape == (store.n_fine[0], D // 2) and seg["res_k"].shape == (store.n_residuals[0], D // 4)
    rank = {}
    if ranking == "residual_norm":  # checkable from the store: ‖r‖² of the stored projection
        from kvpack.ops.rope import invert_rope

        cos, sin = store.layout.rope.cos_sin(torch.arange(S))
        for side, x in (("k", invert_rope(k, cos, sin)), ("v", v)):
            index = seg[f"index_{side}"].long()[..., None].expand(-1, -1, D)
            a = torch.gather(store.anchors[f"anchor_{side}"], 1, index)
            gamma = (x * a).sum(-1) / (a * a).sum(-1)  # the fp32 γ the store ranked with (it keeps fp16)
            rank[side] = (x - gamma[..., None] * a).square().sum(-1)
    for side in ("k", "v"):
        coarse = unpack_bits(seg[f"mask_{side}"], 1, S).bool()
        fine = unpack_bits(seg[f"fine_mask_{side}"], 1, S).bool()
        assert not (coarse & fine).any()  # a token-side has at most one residual
        assert int((coarse | fine).sum()) == H * (S - store.n_anchors)  # past saturation: every non-anchor one
        if side in rank:  # every upgraded token-side ranks at least as high as every 2-bit one
            assert rank[side][fine].min() >= rank[side][coarse].max() * (1 - 1e-3)


def test_fine_tier_reconstructs_closer_and_attention_reads_both_tiers():
    k, v, q = _inputs()
    errors = {}
    for mode in ("idle", "anchors", "residual4"):
        store = _compressed(k, v, q, above_saturation=mode)
        k_hat, v_hat = store.reconstruct()
        errors[mode] = float((k_hat - k).square().sum() + (v_hat - v).square().sum())
        if mode == "residual4":
            qn = torch.randn(H * GROUP, 1, D)
            ref = reference_attention(qn, torch.cat([k_hat, k[:, :1]], 1), torch.cat([v_hat, v[:, :1]], 1), SCALING)
            torch.testing.assert_close(store.attend(qn, k[:, :1], v[:, :1], SCALING), ref.float(), rtol=1e-4,
                                       atol=1e-4)
    # Same bytes as "anchors" (both spend the budget), a smaller error; far below the paper's idle bytes.
    assert errors["residual4"] < 0.6 * errors["anchors"] < 0.6 * errors["idle"], errors
    # Per upgraded token-side the residual's error is the 4-bit codec's (≈ 1/12 of the 2-bit one).
    store = _compressed(k, v, q, residual_split="per_head")
    seg = store.segments[0]
    fine = unpack_bits(seg["fine_mask_v"], 1, S).bool()
    coarse = unpack_bits(seg["mask_v"], 1, S).bool()
    _, v_hat = store.reconstruct()
    a = torch.gather(store.anchors["anchor_v"].float(), 1, seg["index_v"].long()[..., None].expand(-1, -1, D))
    r = v - seg["coef_v"].float()[..., None] * a
    rel = {name: float((v_hat - v)[m].square().sum() / r[m].square().sum()) for name, m in (("4", fine), ("2", coarse))}
    assert rel["4"] < 0.03 and rel["2"] > 0.08, rel


def test_fine_tier_then_anchors_at_a_high_budget_and_nothing_below_saturation():
    k, v, q = _inputs()
    store = _compressed(k, v, q, budget=0.5)
    assert store.n_residuals == (0, 0)  # every token-side upgraded ...
    assert sum(store.n_fine) == 2 * H * (S - store.n_anchors)
    default_k = max(math.floor(S / 128), 32)
    assert store.n_anchors == anchors_above_saturation(0.5, S, H, D, default_k, bits=4) > default_k  # ... then anchors
    assert store.nbytes() == _held(store) <= 0.5 * M_FULL
    # With k fixed the fine tier still applies, and no anchors are added.
    fixed = _compressed(k, v, q, budget=0.5, anchors=40)
    assert fixed.n_anchors == 40 and sum(fixed.n_fine) == 2 * H * (S - 40) and _held(fixed) <= 0.5 * M_FULL
    # Below the 2-bit saturation point the option changes nothing: the paper's tensors, bit for bit.
    low, paper = _compressed(k, v, q, budget=0.15), _compressed(k, v, q, budget=0.15, above_saturation="idle")
    assert low.tensors().keys() == paper.tensors().keys()
    assert all(torch.equal(low.tensors()[n], paper.tensors()[n]) for n in low.tensors())
    assert low.resolved_params()["fine_residuals_k"] == 0


def test_recompressed_segments_get_a_fine_tier_within_their_budget():
    k, v, q = _inputs()
    store = get_resident_method("anchor", storage_dtype="float32", budget=0.5, above_saturation="residual4",
                      recompress_every=64).new_store(anchor_layout(H, GROUP, D))
    store.append(k[:, :512], v[:, :512], q[:, :512], store.attend(q[:, :512], k[:, :512], v[:, :512], SCALING))
    for t in range(512, 512 + 70):
        qt, kt, vt = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]
        store.append(kt, vt, qt, store.attend(qt, kt, vt, SCALING))
    assert len(store.segments) == 2 and "fine_mask_k" in store.segments[1]
    seg = store.segments[1]
    seg_bytes = sum(t.numel() * t.element_size() for t in seg.values())
    assert seg_bytes <= 0.5 * 64 * H * D * 4  # Eq. 9 over the segment, bf16 dense bytes
    k_hat, v_hat = store.reconstruct()
    qn = torch.randn(H * GROUP, 1, D)
    ref = reference_attention(qn, torch.cat([k_hat, k[:, :1]], 1), torch.cat([v_hat, v[:, :1]], 1), SCALING)
    torch.testing.assert_close(store.attend(qn, k[:, :1], v[:, :1], SCALING), ref.float(), rtol=1e-4, atol=1e-4)


def test_anchor_plus_refuses_an_unknown_above_saturation_mode():
    with pytest.raises(ValueError, match="above_saturation"):
        get_resident_method("anchor_plus", budget=0.3, above_saturation="residual8")
