"""PuzzleKV store: attention from factors, page policy, incremental decode, bytes, budgets."""

import math

import pytest
import torch

from kvpack.attention.pages import factorized_pages_partial
from kvpack.attention.reference import reference_attention
from kvpack.attention.softmax_merge import dense_partial, finalize, group_queries, merge_partials, ungroup_output
from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout, get_resident_method
from kvpack.resident.puzzle import default_ranks, expected_bytes, layout_at, page_ratio

from .helpers import correlated_kv


def _layout(kv_heads, group, d, rope=None):
    return LayerLayout(layer_idx=0, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d, rope=rope)


@pytest.mark.parametrize("P,n_pages,rk,rv", [(8, 5, 3, 2), (16, 3, 16, 16), (5, 7, 1, 4)])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_factor_attention_equals_dense_over_reconstruction(P, n_pages, rk, rv, group):
    torch.manual_seed(0)
    H, d, Q = 2, 12, 3
    lk, rkf = torch.randn(H, n_pages, P, rk, dtype=torch.float64), torch.randn(H, n_pages, rk, d, dtype=torch.float64)
    lv, rvf = torch.randn(H, n_pages, P, rv, dtype=torch.float64), torch.randn(H, n_pages, rv, d, dtype=torch.float64)
    q = torch.randn(H * group, Q, d, dtype=torch.float64)
    qg = group_queries(q, H)
    # Two tiles merged by online softmax, plus a dense part.
    dense_k, dense_v = torch.randn(H, 7, d, dtype=torch.float64), torch.randn(H, 7, d, dtype=torch.float64)
    half = n_pages // 2
    states = [
        factorized_pages_partial(qg, lk[:, :half], rkf[:, :half], lv[:, :half], rvf[:, :half], 0.3),
        factorized_pages_partial(qg, lk[:, half:], rkf[:, half:], lv[:, half:], rvf[:, half:], 0.3),
        dense_partial(qg, dense_k, dense_v, 0.3),
    ]
    out = ungroup_output(finalize(merge_partials(states)), H * group)
    k_hat = torch.cat([(lk @ rkf).reshape(H, -1, d), dense_k], dim=1)
    v_hat = torch.cat([(lv @ rvf).reshape(H, -1, d), dense_v], dim=1)
    torch.testing.assert_close(out, reference_attention(q, k_hat, v_hat, 0.3), rtol=1e-10, atol=1e-10)


def _run_store(store, k, v, group, prefill, scaling=0.25, seed=1):
    """Prefill ``prefill`` tokens, then decode the rest one by one; returns per-step outputs and queries."""
    g = torch.Generator().manual_seed(seed)
    H, T, d = k.shape
    qs = torch.randn(H * group, T, d, generator=g)
    outs = [store.attend(qs[:, :prefill], k[:, :prefill], v[:, :prefill], scaling)]
    store.append(k[:, :prefill], v[:, :prefill], qs[:, :prefill], outs[0])
    for t in range(prefill, T):
        o = store.attend(qs[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], scaling)
        outs.append(o)
        store.append(k[:, t:t + 1], v[:, t:t + 1], qs[:, t:t + 1], o)
    return qs, outs


@pytest.mark.parametrize("T,prefill", [(97, 60), (54, 54), (17, 9)])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_full_rank_store_matches_original_attention(T, prefill, group):
    H, d, P = 2, 16, 8
    k, v = correlated_kv(H, T, d)
    store = get_resident_method("puzzle", page_size=P, rank_k=P, rank_v=P, storage_dtype="float32").new_store(
        _layout(H, group, d))
    qs, outs = _run_store(store, k, v, group, prefill)
    # Prefill is exact causal attention; each decode step attends to all tokens so far.
    torch.testing.assert_close(outs[0], reference_attention(qs[:, :prefill], k[:, :prefill], v[:, :prefill], 0.25,
                                                             causal_offset=0).float(), rtol=1e-4, atol=1e-4)
    for i, t in enumerate(range(prefill, T), start=1):
        ref = reference_attention(qs[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], 0.25).float()
        torch.testing.assert_close(outs[i], ref, rtol=1e-4, atol=1e-4)
    assert store.n_pages == layout_at(T, store.config)[1]


@pytest.mark.parametrize("group", [1, 3, 4])
def test_low_rank_store_matches_attention_over_its_reconstruction(group):
    H, d, P, T = 3, 16, 8, 83
    k, v = correlated_kv(H, T, d, seed=4)
    store = get_resident_method("puzzle", page_size=P, rank_k=3, rank_v=2, storage_dtype="float32").new_store(
        _layout(H, group, d))
    store.append(k, v)
    q = torch.randn(H * group, 4, d)
    k_new, v_new = correlated_kv(H, 4, d, seed=5)
    out = store.attend(q, k_new, v_new, 0.25)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(q, torch.cat([k_hat, k_new], 1), torch.cat([v_hat, v_new], 1), 0.25, causal_offset=T)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    # The factorized part really is low rank and close to the original (quality threshold, not equality).
    snr = 20 * math.log10(k.norm() / (k - k_hat).norm())
    assert 5 < snr < 60


def test_pre_rope_keys_full_rank_exact_and_low_rank_consistent():
    H, d, P, T = 2, 16, 8, 70
    rope = RotaryTable(LlamaRotary(d), d)
    k, v = correlated_kv(H, T, d, seed=6)
    layout = _layout(H, 2, d, rope=rope)
    full = get_resident_method("puzzle", page_size=P, rank_k=P, rank_v=P, key_rope="pre", storage_dtype="float32")
    store = full.new_store(layout)
    store.append(k, v)
    q = torch.randn(4, 1, d)
    kn, vn = correlated_kv(H, 1, d, seed=7)
    ref = reference_attention(q, torch.cat([k, kn], 1), torch.cat([v, vn], 1), 0.25).float()
    torch.testing.assert_close(store.attend(q, kn, vn, 0.25), ref, rtol=1e-4, atol=1e-4)
    low = get_resident_method("puzzle", page_size=P, rank_k=3, rank_v=3, key_rope="pre", storage_dtype="float32")
    store = low.new_store(layout)
    store.append(k, v)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(q, torch.cat([k_hat, kn], 1), torch.cat([v_hat, vn], 1), 0.25).float()
    torch.testing.assert_close(store.attend(q, kn, vn, 0.25), ref, rtol=1e-4, atol=1e-4)


def test_incremental_decode_factorizes_each_page_once():
    H, d, P = 2, 16, 8
    codec = get_resident_method("puzzle", page_size=P, rank_k=4, rank_v=4)
    store = codec.new_store(_layout(H, 2, d))
    k, v = correlated_kv(H, 200, d)
    store.append(k[:, :45], v[:, :45])  # sink 8 | pages | window: last complete page + partial
    assert (store.sink_k.shape[1], store.n_pages, store.tail_k.shape[1]) == (8, 3, 13)
    seen = [store.factorizations]
    for t in range(45, 200):
        store.append(k[:, t:t + 1], v[:, t:t + 1])
        seen.append(store.factorizations)
        dense, pages = layout_at(t + 1, codec.config)
        assert store.n_pages == pages and store.tail_k.shape[1] + store.sink_k.shape[1] == dense
        assert P <= store.tail_k.shape[1] < 2 * P  # window = one completed page + the page being filled
    steps = torch.tensor(seen).diff()
    assert steps.max() <= 1  # at most one page per step per layer (and head)
    assert store.factorizations == store.n_pages == (200 - 8) // P - 1  # every page exactly once
    assert store.all_factors()["lk"].shape == (H, store.n_pages, P, 4)


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("T", [333, 64, 20])
def test_bytes_are_the_tensors_held_and_match_formula(T, int4):
    H, d, P = 3, 64, 32
    codec = get_resident_method("puzzle", page_size=P, int4=int4)
    store = codec.new_store(_layout(H, 3, d))
    k, v = correlated_kv(H, T, d)
    store.append(k, v)
    held = sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == held
    rk, rv = store.ranks
    assert store.nbytes() == expected_bytes(T, codec.config, H, d, rk, rv, 2)
    assert store.dense_reference_bytes() == T * H * d * 2 * 2
    if int4 and store.n_pages:
        assert all(t.dtype in (torch.uint8, torch.float16) for t in store.factors.values())


def test_default_ranks_match_paper_ratio():
    assert default_ranks(32, 128) == (16, 14)  # the paper's setting
    assert default_ranks(32, 64) == (13, 12)
    assert page_ratio(32, 64, 13, 12) == pytest.approx(0.5859, abs=1e-4)


@pytest.mark.parametrize("budget", [0.6, 0.4, 0.25])
@pytest.mark.parametrize("int4", [False, True])
def test_budget_picks_ranks_within_budget_through_decode(budget, int4):
    H, d, T = 3, 64, 1000
    store = get_resident_method("puzzle", budget=budget, int4=int4).new_store(_layout(H, 3, d))
    k, v = correlated_kv(H, T + 40, d)
    store.append(k[:, :T], v[:, :T])
    ratios = [store.nbytes() / store.dense_reference_bytes()]
    for t in range(T, T + 40):
        store.append(k[:, t:t + 1], v[:, t:t + 1])
        ratios.append(store.nbytes() / store.dense_reference_bytes())
    assert max(ratios) <= budget
    # The largest ranks that fit: close to the budget, unless already at full rank (INT4 at 0.6).
    assert ratios[0] > budget - 0.06 or store.ranks == (32, 32)
    assert store.resolved_params()["rank_k"] >= store.resolved_params()["rank_v"]


def test_budget_below_fixed_cost_is_refused():
    store = get_resident_method("puzzle", budget=0.1).new_store(_layout(2, 1, 64))
    k, v = correlated_kv(2, 200, 64)
    with pytest.raises(ValueError, match="budget 0.1 is below PuzzleKV's fixed cost"):
        store.append(k, v)
    assert store.seq_len == 200 and store.n_pages == 0  # nothing was lost: the tokens stay dense


def test_int4_factors_quality():
    H, d, T = 2, 64, 300
    k, v = correlated_kv(H, T, d, seed=9)
    ref_store = get_resident_method("puzzle", storage_dtype="float32").new_store(_layout(H, 1, d))
    q_store = get_resident_method("puzzle", int4=True, storage_dtype="float32").new_store(_layout(H, 1, d))
    for s in (ref_store, q_store):
        s.append(k, v)
    k_ref, v_ref = ref_store.reconstruct()
    k_q, v_q = q_store.reconstruct()
    # INT4 factors stay close to the unquantized factorization (> 15 dB).
    assert 20 * math.log10(k_ref.norm() / (k_ref - k_q).norm()) > 15
    assert 20 * math.log10(v_ref.norm() / (v_ref - v_q).norm()) > 15
    factor_bytes = lambda s: sum(t.numel() * t.element_size() for t in s.history_tensors().values())  # noqa: E731
    assert factor_bytes(q_store) < factor_bytes(ref_store) / 5  # 4-bit codes + fp16 scales vs fp32 factors


def test_decode_pages_go_to_a_small_recent_set_folded_every_sqrt_n_pages():
    """Each page factorized while decoding is appended to the recent set, which is folded into the
    main set once it holds max(8, √n_pages) pages: main is rebuilt rarely, recent stays small, and
    every page is still held exactly once."""
    H, d, P = 1, 16, 4
    store = get_resident_method("puzzle", page_size=P, rank_k=2, rank_v=2, storage_dtype="float32").new_store(
        _layout(H, 1, d))
    k, v = correlated_kv(H, 1400, d)
    store.append(k[:, :40], v[:, :40])
    main, rebuilds = store.factors.get("lk"), 0
    for t in range(40, 1400):
        store.append(k[:, t:t + 1], v[:, t:t + 1])
        recent = store.n_pages - store.n_main
        assert recent < max(8, math.isqrt(store.n_pages))
        if store.factors["lk"] is not main:
            rebuilds, main = rebuilds + 1, store.factors["lk"]
    # About 2√N folds (28 here); one concatenation per page would be n_pages (348) rebuilds.
    assert store.n_pages > 300 and rebuilds <= 2 * math.isqrt(store.n_pages)
    assert store.all_factors()["lk"].shape[1] == store.n_pages
    held = sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == held == expected_bytes(1400, store.config, H, d, 2, 2, 4)
