"""AnchorKV: codebook, rotation, byte budget (Eq. 9 and the paper's worked example), utilities (Eq. 6),
tile-wise attention, bad input."""

import math

import pytest
import torch

from kvpack import attach
from kvpack.attention.reference import reference_attention
from kvpack.hf.cache import cache_kwargs
from kvpack.ops import lloyd_max
from kvpack.ops.hadamard import hadamard_matrix
from kvpack.ops.residual_codec import HadamardLloydMax
from kvpack.resident import get_resident_method
from kvpack.resident.anchor import AnchorConfig, base_bytes, residual_bytes, residual_slots, utilities

from .helpers import anchor_layout, clustered_kv, correlated_kv, tiny_llama


def test_lloyd_max_gaussian_codebook_is_the_known_optimum():
    levels, thresholds = lloyd_max.lloyd_max_gaussian(4)
    assert levels == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-3)
    assert thresholds == pytest.approx((-0.9816, 0.0, 0.9816), abs=1e-3)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    nearest = torch.tensor(levels)[torch.bucketize(x, torch.tensor(thresholds))]  # the quantizer they define
    mse = (nearest - x).square().mean()
    assert mse == pytest.approx(0.1175, abs=3e-3)  # the 2-bit Gaussian Lloyd–Max distortion


def test_hadamard_is_orthonormal_and_exactly_inverted():
    h = hadamard_matrix(64, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(64, dtype=torch.float64), rtol=0, atol=1e-12)
    rot = HadamardLloydMax(64, seed=3)  # the randomized Hadamard as the residual codec applies it
    x = torch.randn(10, 64)
    torch.testing.assert_close(rot.unrotate(rot.rotate(x)), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rot.rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(48)


def test_paper_worked_example_within_a_few_percent():
    """S = 32K, D = 128, H = 8, W = 32, k = 256, θ = 0.05 (paper Appendix A.1)."""
    S, D, H, k = 32768, 128, 8, 256
    m_full = S * H * D * 4
    assert m_full / 1e6 == pytest.approx(134.2, abs=0.05)
    m_base = base_bytes(S, H, D, k)
    n = residual_slots(0.05, S, H, D, k)
    assert abs(m_base / 3.39e6 - 1) < 0.05  # ours: 3.28 MB (int16 indices, fp16 coefficients, bits, counts)
    assert abs(n / 91_056 - 1) < 0.05  # ours: 95,391 (b_res = 32 code bytes + 4-byte scale)
    assert residual_bytes(D) == 36


def _prefill(store, H, group, S, d, seed=0):
    k, v = correlated_kv(H, S, d, seed=seed)
    q = torch.randn(H * group, S, d, generator=torch.Generator().manual_seed(seed + 1))
    out = store.attend(q, k, v, d ** -0.5)
    store.append(k, v, q, out)
    return q, k, v


@pytest.mark.parametrize("theta", [0.05, 0.1, 0.3])
def test_bytes_are_the_tensors_held_and_obey_the_budget(theta):
    H, group, S, d = 3, 3, 4096, 64
    store = get_resident_method("anchor", budget=theta).new_store(anchor_layout(H, group, d))
    _prefill(store, H, group, S, d)
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.tensors().values())
    n_k, n_v = store.n_residuals
    k_anchors = store.n_anchors
    assert store.nbytes() == base_bytes(S, H, d, k_anchors) + (n_k + n_v) * residual_bytes(d)
    m_full = S * H * d * 4
    n = residual_slots(theta, S, H, d, k_anchors)
    candidates = H * (S - k_anchors)  # anchors never compete
    assert (n_k, n_v) == (min(n // 2, candidates), min(n - n // 2, candidates))
    assert store.nbytes() <= theta * m_full
    if n // 2 < candidates:  # the budget binds: it is used to the last residual
        assert store.nbytes() > theta * m_full - 2 * residual_bytes(d)


def test_budget_below_fixed_cost_and_other_bad_input():
    store = get_resident_method("anchor", budget=0.02).new_store(anchor_layout())
    with pytest.raises(ValueError, match=r"budget θ = 0.02 is below AnchorKV's fixed cost"):
        _prefill(store, 2, 3, 600, 64)
    store = get_resident_method("anchor", budget=0.1, window=64).new_store(anchor_layout())
    with pytest.raises(ValueError, match="window W = 64 must be shorter than the prompt"):
        _prefill(store, 2, 3, 64, 64)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        get_resident_method("anchor").new_store(anchor_layout(d=48))
    with pytest.raises(ValueError, match="needs the model's rotary embedding"):
        get_resident_method("anchor").new_store(anchor_layout(rope=False))


@pytest.mark.parametrize("fields,match", [
    (dict(budget=0.0), r"budget must be in \(0, 1\]"),
    (dict(budget=1.01), r"budget must be in \(0, 1\]"),
    (dict(anchors=16, window=32), r"anchors \(k = 16\) must be >= window \(W = 32\)"),
    (dict(kernel=6), r"kernel \(κ\) must be odd"),
    (dict(kernel=0), "kernel must be >= 1"),
    (dict(rho=1.5), r"rho must be in \[0, 1\]"),
    (dict(rho=-0.1), r"rho must be in \[0, 1\]"),
    (dict(window=0), "window must be >= 1"),
])
def test_invalid_anchor_config(fields, match):
    with pytest.raises(ValueError, match=match):
        AnchorConfig(**fields)


def test_utility_matches_direct_first_order_output_change():
    """Eq. 6 per token equals ‖Δy‖²/ε² of a direct computation with that token's residual dropped
    (ε-scaled), averaged over the observation queries."""
    torch.manual_seed(5)
    H, group, S, d, W = 1, 2, 24, 8, 4
    q_all = torch.randn(H * group, S, d, dtype=torch.float64)
    k = torch.randn(H, S, d, dtype=torch.float64)
    v = torch.randn(H, S, d, dtype=torch.float64)
    r_k = torch.randn(H, S, d, dtype=torch.float64)  # already rotated residuals R_t r_t
    r_v = torch.randn(H, S, d, dtype=torch.float64)
    scaling = d ** -0.5
    pos = torch.arange(S - W, S)

    q_obs = q_all[:, S - W:].reshape(H, group * W, d)
    y_obs = torch.stack([reference_attention(q_all[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], scaling)[:, 0]
                         for p in pos.tolist()], dim=1).reshape(H, group * W, d)
    u_k, u_v = utilities(q_obs, y_obs, k, v, r_k, r_v, scaling, pos.repeat(group))
    eps = 1e-6
    for t in [0, 5, 11, 19]:
        for side, u in (("k", u_k), ("v", u_v)):
            k2, v2 = k.clone(), v.clone()
            if side == "k":
                k2[:, t] -= eps * r_k[:, t]
            else:
                v2[:, t] -= eps * r_v[:, t]
            y2 = torch.stack([reference_attention(q_all[:, p:p + 1], k2[:, :p + 1], v2[:, :p + 1], scaling)[:, 0]
                              for p in pos.tolist()], dim=1).reshape(H, group * W, d)
            direct = ((y2 - y_obs) / eps).square().sum(-1).mean(dim=1)
            assert u[0, t].item() == pytest.approx(direct[0].item(), rel=1e-4, abs=1e-12), (side, t)


def _plain_weights(q_obs, k_post, scaling, obs_pos, key_pos, lse=None):
    """Eq. 6's α written out: logits, the whole causal mask, softmax (or exp against a given lse)."""
    s = torch.einsum("hmd,hsd->hms", q_obs, k_post) * scaling
    s = s.masked_fill(key_pos[None, None, :] > obs_pos[None, :, None], float("-inf"))
    return torch.softmax(s, dim=-1) if lse is None else torch.exp(s - lse[..., None])


@pytest.mark.parametrize("segment", [False, True])
def test_observation_weights_and_blocked_utilities_equal_the_plain_formulas(monkeypatch, segment):
    """The fast forms (causal mask on the suffix only, Eq. 6 in token blocks updated in place, γ from
    the nearest-anchor score) against the formulas written out, on a prompt and on a re-compressed
    segment whose observation rows come after it (normalised by a given lse)."""
    import kvpack.resident.anchor.selection as sel

    g = torch.Generator().manual_seed(3)
    H, m, S, d = 2, 6, 37, 8
    q, y = (torch.randn(H, m, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v, r_k, r_v = (torch.randn(H, S, d, generator=g, dtype=torch.float64) for _ in range(4))
    if segment:
        key_pos = torch.arange(100, 100 + S)
        obs_pos = torch.tensor([140, 141, 142, 140, 141, 142])
        lse = torch.logsumexp(torch.einsum("hmd,hsd->hms", q, k) * 0.3, dim=-1) + 0.5  # the rows saw more keys
    else:
        key_pos, obs_pos, lse = torch.arange(S), torch.tensor([34, 35, 36, 34, 35, 36]), None
    alpha = _plain_weights(q, k, 0.3, obs_pos, key_pos, lse)
    torch.testing.assert_close(sel.observation_weights(q, k, 0.3, obs_pos, key_pos, lse), alpha, rtol=1e-12, atol=0)
    dist = (v[:, None] - y[:, :, None]).square().sum(-1)  # [H, m, S]
    ds = torch.einsum("hmd,hsd->hms", q, r_k) * 0.3
    want_k = (alpha.square() * ds.square() * dist).mean(1)
    want_v = alpha.square().mean(1) * r_v.square().sum(-1)
    monkeypatch.setattr(sel, "UTILITY_BLOCK", 5)  # 37 tokens: 7 full blocks and a short one
    u_k, u_v = sel.utilities(q, y, k, v, r_k, r_v, 0.3, obs_pos, key_pos, lse)
    torch.testing.assert_close(u_k, want_k, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(u_v, want_v, rtol=1e-9, atol=1e-15)
    anchors = k[:, [0, 9, 20]]
    index, gamma, residual = sel.project_onto_anchors(k, anchors)
    a = torch.gather(anchors, 1, index[..., None].expand(-1, -1, d))
    torch.testing.assert_close(gamma, (k * a).sum(-1) / (a * a).sum(-1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(residual, k - gamma[..., None] * a, rtol=1e-12, atol=1e-14)


def test_shared_observation_probabilities_give_snapkv_votes_and_eq6_weights():
    """Compression computes the window's attention once: the votes from it equal SnapKV's written out,
    and regrouped it is α of Eq. 6."""
    from kvpack.attention.scores import observation_probabilities, observation_votes
    from kvpack.resident.anchor.selection import observation_weights

    g = torch.Generator().manual_seed(4)
    H, group, S, d, W = 2, 3, 40, 8, 5
    q, k = torch.randn(H * group, S, d, generator=g), torch.randn(H, S, d, generator=g)
    probs = observation_probabilities(q, k, 0.25, W)
    logits = torch.einsum("hgwd,hsd->hgws", q[:, -W:].reshape(H, group, W, d), k) * 0.25
    hidden = torch.arange(S)[None, :] > torch.arange(S - W, S)[:, None]
    plain = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    torch.testing.assert_close(probs, plain, rtol=1e-6, atol=1e-7)
    votes = plain[..., :S - W].sum(dim=(1, 2))
    pooled = torch.nn.functional.avg_pool1d(votes[:, None], 3, stride=1, padding=1)[:, 0]
    torch.testing.assert_close(observation_votes(probs, 3), pooled, rtol=1e-6, atol=1e-7)
    alpha = observation_weights(q[:, -W:].reshape(H, group * W, d), k, 0.25, torch.arange(S - W, S).repeat(group))
    torch.testing.assert_close(probs.reshape(H, group * W, S), alpha, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("group", [1, 3, 4])
def test_tile_attention_equals_attention_over_reconstruction(group):
    H, S, d = 2, 333, 64
    store = get_resident_method("anchor", budget=0.15, tile=64).new_store(anchor_layout(H, group, d))
    _prefill(store, H, group, S, d)
    q = torch.randn(H * group, 3, d)
    kn, vn = correlated_kv(H, 3, d, seed=9)
    out = store.attend(q, kn, vn, 0.125)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(q, torch.cat([k_hat, kn], 1), torch.cat([v_hat, vn], 1), 0.125, causal_offset=S)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)


def test_anchors_exact_and_full_residuals_close_to_exact():
    H, group, S, d = 2, 3, 400, 64
    k, v = clustered_kv(H, S, d, seed=1), clustered_kv(H, S, d, seed=2)
    q = torch.randn(H * group, S, d, generator=torch.Generator().manual_seed(3))
    qn = torch.randn(H * group, 1, d)
    kn, vn = correlated_kv(H, 1, d, seed=4)
    exact = reference_attention(qn, torch.cat([k, kn], 1), torch.cat([v, vn], 1), 0.125).float()
    snr = {}
    for theta in (1.0, 0.22):
        store = get_resident_method("anchor", budget=theta, storage_dtype="float32").new_store(
            anchor_layout(H, group, d))
        store.append(k, v, q, store.attend(q, k, v, 0.125))
        out = store.attend(qn, kn, vn, 0.125)
        snr[theta] = 20 * math.log10(exact.norm() / (exact - out).norm())
        if theta == 1.0:
            assert store.n_residuals == (H * (S - store.n_anchors),) * 2  # every non-anchor token, both sides
            k_hat, _ = store.reconstruct()
            torch.testing.assert_close(k_hat[:, -32:], k[:, -32:], rtol=1e-4, atol=1e-4)  # window anchors exact
    assert snr[1.0] > 25, snr
    assert snr[1.0] > snr[0.22] + 5, snr  # the residuals are what brings it close


def test_generation_through_cache_keeps_prompt_compressed_and_tail_dense():
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(0, 128, (2, 400), generator=torch.Generator().manual_seed(1))
    with attach(model, "anchor", budget=0.15) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    assert out.shape == (2, 408) and cache.get_seq_length() == 407
    store = cache.kvpack_layers[1].rows[1]
    assert store.n_prompt == 400 and store.tail_k.shape[1] == 7


def test_recompression_of_the_dense_tail():
    H, group, S, d = 2, 3, 600, 64
    stores = {}
    for every in (None, 64):
        store = get_resident_method("anchor", budget=0.15, recompress_every=every).new_store(anchor_layout(H, group, d))
        _prefill(store, H, group, S, d)
        k, v = correlated_kv(H, 300, d, seed=11)
        for t in range(300):
            q = torch.randn(H * group, 1, d, generator=torch.Generator().manual_seed(100 + t))
            out = store.attend(q, k[:, t:t + 1], v[:, t:t + 1], 0.125)
            store.append(k[:, t:t + 1], v[:, t:t + 1], q, out)
        stores[every] = store
    plain, recompressed = stores[None], stores[64]
    assert len(recompressed.segments) == 1 + 300 // 64 and recompressed.tail_k.shape[1] == 300 % 64
    assert plain.tail_k.shape[1] == 300 and len(plain.segments) == 1
    assert recompressed.nbytes() == sum(t.numel() * t.element_size() for t in recompressed.tensors().values())
    assert recompressed.nbytes() < plain.nbytes()
    # Attention still equals attention over what is stored (segments reconstructed at their positions).
    q = torch.randn(H * group, 1, d)
    kn, vn = correlated_kv(H, 1, d, seed=12)
    k_hat, v_hat = recompressed.reconstruct()
    assert k_hat.shape[1] == S + 300
    ref = reference_attention(q, torch.cat([k_hat, kn], 1), torch.cat([v_hat, vn], 1), 0.125)
    torch.testing.assert_close(recompressed.attend(q, kn, vn, 0.125), ref.float(), rtol=1e-4, atol=1e-4)
    # The re-compressed stretch is close to the tokens it replaced.
    err = (k_hat[:, S:S + 256] - k[:, :256].to(torch.bfloat16).float()).norm() / k[:, :256].norm()
    assert err < 0.6


def test_budget_just_above_fixed_cost_stores_no_residuals_and_still_attends():
    # A budget that buys zero residual slots must not crash (the empty residual tensors are packed).
    H, group, S, d = 1, 2, 130, 32
    store = get_resident_method("anchor", budget=0.252, storage_dtype="float32", window=8, anchors=12,
                      attention_backend="torch").new_store(anchor_layout(H, group, d))
    _prefill(store, H, group, S, d)
    assert store.n_residuals == (0, 0)
    q = torch.randn(H * group, 1, d)
    kn, vn = correlated_kv(H, 1, d, seed=3)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(q, torch.cat([k_hat, kn], 1), torch.cat([v_hat, vn], 1), 0.125)
    torch.testing.assert_close(store.attend(q, kn, vn, 0.125), ref.float(), rtol=1e-4, atol=1e-4)


def test_nearest_anchor_is_the_largest_abs_cosine_in_any_block_size(monkeypatch):
    import kvpack.resident.anchor.selection as anchor_mod

    g = torch.Generator().manual_seed(0)
    x, anchors = torch.randn(3, 1000, 32, generator=g), torch.randn(3, 40, 32, generator=g)
    anchors[0, 5] *= -100.0  # a long anchor pointing the other way: |cos| ignores sign and length
    cos = torch.einsum("hsd,hkd->hsk", x, anchors) / (x.norm(dim=-1)[..., None] * anchors.norm(dim=-1)[:, None, :])
    expected = cos.abs().argmax(dim=-1)
    assert torch.equal(anchor_mod.nearest_anchor(x, anchors), expected)
    monkeypatch.setattr(anchor_mod, "ASSIGN_BLOCK_ELEMENTS", 3 * 40 * 77)  # 77-token blocks
    assert torch.equal(anchor_mod.nearest_anchor(x, anchors), expected)
