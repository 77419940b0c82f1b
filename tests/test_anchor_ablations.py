"""AnchorKV's ablation switches (paper Fig. 5) and the two options beyond the paper (neighbourhood
pooling of the ranking, uint8 anchor indices): each does what it names, and bytes stay honest."""

import math

import pytest
import torch

from kvpack.attention.reference import reference_attention
from kvpack.ops.bitpack import unpack_bits
from kvpack.ops.residual_codec import HadamardLloydMax, NaiveTwoBit
from kvpack.ops.rope import invert_rope
from kvpack.resident import get_resident_method
from kvpack.resident.anchor import AnchorConfig, anchors_for_budget, base_bytes, pool_neighbourhood, residual_bytes

from .helpers import anchor_layout, clustered_kv

H, GROUP, S, D, SCALING = 2, 3, 1024, 64, 0.125


def _inputs(seed=0, value_scale=(1.0, 1.0)):
    k, v = clustered_kv(H, S, D, seed=seed), clustered_kv(H, S, D, seed=seed + 1)
    v = v * torch.tensor(value_scale)[:, None, None]
    q = torch.randn(H * GROUP, S, D, generator=torch.Generator().manual_seed(seed + 2))
    return k, v, q


def _compressed(k, v, q, **cfg):
    codec = get_resident_method("anchor", **{"storage_dtype": "float32", "budget": 0.15, **cfg})
    store = codec.new_store(anchor_layout(H, GROUP, D))
    store.append(k, v, q, store.attend(q, k, v, SCALING))
    return store


def _masks(store):
    seg = store.segments[0]
    return [unpack_bits(seg[f"mask_{side}"], 1, S).bool() for side in ("k", "v")]


def _true_residuals(store, k, v):
    """Per side ``(x, r, is_anchor)`` recomputed from the inputs and the stored assignment (fp32 γ)."""
    cos, sin = store.layout.rope.cos_sin(torch.arange(S))
    out = []
    seg = store.segments[0]
    is_anchor = None
    for side, x in (("v", v), ("k", invert_rope(k, cos, sin))):
        a = torch.gather(store.anchors[f"anchor_{side}"], 1, seg[f"index_{side}"].long()[..., None].expand(-1, -1, D))
        if is_anchor is None:  # values are stored exactly (fp32, no RoPE): an anchor is its own anchor row
            is_anchor = (a == x).all(-1)
        gamma = (x * a).sum(-1) / (a * a).sum(-1)
        out.append((x, x - gamma[..., None] * a, is_anchor))
    return out[::-1]  # keys first


def _assert_top_by(score, chosen, is_anchor, per_head=False):
    """Every chosen candidate scores at least as high as every unchosen non-anchor one."""
    assert not (chosen & is_anchor).any()
    groups = [(score[h], chosen[h], is_anchor[h]) for h in range(H)] if per_head else [(score, chosen, is_anchor)]
    for s, c, a in groups:
        assert c.any() and (~c & ~a).any()
        assert s[c].min() >= s[~c & ~a].max() * (1 - 1e-5)


@pytest.mark.parametrize("ranking", ["residual_norm", "cosine", "attention"])
def test_single_factor_rankings_pick_what_they_name(ranking):
    k, v, q = _inputs()
    store = _compressed(k, v, q, ranking=ranking)
    W = store.config.window
    # Mean attention weight of the W observation queries (all group heads) on each key.
    logits = torch.einsum("hmd,hsd->hms", q[:, -W:].reshape(H, GROUP * W, D), k) * SCALING
    rows = torch.arange(S - W, S).repeat(GROUP)
    usage = torch.softmax(logits.masked_fill(torch.arange(S)[None, None] > rows[None, :, None], -math.inf), -1).mean(1)
    for chosen, (x, r, is_anchor) in zip(_masks(store), _true_residuals(store, k, v)):
        score = {"residual_norm": r.square().sum(-1), "cosine": r.square().sum(-1) / x.square().sum(-1),
                 "attention": usage}[ranking]
        _assert_top_by(score, chosen, is_anchor)


def test_utility_ranking_beats_random_on_the_observation_queries():
    """The point of Eq. 6: at a tight budget, the observation queries' outputs change less than with
    residuals placed at random (same anchors, same byte count)."""
    k, v, q = _inputs(seed=4)
    W = 32
    exact = torch.stack([reference_attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], SCALING)[:, 0]
                         for p in range(S - W, S)], 1)
    err = {}
    for ranking in ("utility", "random"):
        store = _compressed(k, v, q, ranking=ranking, budget=0.12)
        k_hat, v_hat = store.reconstruct()
        got = torch.stack([reference_attention(q[:, p:p + 1], k_hat[:, :p + 1], v_hat[:, :p + 1], SCALING)[:, 0]
                           for p in range(S - W, S)], 1)
        err[ranking] = ((got - exact).norm() / exact.norm()).item()
        assert store.n_residuals[0] > 0
    assert err["utility"] < 0.9 * err["random"], err  # measured: 0.078 vs 0.091


def test_random_ranking_is_seeded():
    k, v, q = _inputs()
    masks = [_masks(_compressed(k, v, q, ranking="random", seed=s)) for s in (0, 0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
    assert not torch.equal(masks[0][0], masks[2][0])


def test_per_head_split_gives_equal_shares_and_pooling_follows_need():
    k, v, q = _inputs(value_scale=(10.0, 1.0))  # head 0's value residuals are 10x larger
    for split in ("pooled", "per_head"):
        store = _compressed(k, v, q, residual_split=split)
        n_v = store.n_residuals[1]
        per_head = _masks(store)[1].sum(-1)
        if split == "per_head":
            assert per_head.tolist() == [math.ceil(n_v / H), n_v // H]
        else:
            assert per_head[0] > 0.75 * n_v  # the head that needs the residuals gets them


def test_no_random_anchors_is_rho_one():
    k, v, q = _inputs()
    a = _compressed(k, v, q, random_anchors=False, rho=0.3, anchors=64, budget=0.25)
    b = _compressed(k, v, q, rho=1.0, anchors=64, budget=0.25)
    c = _compressed(k, v, q, rho=0.3, anchors=64, budget=0.25)
    assert all(torch.equal(a.tensors()[n], b.tensors()[n]) for n in a.tensors())
    assert not torch.equal(a.anchors["anchor_k"], c.anchors["anchor_k"])


def test_no_residuals_spends_the_budget_on_anchors():
    k, v, q = _inputs()
    theta = 0.15
    store = _compressed(k, v, q, residuals=False, budget=theta)
    m_full = S * H * D * 4
    expected_k, index_bytes = anchors_for_budget(theta, S, H, D, 32, anchor_bytes=4)
    assert store.n_residuals == (0, 0) and store.n_anchors == expected_k > _compressed(k, v, q).n_anchors
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == base_bytes(S, H, D, expected_k, 4, index_bytes) <= theta * m_full
    assert store.nbytes() + 2 * H * D * 4 > theta * m_full  # one more anchor would not fit
    qn = torch.randn(H * GROUP, 1, D)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(qn, torch.cat([k_hat, k[:, :1]], 1), torch.cat([v_hat, v[:, :1]], 1), SCALING)
    torch.testing.assert_close(store.attend(qn, k[:, :1], v[:, :1], SCALING), ref.float(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="below AnchorKV's fixed cost"):
        _compressed(k, v, q, residuals=False, budget=0.04)


def test_residual_codecs():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(4000, D, generator=g)
    mse = {}
    for codec in (HadamardLloydMax(D, seed=3), NaiveTwoBit(D)):
        codes, scale = codec.encode(r)
        assert codes.shape == (4000, D // 4) and codes.dtype == torch.uint8 and scale.dtype == torch.float32
        mse[codec.name] = ((codec.decode(codes, scale) - r).square().sum() / r.square().sum()).item()
    assert mse["hadamard_lloyd_max"] == pytest.approx(0.1175, abs=0.01)  # the Gaussian Lloyd–Max distortion
    assert mse["naive"] > 1.3 * mse["hadamard_lloyd_max"], mse
    # The naive grid: absmax · {−1, −⅓, ⅓, 1} (⅓ as its fp16 value, 0.33325); values round to the nearest.
    naive = NaiveTwoBit(D)
    third = naive.levels[2]
    assert naive.levels == (-1.0, -third, third, 1.0) and abs(third - 1 / 3) < 1e-4
    grid = torch.tensor([[3.0, -1.0, 1.0, -3.0] * (D // 4), [0.9, 2.1, -2.2, -0.1] + [0.0] * (D - 4)])
    back = naive.decode(*naive.encode(grid))
    torch.testing.assert_close(back[0], torch.tensor([3.0, -3 * third, 3 * third, -3.0] * (D // 4)))
    torch.testing.assert_close(back[1, :4], torch.tensor([2.2 * third, 2.2, -2.2, -2.2 * third]))


def test_naive_codec_store_attends_over_what_it_holds():
    k, v, q = _inputs()
    store = _compressed(k, v, q, residual_codec="naive")
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.tensors().values())
    qn = torch.randn(H * GROUP, 1, D)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(qn, torch.cat([k_hat, k[:, :1]], 1), torch.cat([v_hat, v[:, :1]], 1), SCALING)
    torch.testing.assert_close(store.attend(qn, k[:, :1], v[:, :1], SCALING), ref.float(), rtol=1e-4, atol=1e-4)


def test_narrow_index_stores_uint8_and_buys_residuals():
    k, v, q = _inputs()
    wide, narrow = _compressed(k, v, q), _compressed(k, v, q, narrow_index=True)
    assert narrow.segments[0]["index_k"].dtype == torch.uint8 and wide.segments[0]["index_k"].dtype == torch.int16
    for store, index_bytes in ((wide, 2), (narrow, 1)):
        held = sum(t.numel() * t.element_size() for t in store.tensors().values())
        assert store.nbytes() == held == base_bytes(S, H, D, store.n_anchors, 4, index_bytes) \
            + sum(store.n_residuals) * residual_bytes(D)
        assert held <= 0.15 * S * H * D * 4
    # One byte per token and side: 2·H·S bytes more for residuals.
    assert sum(narrow.n_residuals) - sum(wide.n_residuals) == pytest.approx(2 * H * S / residual_bytes(D), abs=1)
    assert torch.equal(narrow.segments[0]["index_v"].long(), wide.segments[0]["index_v"].long())
    many = _compressed(k, v, q, narrow_index=True, anchors=300, budget=1.0)
    assert many.segments[0]["index_k"].dtype == torch.int16  # k > 256 does not fit a byte


def test_pool_neighbourhood():
    u = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, -math.inf, 0.0, 1.0]])
    assert pool_neighbourhood(u, 3).tolist() == [[0.0, 5.0, 5.0, 5.0, 0.0, -math.inf, 1.0, 1.0]]
    assert torch.equal(pool_neighbourhood(u, 1), u)


def test_residual_pooling_ranks_by_the_neighbourhood_maximum():
    k, v, q = _inputs()
    plain, pooled = _compressed(k, v, q, ranking="residual_norm"), \
        _compressed(k, v, q, ranking="residual_norm", residual_pooling=5)
    assert plain.n_residuals == pooled.n_residuals
    for chosen, (_, r, is_anchor) in zip(_masks(pooled), _true_residuals(pooled, k, v)):
        score = pool_neighbourhood(r.square().sum(-1).masked_fill(is_anchor, -math.inf), 5)
        _assert_top_by(score, chosen, is_anchor)
    assert not torch.equal(_masks(plain)[0], _masks(pooled)[0])


@pytest.mark.parametrize("fields,match", [
    (dict(ranking="entropy"), "ranking must be one of"),
    (dict(residual_split="half"), "residual_split must be one of"),
    (dict(residual_codec="int2"), "residual_codec must be one of"),
    (dict(residual_pooling=4), "residual_pooling must be odd"),
    (dict(residual_pooling=0), "residual_pooling must be >= 1"),
    (dict(residuals="no"), "residuals must be true or false"),
    (dict(narrow_index=1), "narrow_index must be true or false"),
    (dict(residuals=False, anchors=64), "anchors must be unset when residuals=false"),
])
def test_invalid_ablation_config(fields, match):
    with pytest.raises(ValueError, match=match):
        AnchorConfig(**fields)


@pytest.mark.parametrize("rho", [0.0, 0.7, 1.0])
def test_select_anchors_window_top_votes_and_seeded_random(rho):
    from kvpack.resident.anchor import select_anchors

    S_, W, k = 700, 16, 60
    votes = torch.rand(3, S_ - W, generator=torch.Generator().manual_seed(1))
    pos = select_anchors(votes, S_, k, W, rho, torch.Generator().manual_seed(2))
    n_top = round(rho * (k - W))
    assert pos.shape == (3, k)
    for h in range(3):
        assert torch.equal(pos[h], pos[h].unique())  # sorted, no repeats
        assert set(range(S_ - W, S_)) <= set(pos[h].tolist())  # the window
        assert set(torch.topk(votes[h], n_top).indices.tolist()) <= set(pos[h].tolist())  # the top votes
    again = select_anchors(votes, S_, k, W, rho, torch.Generator().manual_seed(2))
    other = select_anchors(votes, S_, k, W, rho, torch.Generator().manual_seed(3))
    assert torch.equal(pos, again)
    assert torch.equal(pos, other) == (n_top == k - W)  # only the random share depends on the seed


def test_budget_above_saturation_buys_anchors_with_above_saturation_anchors():
    """Issue 16: past the 2-bit saturation point (a residual for every non-anchor token-side) the
    paper's AnchorKV leaves the budget unspent; ``above_saturation="anchors"`` (anchor_plus's
    alternative to its default 4-bit tier) spends it on more anchors — exact tokens — and stays within θ."""
    from kvpack.resident.anchor import anchors_above_saturation

    k, v, q = _inputs()
    m_full = S * H * D * 2 * 2  # bf16 keys and values
    idle = _compressed(k, v, q, budget=0.5)
    spent = _compressed(k, v, q, budget=0.5, above_saturation="anchors")
    candidates = 2 * H * (S - idle.n_anchors)
    assert sum(idle.n_residuals) == candidates and idle.nbytes() < 0.26 * m_full  # saturated: bytes left unspent
    assert spent.n_anchors == anchors_above_saturation(0.5, S, H, D, idle.n_anchors, anchor_bytes=4) > idle.n_anchors
    assert sum(spent.n_residuals) == 2 * H * (S - spent.n_anchors)  # still every non-anchor token-side
    held = sum(t.numel() * t.element_size() for t in spent.tensors().values())
    assert spent.nbytes() == held <= 0.5 * m_full
    assert held + 2 * H * (D * 4 - residual_bytes(D)) > 0.5 * m_full  # one more anchor would not fit
    errors = []
    for store in (idle, spent):
        k_hat, v_hat = store.reconstruct()
        errors.append(float((k_hat - k).square().sum() + (v_hat - v).square().sum()))
    assert errors[1] < 0.8 * errors[0], errors  # more tokens exact: a smaller reconstruction error
    qn = torch.randn(H * GROUP, 1, D)
    k_hat, v_hat = spent.reconstruct()
    ref = reference_attention(qn, torch.cat([k_hat, k[:, :1]], 1), torch.cat([v_hat, v[:, :1]], 1), SCALING)
    torch.testing.assert_close(spent.attend(qn, k[:, :1], v[:, :1], SCALING), ref.float(), rtol=1e-4, atol=1e-4)
    # Below saturation the option changes nothing.
    low, low_spent = _compressed(k, v, q, budget=0.15), _compressed(k, v, q, budget=0.15, above_saturation="anchors")
    assert all(torch.equal(low.tensors()[n], low_spent.tensors()[n]) for n in low.tensors())
