"""puzzle_plus: water-filled ranks under one whole-cache budget, ragged storage, mixed-rank attention."""

import math

import pytest
import torch

from kvpack.attention import ragged_pages
from kvpack.attention.reference import reference_attention
from kvpack.attention.softmax_merge import finalize, group_queries, merge_partials, ungroup_output
from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout, get_resident_method
from kvpack.resident.puzzle_plus import PuzzlePlusStore, RankRequest, WholeCacheBudget, fit_threshold

from .helpers import correlated_kv, tiny_gemma3, tiny_llama


def _codec(**cfg):
    """puzzle_plus with rank steps of one rank (two in INT4, the default): these small pages (P = 16)
    keep few ranks."""
    cfg.setdefault("rank_step", 2 if cfg.get("int4", True) else 1)
    return get_resident_method("puzzle_plus", **cfg)


def _layout(kv_heads=2, group=2, d=32, layer_idx=0, rope=False):
    return LayerLayout(layer_idx=layer_idx, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d,
                       rope=RotaryTable(LlamaRotary(d), d) if rope else None)


def _prefill(store, k, v, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(store.layout.q_heads, k.shape[1], k.shape[2], generator=g)
    store.load_prefill(k, v, q, torch.zeros_like(q), k.shape[2] ** -0.5)
    return store


def _attention_over_reconstruction(store, n_q=3, seed=2):
    """``(attention over the store in its own path, fp64 attention over its reconstruction)``."""
    lay = store.layout
    q = torch.randn(lay.q_heads, n_q, lay.head_dim, generator=torch.Generator().manual_seed(seed))
    qg = group_queries(q, lay.kv_heads)
    got = ungroup_output(finalize(merge_partials(store.stored_partials(qg, lay.head_dim ** -0.5))), lay.q_heads)
    k_hat, v_hat = store.reconstruct()
    return got.double(), reference_attention(q, k_hat, v_hat, lay.head_dim ** -0.5)


# -- water-filling --------------------------------------------------------------------------------


def _greedy_reference(requests, budget):
    """Steps taken one by one in decreasing gain per byte (ties together), stopping at the first
    level whose steps do not fit: the textbook greedy water-filling."""
    allowance = budget * sum(r.projected_dense_bytes for r in requests)
    levels = sorted({g for r in requests for g in r.gains.reshape(-1).tolist() if g > 0}, reverse=True)
    chosen = [r.steps_at(math.inf) for r in requests]
    for level in levels:
        trial = [r.steps_at(level) for r in requests]
        if sum(r.projected_bytes(s) for r, s in zip(requests, trial)) > allowance:
            break
        chosen = trial
    return chosen


def _request(gains, step_bytes, fixed, dense, floor=1, cap=None):
    cap = gains.shape[1] if cap is None else cap
    return RankRequest(gains, floor, cap, lambda s: fixed + int(s.sum()) * step_bytes, dense)


@pytest.mark.parametrize("seed", range(5))
def test_fit_threshold_is_greedy_water_filling(seed):
    g = torch.Generator().manual_seed(seed)
    requests = []
    for step_bytes in (7, 13, 20):
        gains = torch.rand(5, 6, generator=g).sort(dim=1, descending=True).values
        gains[0, 3:] = 0  # a page whose spectrum ends: zero gains are never bought
        requests.append(_request(gains / step_bytes, step_bytes, fixed=100, dense=1000))
    budget = 0.2 + 0.6 * torch.rand(1, generator=g).item()
    fit = fit_threshold(requests, budget)
    expected = _greedy_reference(requests, budget)
    for r, want in zip(requests, expected):
        assert torch.equal(r.steps_at(fit.threshold), want)
    assert fit.fits and fit.total_bytes <= fit.allowance
    assert (requests[0].steps_at(fit.threshold)[0] <= 3).item()
    # one more level would not fit
    higher = [v for v in torch.cat([r.gains.reshape(-1) for r in requests]).tolist() if 0 < v < fit.threshold]
    if higher:
        assert sum(r.projected_bytes(r.steps_at(max(higher))) for r in requests) > fit.allowance


def test_fit_threshold_floor_cap_minimum_and_refusal():
    gains = torch.tensor([[9.0, 8.0, 7.0, 1.0], [0.5, 0.4, 0.3, 0.2]])
    req = _request(gains, 1, fixed=0, dense=100, floor=2, cap=3)
    fit = fit_threshold([req], budget=1.0)  # everything fits: the cap binds, floor for the weak entry
    assert req.steps_at(fit.threshold).tolist() == [3, 3]
    fit = fit_threshold([req], budget=1.0, minimum=5.0)  # a later round keeps λ as its floor
    assert req.steps_at(fit.threshold).tolist() == [3, 2]
    fit = fit_threshold([req], budget=0.03)  # floor ranks alone (4 steps) exceed 3 bytes
    assert not fit.fits and fit.threshold == math.inf


# -- one store ------------------------------------------------------------------------------------


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("key_rope", ["post", "pre"])
def test_store_attention_equals_attention_over_its_reconstruction(int4, key_rope):
    H, d, P = 2, 32, 16
    k, v = correlated_kv(H, 150, d, seed=3)
    store = _codec(budget=0.5, page_size=P, int4=int4, key_rope=key_rope,
                      attention_backend="torch").new_store(_layout(H, 3, d, rope=key_rope == "pre"))
    _prefill(store, k, v)
    assert store.n_pages == (150 - P) // P - 1
    ranks = torch.cat([store.keys.rank.flatten(), store.values.rank.flatten()])
    assert ranks.unique().numel() > 1, "the allocation should differ between pages"
    if int4:
        assert (ranks % 2 == 0).all()
    got, ref = _attention_over_reconstruction(store)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_pages_are_optimal_truncations_at_their_ranks():
    """Each page side is the rank-r truncated SVD of the original page (Eckart–Young: error² = Σ_{i>r} σ_i²)."""
    H, d, P = 2, 32, 16
    k, v = correlated_kv(H, 200, d, seed=5)
    store = _prefill(_codec(budget=0.45, page_size=P).new_store(_layout(H, 1, d)), k, v)
    k_hat, v_hat = store.reconstruct()
    first = P
    for side, (orig, rec, table) in enumerate(((k, k_hat, store.keys.rank), (v, v_hat, store.values.rank))):
        for n in range(store.n_pages):
            for h in range(H):
                page = orig[h, first + n * P:first + (n + 1) * P].double()
                sigma = torch.linalg.svdvals(page)
                r = int(table[n, h])
                err = (page - rec[h, first + n * P:first + (n + 1) * P].double()).pow(2).sum()
                optimal = sigma[r:].pow(2).sum()
                # bf16 factors: the truncation is optimal up to the storage's rounding
                assert err <= optimal + 0.02 * page.pow(2).sum(), (side, n, h)


@pytest.mark.parametrize("int4", [False, True])
def test_ragged_bytes_are_the_tensors_held_without_padding(int4):
    H, d, P = 3, 32, 16
    k, v = correlated_kv(H, 180, d, seed=6)
    store = _prefill(_codec(budget=0.5, page_size=P, int4=int4).new_store(_layout(H, 1, d)), k, v)
    held = sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == held
    for side in (store.keys, store.values):
        total_rank = int(side.rank.long().sum())
        per_byte = 2 if int4 else 1  # INT4: two codes per byte
        assert side.left.numel() * per_byte == total_rank * P and side.right.numel() * per_byte == total_rank * d
        assert side.order.numel() == side.rank.numel() == store.n_pages * H
        # buckets are contiguous runs of one rank, in storage order
        ranks_in_order = side.rank.flatten()[side.order.long()]
        assert (ranks_in_order[1:] >= ranks_in_order[:-1]).all()
        for b in side.buckets:
            assert (ranks_in_order[b.first:b.first + b.count] == b.rank).all()


@pytest.mark.parametrize("int4", [False, True])
def test_budget_holds_at_every_decode_step_and_decode_pages_use_the_prefill_threshold(int4):
    H, d, P = 2, 32, 16
    k, v = correlated_kv(H, 700, d, seed=7)
    store = _prefill(_codec(budget=0.4, page_size=P, int4=int4).new_store(_layout(H, 2, d)),
                     k[:, :200], v[:, :200])
    g = torch.Generator().manual_seed(3)
    for t in range(200, 700):
        q = torch.randn(H * 2, 1, d, generator=g)
        out = store.attend(q, k[:, t:t + 1], v[:, t:t + 1], d ** -0.5)
        store.append(k[:, t:t + 1], v[:, t:t + 1], q, out)
        assert store.nbytes() <= 0.4 * store.dense_reference_bytes(), t
    rounds = store.group.rounds
    assert len(rounds) == 1 + (700 // P - 200 // P)
    lam = store.group.threshold
    assert all(r.threshold >= lam for r in rounds[1:])
    assert store.n_pages == (700 - P) // P - 1


@pytest.mark.parametrize("int4", [False, True])
def test_default_rank_step_keeps_ranks_multiples_of_four(int4):
    H, d = 2, 64
    k, v = correlated_kv(H, 700, d, seed=9)
    store = _prefill(get_resident_method("puzzle_plus", budget=0.5, int4=int4).new_store(_layout(H, 1, d)), k, v)
    assert store.config.page_size == 64 and store.n_pages == (700 - 64) // 64 - 1
    for side in (store.keys, store.values):
        assert (side.rank % 4 == 0).all() and len(side.buckets) <= 16
    assert store.nbytes() <= 0.5 * store.dense_reference_bytes()


def test_attention_tiles_agree_with_one_tile(monkeypatch):
    H, d, P = 2, 32, 16
    k, v = correlated_kv(H, 200, d, seed=8)
    store = _prefill(_codec(budget=0.5, page_size=P, attention_backend="torch").new_store(
        _layout(H, 2, d)), k, v)
    qg = group_queries(torch.randn(H * 2, 5, d), H)
    one = merge_partials(ragged_pages.ragged_pages_partials(store.pages_view(), qg, 0.2))
    monkeypatch.setattr(ragged_pages, "MAX_TILE_LOGITS", H * 10 * P * 3)  # three pages per tile
    tiles = ragged_pages.ragged_pages_partials(store.pages_view(), qg, 0.2)
    assert len(tiles) == math.ceil(store.n_pages / 3)
    torch.testing.assert_close(finalize(merge_partials(tiles)), finalize(one), rtol=1e-5, atol=1e-6)


# -- the whole cache ------------------------------------------------------------------------------


def test_one_budget_across_layers_gives_the_ranks_to_the_layer_that_needs_them():
    """A layer whose pages are nearly rank 2 keeps few ranks; a noisy layer gets the rest of the
    whole-cache budget, above the budget on its own."""
    H, d, P, T = 2, 32, 16, 200
    codec = _codec(budget=0.45, page_size=P)
    layouts = [_layout(H, 1, d, layer_idx=i) for i in (0, 1)]
    group = codec.new_group(layouts)
    g = torch.Generator().manual_seed(0)
    low = torch.randn(H, T, 2, generator=g) @ torch.randn(H, 2, d, generator=g)
    low = low + 1e-3 * torch.randn(H, T, d, generator=g)
    noisy = torch.randn(H, T, d, generator=g)
    stores = [codec.new_store(lay, group) for lay in layouts]
    _prefill(stores[0], low, low.clone())
    assert stores[0].n_pages == 0 and not group.rounds  # waits for the other layer
    _prefill(stores[1], noisy, noisy.clone())
    assert len(group.rounds) == 1
    mean = [float(s.keys.rank.float().mean()) for s in stores]
    assert mean[0] <= 3 < mean[1]
    total = sum(s.nbytes() for s in stores)
    assert total <= 0.45 * sum(s.dense_reference_bytes() for s in stores)
    assert stores[1].nbytes() > 0.45 * stores[1].dense_reference_bytes()


def _decode(model, cache, ids, steps):
    from kvpack.hf.attention import attached
    from kvpack.hf.cache import cache_kwargs

    ratios = []
    with torch.no_grad(), attached(model, cache):
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, **cache_kwargs(model, cache), use_cache=True)
            ratios.append(cache.kv_bytes() / cache.dense_kv_bytes())
    return ratios


@pytest.mark.parametrize("int4", [False, True])
def test_live_cache_budget_holds_over_1000_generated_tokens(int4):
    from kvpack.hf.cache import KVPackCache

    model = tiny_llama(layers=3)
    cache = KVPackCache(model, _codec(budget=0.4, page_size=16, int4=int4))
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    ratios = _decode(model, cache, ids, 1000)
    assert max(ratios) <= 0.4
    stores = [layer.rows[0] for layer in cache.kvpack_layers]
    group = stores[0].group
    assert all(s.group is group for s in stores) and group.layers == [0, 1, 2]
    # one round for the prefill, then one per page a layer completes while decoding (a sink page, a window
    # page, the filling page and the layer's stagger lag stay dense)
    pages = lambda n, s: (n - 16 - s.lag) // 16 - 1  # noqa: E731
    assert [s.lag for s in stores] == [0, 9, 3] and all(s.n_pages == pages(1300, s) for s in stores)
    assert len(group.rounds) == 1 + sum(pages(1300, s) - pages(300, s) for s in stores)
    assert all(r.threshold >= group.threshold for r in group.rounds)
    # The prefill's allocation spends the budget; later pages get what λ gives them (this random
    # model's greedy text repeats itself: its pages need, and get, fewer ranks, so the ratio falls).
    assert ratios[0] > 0.35


@pytest.mark.parametrize("stagger", [True, False])
def test_staggered_layers_complete_their_pages_on_different_decode_steps(stagger):
    from kvpack.hf.cache import KVPackCache

    model = tiny_llama(layers=3)
    cache = KVPackCache(model, _codec(budget=0.4, page_size=16, stagger=stagger))
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    stores = lambda: [layer.rows[0] for layer in cache.kvpack_layers]  # noqa: E731
    _decode(model, cache, ids, 0)
    completed = {i: [] for i in range(3)}  # layer -> decode steps on which it committed a page
    before = [s.n_pages for s in stores()]
    g = torch.Generator().manual_seed(5)
    for step in range(48):
        _decode(model, cache, torch.randint(0, 128, (1, 1), generator=g), 0)  # any token: pages are counted
        now = [s.n_pages for s in stores()]
        for i in range(3):
            if now[i] != before[i]:
                completed[i].append(step)
        before = now
    steps = [set(v) for v in completed.values()]
    assert all(len(v) == 3 for v in steps)  # a page every 16 tokens in each layer
    if stagger:
        assert not (steps[0] & steps[1]) and not (steps[0] & steps[2]) and not (steps[1] & steps[2])
    else:
        assert steps[0] == steps[1] == steps[2]


def test_harness_prefill_and_live_prefill_choose_the_same_ranks():
    from kvpack.hf.cache import KVPackCache
    from kvpack.hf.prefill import exact_prefill, resident_cache_from
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    codec = _codec(budget=0.5, page_size=16)
    live = KVPackCache(model, codec)
    _decode(model, live, ids, 0)
    built = resident_cache_from(model, codec, exact_prefill(model, ids[0].tolist()))
    for a, b in zip(live.kvpack_layers, built.kvpack_layers):
        assert torch.equal(a.rows[0].keys.rank, b.rows[0].keys.rank)
        assert torch.equal(a.rows[0].values.rank, b.rows[0].values.rank)
    assert live.kv_bytes() == built.kv_bytes()


def test_sliding_window_model_allocates_over_its_full_attention_layers():
    from kvpack.hf.cache import KVPackCache

    model = tiny_gemma3()
    # the budget over the full-attention layers alone (the whole cache's is tests/test_whole_budget.py's)
    cache = KVPackCache(model, _codec(budget=0.5, page_size=16), budget_scope="full_layers")
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    ratios = _decode(model, cache, ids, 40)
    stores = [layer.rows[0] for layer in cache.kvpack_layers]
    assert [s.layout.layer_idx for s in stores] == [1, 3] and stores[0].group.layers == [1, 3]
    full_bytes = sum(s.nbytes() for s in stores)
    assert full_bytes <= 0.5 * sum(s.dense_reference_bytes() for s in stores)
    assert all(r > 0 for r in ratios)


def test_two_rows_have_two_budgets():
    from kvpack.hf.cache import KVPackCache

    model = tiny_llama(layers=2)
    cache = KVPackCache(model, _codec(budget=0.5, page_size=16))
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(3))
    _decode(model, cache, ids, 3)
    rows = cache.kvpack_layers[0].rows
    assert rows[0].group is not rows[1].group
    assert rows[0].group is cache.kvpack_layers[1].rows[0].group


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    ({"budget": None}, "budget is required"),
    ({"rank_cap": 40, "page_size": 32}, "rank_cap must be <= page_size"),
    ({"rank_floor": 9, "rank_cap": 4}, "rank_floor"),
    ({"budget": 1.5}, "budget"),
    ({"attention_weight": 2.0}, "attention_weight"),
    ({"int4": True, "rank_step": 3}, "even rank_step"),
    ({"rank_step": 8, "rank_cap": 4}, "rank_step"),
])
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _codec(**overrides)


def test_budget_below_the_fixed_cost_is_refused_with_the_reason():
    k, v = correlated_kv(2, 64, 32)
    store = _codec(budget=0.1, page_size=16).new_store(_layout(2, 1, 32))
    with pytest.raises(ValueError, match="below the cache's fixed cost"):
        _prefill(store, k, v)


def test_pre_rope_without_rotary_and_odd_int4_head_dim_are_refused():
    with pytest.raises(ValueError, match="rotary"):
        _codec(key_rope="pre").new_store(_layout(rope=False))
    with pytest.raises(ValueError, match="even head_dim"):
        _codec(int4=True, page_size=16).new_store(_layout(d=31))


def test_a_group_refuses_foreign_and_duplicate_layers():
    group = WholeCacheBudget([0, 1], 0.5)
    codec = _codec(page_size=16)
    codec.new_store(_layout(layer_idx=0), group)
    with pytest.raises(ValueError, match="already has a store"):
        codec.new_store(_layout(layer_idx=0), group)
    with pytest.raises(ValueError, match="not in this budget group"):
        codec.new_store(_layout(layer_idx=5), group)
    assert isinstance(codec.new_store(_layout(layer_idx=1), group), PuzzlePlusStore)


def test_a_prepared_cache_copy_runs_like_a_fresh_build():
    """The eval runner's fidelity pass runs on ``PreparedCache.copy()`` (taken before decoding
    mutates the original): the copy, its budget group included, is independent and equals a rebuild."""
    from kvpack.eval.runner import teacher_forced_logprobs
    from kvpack.hf.prefill import exact_prefill
    from kvpack.methods import get_method

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    prefill = exact_prefill(model, ids)
    method = get_method("puzzle_plus", budget=0.5, page_size=16, rank_step=2)
    built = method.from_prefill(model, prefill)
    copied = built.copy()
    layers = copied.cache.kvpack_layers
    assert layers[0].rows[0].group is layers[1].rows[0].group is not built.cache.kvpack_layers[0].rows[0].group
    chunk = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    first = teacher_forced_logprobs(model, built, chunk, 240)  # 40 tokens: a page completes, a round runs
    again = teacher_forced_logprobs(model, copied, chunk, 240)
    fresh = teacher_forced_logprobs(model, method.from_prefill(model, prefill), chunk, 240)
    assert torch.equal(first, again) and torch.equal(first, fresh)
    assert not first.requires_grad  # the fidelity pass keeps no autograd graph
