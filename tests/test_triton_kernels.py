"""Triton kernels against the fp64 reference, on CPU through the Triton interpreter (small odd shapes).

The reference is attention over what the store holds (``store.reconstruct()``: sink, dense
reconstruction of every factorized page, tail) in fp64; the kernel never builds that. Tolerance:
fp32 inputs 2e-4 relative to the output scale (fp32 accumulation in a different order); bf16
storage 2e-2 (bf16's 8-bit mantissa on the stored factors read by both paths in fp32 is identical,
the slack covers tf32 on GPUs).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: kernel tests skipped (pip install triton)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set (conftest sets it for CPU runs)",
                allow_module_level=True)

from kvpack.attention.reference import reference_attention  # noqa: E402
from kvpack.attention.softmax_merge import finalize, group_queries, ungroup_output  # noqa: E402
from kvpack.ops.rope import LlamaRotary, RotaryTable, apply_rope  # noqa: E402
from kvpack.resident.base import LayerLayout  # noqa: E402
from kvpack.resident.puzzle import PuzzleConfig, PuzzleStore  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _store(kv_heads, group, d, seq, cfg: PuzzleConfig, seed=0):
    torch.manual_seed(seed)
    layout = LayerLayout(layer_idx=0, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d,
                         rope=RotaryTable(LlamaRotary(d), d))
    store = PuzzleStore(layout, cfg)
    # Keys with a decaying spectrum and RoPE applied (post-RoPE, as a model caches them).
    base = torch.randn(kv_heads, seq, d) @ torch.diag(torch.logspace(0.5, -1, d))
    cos, sin = layout.rope.cos_sin(torch.arange(seq))
    k = apply_rope(base, cos, sin)
    v = torch.randn(kv_heads, seq, d)
    q = torch.randn(kv_heads * group, seq, d)
    store.scaling = d ** -0.5
    store.append(k, v, q=q, out=torch.zeros_like(q))
    return store


def _random_queries(store, n_q):
    """``(q [Hq, n_q, d], grouped q, scaling)`` for a store's layout."""
    lay = store.layout
    q = torch.randn(lay.q_heads, n_q, lay.head_dim)
    return q, group_queries(q, lay.kv_heads), lay.head_dim ** -0.5


def _assert_matches_reference(store, q, state, scaling, atol, n_tokens=None):
    """The kernel's merged state, normalised, equals fp64 attention over the first ``n_tokens`` (all
    by default) of what the store holds, to ``atol`` of the output scale."""
    got = ungroup_output(finalize(state), store.layout.q_heads)
    k_hat, v_hat = store.reconstruct()
    ref = reference_attention(q, k_hat[:, :n_tokens], v_hat[:, :n_tokens], scaling)
    assert (got.double() - ref).abs().max().item() <= atol * max(ref.abs().max().item(), 1.0)


def _check(store, n_q=1, atol=2e-4, **split):
    from kvpack.attention.triton.puzzle_op import puzzle_partial

    q, qg, scaling = _random_queries(store, n_q)
    state = puzzle_partial(store.pages_view(), qg, scaling, **split)
    _assert_matches_reference(store, q, state, scaling, atol)
    return state


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("seq", [97, 54])
def test_puzzle_kernel_matches_fp64_reference(kv_heads, group, seq):
    cfg = PuzzleConfig(page_size=16, rank_k=5, rank_v=7, storage_dtype="float32", attention_backend="triton")
    store = _store(kv_heads, group, 32, seq, cfg)
    assert store.n_pages > 0 and store.tail_k.shape[1] % 16  # a partial page in the tail
    _check(store, pages_per_split=2, tokens_per_split=20)  # several page and dense splits


@pytest.mark.parametrize("ranks", [(1, 1), (16, 16)])
def test_puzzle_kernel_rank_one_and_full(ranks):
    cfg = PuzzleConfig(page_size=16, rank_k=ranks[0], rank_v=ranks[1], storage_dtype="float32",
                       attention_backend="triton")
    _check(_store(1, 3, 16, 75, cfg), pages_per_split=1)


def test_puzzle_kernel_pre_rope_keys():
    cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=6, storage_dtype="float32", key_rope="pre",
                       attention_backend="triton")
    _check(_store(2, 2, 32, 83, cfg), pages_per_split=3)


class _UnequalHalvesRotary(torch.nn.Module):
    """A rotary whose two halves differ (no transformers model does this): the RoPE table then keeps
    full-width rows and the kernels read both halves (``W = D``)."""

    def __init__(self, d):
        super().__init__()
        self.inner = LlamaRotary(d)

    def forward(self, x, position_ids):
        cos, sin = self.inner(x, position_ids)
        h = cos.shape[-1] // 2
        return torch.cat([cos[..., :h], cos[..., h:] * 0.9], -1), torch.cat([sin[..., :h], sin[..., h:] * 1.1], -1)


def test_kernels_read_full_width_rope_tables():
    cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=6, storage_dtype="float32", key_rope="pre",
                       attention_backend="triton")
    store = _store(2, 2, 32, 83, cfg)
    # The factors stay; only the rotation the kernel and the reference apply changes.
    store.layout = dataclasses.replace(store.layout, rope=RotaryTable(_UnequalHalvesRotary(32), 32))
    _check(store, pages_per_split=3)
    assert not store.layout.rope.halves_equal
    anchor = _anchor_store(2, 2, 32, 97, budget=0.5, storage_dtype="float32")
    anchor.layout = dataclasses.replace(anchor.layout, rope=RotaryTable(_UnequalHalvesRotary(32), 32))
    _check_anchor(anchor, blocks_per_split=1)


def test_puzzle_kernel_int4_factors():
    cfg = PuzzleConfig(page_size=16, rank_k=7, rank_v=5, storage_dtype="float32", int4=True, attention_backend="triton")
    _check(_store(2, 3, 32, 70, cfg), pages_per_split=2)


def test_puzzle_kernel_int4_pre_rope_bf16_page_not_power_of_two():
    cfg = PuzzleConfig(page_size=24, rank_k=9, rank_v=8, int4=True, key_rope="pre", attention_backend="triton")
    _check(_store(1, 4, 32, 101, cfg), atol=2e-2)


@pytest.mark.parametrize("pre_rope,int4", [(False, False), (True, False), (True, True)])
def test_puzzle_kernel_reads_main_and_recent_pages(pre_rope, int4):
    """Pages factorized while decoding sit in the store's recent set until folded; one launch reads
    both sets (the recent pages' positions follow the main ones for pre-RoPE keys)."""
    cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=5, storage_dtype="float32", int4=int4,
                       key_rope="pre" if pre_rope else "post", attention_backend="triton")
    store = _store(2, 3, 32, 150, cfg)
    torch.manual_seed(4)
    for _ in range(70):  # about 4 more pages, fewer than a fold needs
        store.append(torch.randn(2, 1, 32), torch.randn(2, 1, 32))
    assert store.n_main > 0 and 0 < store.n_pages - store.n_main < 8
    _check(store, pages_per_split=3)


def test_puzzle_kernel_with_only_recent_pages():
    """A prompt shorter than sink + window: every page is factorized while decoding, so the main set
    is empty and the recent set holds them all."""
    cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=5, storage_dtype="float32", key_rope="pre",
                       attention_backend="triton")
    store = _store(2, 2, 32, 30, cfg)
    assert store.n_pages == 0
    torch.manual_seed(6)
    for _ in range(60):
        store.append(torch.randn(2, 1, 32), torch.randn(2, 1, 32))
    assert store.n_main == 0 and store.n_pages > 0
    _check(store, pages_per_split=1)


@pytest.mark.parametrize("n_q", [3, 12])
def test_puzzle_kernel_several_query_rows(n_q):
    """3 queries × group 3 = 9 rows (one program's block of 16); 12 × 3 = 36 rows, as a prefill chunk
    over the stored history has: three row blocks, the last one partial."""
    cfg = PuzzleConfig(page_size=16, rank_k=5, rank_v=5, storage_dtype="float32", attention_backend="triton")
    _check(_store(2, 3, 16, 60, cfg), n_q=n_q, pages_per_split=2)


def test_store_attend_dispatches_to_the_kernel_and_agrees_with_torch():
    """A decode step through PuzzleStore.attend: attention_backend='triton' vs 'torch' on the same data."""
    outs = []
    for kernel in ("torch", "triton"):
        cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=6, storage_dtype="float32", attention_backend=kernel)
        store = _store(2, 3, 32, 90, cfg, seed=3)
        torch.manual_seed(9)
        q, k, v = torch.randn(6, 1, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32)
        outs.append(store.attend(q, k, v, 32 ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_kernel_choice_validated():
    with pytest.raises(ValueError, match="attention_backend"):
        PuzzleConfig(attention_backend="cuda")


def test_custom_op_traces_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvpack.attention.triton.puzzle_op import puzzle_attention

    with FakeTensorMode():
        q = torch.empty(2, 3, 32)
        e = torch.empty(0)
        pages = [torch.empty(2, 4, 16, 5), torch.empty(2, 4, 5, 32), torch.empty(2, 4, 16, 5),
                 torch.empty(2, 4, 5, 32), e, e, e, e, e, e, e, e, e, e, e, e, e, e,
                 torch.empty(2, 8, 32), torch.empty(2, 8, 32), torch.empty(2, 12, 32), torch.empty(2, 12, 32)]
        m, l, o = puzzle_attention(q, pages, 16, 5, 5, 0.2, False, False, 8, 2, 16, False)
        assert m.shape == (2, 3) and l.shape == (2, 3) and o.shape == (2, 3, 32)


# ------------------------------------------------------------------------------------------------
# AnchorKV
# ------------------------------------------------------------------------------------------------


def _anchor_store(kv_heads, group, d, seq, seed=0, **cfg):
    from kvpack.resident import get_resident_method

    torch.manual_seed(seed)
    layout = LayerLayout(layer_idx=0, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d,
                         rope=RotaryTable(LlamaRotary(d), d))
    cfg = {"window": 8, "anchors": 12, **cfg}  # a small fixed cost, so short sequences fit the budget
    store = get_resident_method("anchor", attention_backend="triton", **cfg).new_store(layout)
    base = torch.randn(kv_heads, 6, d)
    pick = torch.randint(0, 6, (kv_heads, seq))
    k = torch.gather(base, 1, pick[..., None].expand(-1, -1, d)) * (0.5 + torch.rand(kv_heads, seq, 1))
    k = k + 0.2 * torch.randn(kv_heads, seq, d)
    v = torch.randn(kv_heads, seq, d)
    q = torch.randn(kv_heads * group, seq, d)
    store.append(k, v, q, store.attend(q, k, v, d ** -0.5))
    return store


def _check_anchor(store, n_q=1, atol=2e-4, **split):
    from kvpack.attention.softmax_merge import merge_partials
    from kvpack.attention.triton.anchor_op import anchor_partials

    q, qg, scaling = _random_queries(store, n_q)
    state = merge_partials(anchor_partials(store.segment_views(), qg, scaling, **split))
    _assert_matches_reference(store, q, state, scaling, atol, n_tokens=store.n_compressed)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("seq", [97, 170])
def test_anchor_kernel_matches_fp64_reference(kv_heads, group, seq):
    store = _anchor_store(kv_heads, group, 32, seq, budget=0.5, storage_dtype="float32")
    assert store.n_residuals[0] > 0 and store.n_residuals[1] > 0  # residuals are exercised
    _check_anchor(store, blocks_per_split=1)


def test_anchor_kernel_query_rows_beyond_one_program():
    store = _anchor_store(2, 2, 32, 97, budget=0.5, storage_dtype="float32")
    _check_anchor(store, n_q=9, blocks_per_split=1)  # 18 rows: two row blocks of 16, the second partial


def test_anchor_kernel_every_token_with_residual_and_bf16_storage():
    store = _anchor_store(2, 3, 64, 150, budget=1.0)
    _check_anchor(store, n_q=2, atol=2e-2)


def test_anchor_kernel_naive_codec_and_uint8_indices():
    # The naive ablation codec (identity rotation, evenly spaced levels) and uint8 anchor indices.
    store = _anchor_store(2, 3, 32, 140, budget=0.5, storage_dtype="float32", residual_codec="naive",
                          narrow_index=True)
    assert store.segments[0]["index_k"].dtype == torch.uint8 and store.n_residuals[0] > 0
    _check_anchor(store, blocks_per_split=2)


def test_anchor_kernel_no_residuals():
    store = _anchor_store(1, 4, 32, 130, budget=0.252, storage_dtype="float32")  # just above the fixed cost
    assert store.n_residuals == (0, 0)
    _check_anchor(store, blocks_per_split=2)


@pytest.mark.parametrize("codec,storage,budget", [("hadamard_lloyd_max", "float32", 0.45), ("naive", "bfloat16", 0.38)])
def test_anchor_kernel_fine_tier(codec, storage, budget):
    """anchor_plus's 4-bit tier: token-sides with 2-bit, 4-bit and no residual in the same blocks
    (the budgets are between the 2-bit and the 4-bit saturation points of each storage dtype)."""
    store = _anchor_store(2, 3, 32, 140, budget=budget, storage_dtype=storage, residual_codec=codec,
                          above_saturation="residual4")
    assert min(store.n_residuals) > 0 and min(store.n_fine) > 0  # both tiers are exercised
    _check_anchor(store, n_q=2, atol=2e-4 if storage == "float32" else 2e-2, blocks_per_split=2)


@pytest.mark.parametrize("above_saturation", ["idle", "residual4"])
def test_anchor_store_dispatch_and_recompressed_segments_agree_with_torch(above_saturation):
    from kvpack.resident import get_resident_method

    outs = []
    for backend in ("torch", "triton"):
        torch.manual_seed(5)
        layout = LayerLayout(layer_idx=0, kv_heads=2, q_heads=6, head_dim=32, rope=RotaryTable(LlamaRotary(32), 32))
        store = get_resident_method("anchor", budget=0.5, storage_dtype="float32", recompress_every=40, window=8,
                          anchors=12, attention_backend=backend,
                          above_saturation=above_saturation).new_store(layout)
        k, v, q = torch.randn(2, 120, 32), torch.randn(2, 120, 32), torch.randn(6, 120, 32)
        store.append(k, v, q, store.attend(q, k, v, 32 ** -0.5))
        for _ in range(45):  # decode past one re-compression: two segments
            qn, kn, vn = torch.randn(6, 1, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32)
            out = store.attend(qn, kn, vn, 32 ** -0.5)
            store.append(kn, vn, qn, out)
        outs.append(out)
        assert len(store.segments) == 2
        # residual4: both segments (the prompt, and the re-compressed one) hold a fine tier
        assert all(("fine_mask_k" in seg) == (above_saturation == "residual4") for seg in store.segments)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_kernels_refuse_tensors_past_their_32_bit_offsets():
    """A tensor too large for int32 offsets is refused before any launch (it would read other memory
    silently); an expanded view stands in for 2^31 elements without allocating them."""
    from kvpack.attention.triton._launch import MAX_KERNEL_ELEMENTS, kernel_arg

    assert kernel_arg(torch.zeros(3, 5)).shape == (3, 5)
    with pytest.raises(ValueError, match="32-bit offsets.*attention_backend='torch'"):
        kernel_arg(torch.zeros(1, dtype=torch.uint8).expand(MAX_KERNEL_ELEMENTS + 1))


# ------------------------------------------------------------------------------------------------
# The split merge (flash-decoding's reduction kernel)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,S,M,D", [(2, 1, 4, 32), (3, 13, 21, 48), (1, 40, 3, 130)])
def test_split_merge_kernel_matches_pytorch_merge(H, S, M, D):
    """Against ``merge_partials`` (PyTorch) on split counts around the kernel's 8-split step, rows
    over one 16-row block, columns over one 64-column block (D = 130: three, the last partial), with
    splits that saw no key (m = -inf, l = 0, o = 0) and a row that no split saw."""
    from kvpack.attention.softmax_merge import PartialAttention, merge_partials
    from kvpack.attention.triton.split_merge import merge_splits

    torch.manual_seed(S)
    m = torch.randn(H, S, M) * 8
    l = torch.rand(H, S, M) + 0.5
    o = torch.randn(H, S, M, D) * l[..., None]
    empty = torch.rand(H, S, M) < 0.3
    empty[0, :, -1] = True  # the last row of head 0 saw nothing
    m[empty], l[empty], o[empty] = float("-inf"), 0.0, 0.0
    got = merge_splits(m, l, o)
    ref = merge_partials([PartialAttention(m[:, s], l[:, s], o[:, s]) for s in range(S)])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    assert got[0][0, -1] == float("-inf") and got[1][0, -1] == 0 and not got[2][0, -1].any()


# ------------------------------------------------------------------------------------------------
# The end of a decode step: the chunk's own attention merged with the stored states, one launch
# ------------------------------------------------------------------------------------------------


def _stored_states(H, M, D, n, seed=0):
    """``n`` random partial states ``[H, M(, D)]`` fp32, with some rows that saw nothing."""
    from kvpack.attention.softmax_merge import PartialAttention

    g = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(n):
        m = torch.randn(H, M, generator=g) * 4
        l = torch.rand(H, M, generator=g) + 0.5
        o = torch.randn(H, M, D, generator=g) * l[..., None]
        empty = torch.rand(H, M, generator=g) < 0.25
        m[empty], l[empty], o[empty] = float("-inf"), 0.0, 0.0
        states.append(PartialAttention(m, l, o))
    return states


@pytest.mark.parametrize("n_states,n_tail,n_q,group,D,dtype", [
    (1, 0, 1, 4, 32, torch.float32),     # PuzzleKV's decode step: one stored state (a view), no tail
    (2, 21, 1, 3, 48, torch.bfloat16),   # AnchorKV: two segments stacked + a tail read in place; bf16, D = 48
    (2, 0, 5, 4, 32, torch.float32),     # a 5-token chunk, causal within itself: 20 rows, two row blocks
    (0, 17, 3, 2, 16, torch.float32),    # only a tail stored
    (0, 0, 3, 2, 16, torch.float32),     # nothing stored yet
    (2, 5, 16, 1, 32, torch.float32),    # the largest chunk the fused path takes
])
def test_chunk_attend_matches_pytorch_attend_history_and_chunk(n_states, n_tail, n_q, group, D, dtype):
    from kvpack.attention.softmax_merge import attend_history_and_chunk, dense_partial, group_queries
    from kvpack.attention.triton.chunk_attend import fused_history_and_chunk

    H = 2
    torch.manual_seed(n_q)
    q = torch.randn(H * group, n_q, D)
    k, v = torch.randn(H, n_q, D).to(dtype), torch.randn(H, n_q, D).to(dtype)
    tail = torch.randn(H, n_tail, D).to(dtype), torch.randn(H, n_tail, D).to(dtype)
    qg = group_queries(q, H)
    history = _stored_states(H, group * n_q, D, n_states)
    out, m, l = fused_history_and_chunk(history, qg, k, v, D ** -0.5, H * group, tail=tail)
    ref_history = history + ([dense_partial(qg, *tail, D ** -0.5)] if n_tail else [])
    ref_out, ref = attend_history_and_chunk(ref_history, qg, k, v, D ** -0.5, H * group)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m, ref.m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l, ref.l, rtol=1e-5, atol=1e-6)


def test_history_and_chunk_fuses_only_short_chunks(monkeypatch):
    """Chunks of at most FUSED_CHUNK_MAX queries take the one-launch kernel, longer ones the PyTorch
    path; both give the same attention."""
    import kvpack.attention.triton.chunk_attend as chunk_attend
    from kvpack.attention.history_and_chunk import FUSED_CHUNK_MAX, history_and_chunk
    from kvpack.attention.softmax_merge import group_queries

    calls = []
    fused = chunk_attend.fused_history_and_chunk
    monkeypatch.setattr(chunk_attend, "fused_history_and_chunk", lambda *a: calls.append(a[2].shape[1]) or fused(*a))
    H, group, D = 1, 2, 16
    for n_q in (FUSED_CHUNK_MAX, FUSED_CHUNK_MAX + 1):
        q, k, v = torch.randn(H * group, n_q, D), torch.randn(H, n_q, D), torch.randn(H, n_q, D)
        qg = group_queries(q, H)
        history = _stored_states(H, group * n_q, D, 2)
        got = history_and_chunk(history, qg, k, v, 0.25, H * group, "triton")[0]
        ref = history_and_chunk(history, qg, k, v, 0.25, H * group, "torch")[0]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert calls == [FUSED_CHUNK_MAX]


# ------------------------------------------------------------------------------------------------
# What a decode step allocates around the kernels
# ------------------------------------------------------------------------------------------------


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the bytes of every tensor an aten op creates, and host syncs (``.item()``)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.syncs = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.bytes.append(t.numel() * t.element_size())
        return out


_KERNELS = {"puzzle": ("kvpack.attention.triton.puzzle_decode", "puzzle_split_kernel"),
            "anchor": ("kvpack.attention.triton.anchor_decode", "anchor_split_kernel")}


def _stub_kernel(monkeypatch, method: str) -> None:
    """Replace a codec's Triton kernel by a launch that does nothing (its outputs stay unwritten):
    what is left of a decode step is the PyTorch work around the kernel."""
    import importlib

    module, name = _KERNELS[method]
    monkeypatch.setattr(importlib.import_module(module), name,
                        type("NoLaunch", (), {"__getitem__": lambda self, grid: lambda *a, **k: None})())


def _step_allocations(store, monkeypatch, method):
    """(largest tensor bytes, host syncs, shapes of the tensors copied to make them contiguous) of one
    decode step's ``attend`` with the Triton launch itself replaced by a no-op (the kernel's own work
    is not a PyTorch allocation). The recording mode does not see inside the custom ops, so the
    copies their launchers would make (``kernel_arg`` of a non-contiguous tensor) are spied on."""
    import kvpack.attention.triton.anchor_op as anchor_op
    import kvpack.attention.triton.chunk_attend as chunk_attend
    import kvpack.attention.triton.puzzle_op as puzzle_op
    from kvpack.attention.triton._launch import kernel_arg

    copied = []

    def spy(t):
        if t.numel() and not t.is_contiguous():
            copied.append(tuple(t.shape))
        return kernel_arg(t)

    for module in (puzzle_op, anchor_op, chunk_attend):
        monkeypatch.setattr(module, "kernel_arg", spy)
    _stub_kernel(monkeypatch, method)
    lay = store.layout
    q, k, v = torch.randn(lay.q_heads, 1, lay.head_dim), torch.randn(lay.kv_heads, 1, lay.head_dim), \
        torch.randn(lay.kv_heads, 1, lay.head_dim)
    store.attend(q, k, v, lay.head_dim ** -0.5)  # first call may grow the shared RoPE table (once per model)
    copied.clear()
    with _RecordOps() as rec:
        store.attend(q, k, v, lay.head_dim ** -0.5)
    return max(rec.bytes), rec.syncs, copied


# The stubbed kernel leaves its outputs unwritten: the merge and chunk kernels then compute on
# whatever memory held (NumPy warns under the interpreter); these tests look only at allocations and syncs.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("method", ["puzzle_pre_rope", "anchor"])
def test_decode_step_allocates_nothing_that_grows_with_the_context(method, monkeypatch):
    """Around the kernels a decode step's attention allocates only split states and merge results: no
    gathered RoPE rows, no copies of the store's tensors (concatenated, or made contiguous inside the
    ops), no host syncs (CUDA-graph capturable, with ``check_finite=false``)."""
    largest = []
    for seq in (1200, 4800):
        if method == "anchor":
            store = _anchor_store(2, 2, 32, seq, budget=0.3, storage_dtype="float32", anchors=None, check_finite=False)
        else:
            cfg = PuzzleConfig(page_size=16, rank_k=4, rank_v=4, storage_dtype="float32", key_rope="pre",
                               attention_backend="triton", check_finite=False)
            store = _store(2, 2, 32, seq, cfg)
        big, syncs, copied = _step_allocations(store, monkeypatch, method.split("_")[0])
        assert syncs == 0
        assert copied == [], f"tensors the launchers copy on every step: {copied}"
        largest.append(big)
    # The largest allocation is a split-state buffer ``o [H, splits, rows, d]`` fp32 (about 32 page or
    # block splits per head, plus the dense tokens' few): under the interpreter the launcher runs outside
    # the op, so the recording sees it. Its size follows the split count's rounding, never the context:
    # anything gathered per stored token (RoPE rows, a copy of the factors) would be far above the bound.
    lay = store.layout
    bound = lay.kv_heads * 40 * (lay.q_heads // lay.kv_heads) * lay.head_dim * 4
    assert max(largest) <= bound, (largest, bound)


@pytest.mark.parametrize("method", ["puzzle", "anchor"])
def test_decode_step_traces_as_one_graph_around_the_kernel(method):
    """torch.compile sees a decode step's attention (``attend``: the stored part through the kernel's
    op, the chunk-attention op, the input checks on shapes) as one graph with no break, in the
    configuration a CUDA graph can capture (``check_finite=false``: no host synchronisation). On CPU
    the op's kernel is the native one (the interpreter runs the Triton launcher directly, outside
    the op, so it is not what a compiled CPU step would trace)."""
    import dataclasses

    if method == "anchor":
        store = _anchor_store(2, 2, 32, 300, budget=0.3, storage_dtype="float32", anchors=None, check_finite=False)
    else:
        store = _store(2, 2, 32, 300, PuzzleConfig(page_size=16, rank_k=4, rank_v=4, storage_dtype="float32",
                                                   attention_backend="triton", check_finite=False))
    if not torch.cuda.is_available():
        store.config = dataclasses.replace(store.config, attention_backend="native")
    q, k, v = torch.randn(4, 1, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    explained = torch._dynamo.explain(lambda q, k, v: store.attend(q, k, v, 32 ** -0.5))(q, k, v)
    torch._dynamo.reset()
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


# The stubbed kernel leaves its outputs unwritten: the merge and chunk kernels then compute on
# whatever memory held (NumPy warns under the interpreter); these tests look only at allocations and syncs.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("method", ["puzzle", "anchor"])
def test_full_decode_step_without_host_sync_when_finite_check_is_off(method, monkeypatch):
    """attend() + append() of a decode token: the NaN/Inf check is the only host synchronisation,
    one per tensor (keys, values) — attend checks the chunk and append does not check it again —
    and with check_finite=false there is none, so a whole decode step can be captured in a CUDA graph."""
    syncs = {}
    for check in (True, False):
        if method == "anchor":
            store = _anchor_store(2, 2, 32, 300, budget=0.3, storage_dtype="float32", anchors=None,
                                  check_finite=check)
        else:
            store = _store(2, 2, 32, 300, PuzzleConfig(page_size=16, rank_k=4, rank_v=4, storage_dtype="float32",
                                                       attention_backend="triton", check_finite=check))
        _stub_kernel(monkeypatch, method)
        q, k, v = torch.randn(4, 1, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32)
        with _RecordOps() as rec:
            out = store.attend(q, k, v, 32 ** -0.5)
            store.append(k, v, q, out)
        syncs[check] = rec.syncs
    assert syncs == {True: 2, False: 0}


# -- puzzle_plus: pages at per-(head, page) ranks --------------------------------------------------


def _ragged_store(kv_heads, group, d, seq, seed=0, **cfg):
    from kvpack.resident.puzzle_plus import PuzzlePlusConfig, PuzzlePlusStore

    torch.manual_seed(seed)
    layout = LayerLayout(layer_idx=0, kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=d,
                         rope=RotaryTable(LlamaRotary(d), d))
    cfg.setdefault("rank_step", 2 if cfg.get("int4", True) else 1)
    store = PuzzlePlusStore(layout, PuzzlePlusConfig(**cfg))
    base = torch.randn(kv_heads, seq, d) @ torch.diag(torch.logspace(0.5, -1, d))
    cos, sin = layout.rope.cos_sin(torch.arange(seq))
    k = apply_rope(base, cos, sin)
    v = torch.randn(kv_heads, seq, d) @ torch.diag(torch.logspace(0.3, -0.5, d))
    q = torch.randn(kv_heads * group, seq, d)
    store.scaling = d ** -0.5
    store.append(k, v, q=q, out=torch.zeros_like(q))
    return store


def _check_ragged(store, n_q=1, atol=2e-4, **split):
    from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

    q, qg, scaling = _random_queries(store, n_q)
    ranks = torch.cat([store.keys.rank.flatten(), store.values.rank.flatten()])
    assert ranks.unique().numel() > 1  # mixed ranks, or the test would not test them
    _assert_matches_reference(store, q, ragged_puzzle_partial(store.pages_view(), qg, scaling, **split), scaling,
                              atol)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("seq", [150, 131])
def test_puzzle_plus_kernel_matches_fp64_reference(kv_heads, group, seq):
    _check_ragged(_ragged_store(kv_heads, group, 32, seq, page_size=16, budget=0.9, storage_dtype="float32"),
                  pages_per_split=3)


@pytest.mark.parametrize("int4,key_rope", [(False, "pre"), (True, "post"), (True, "pre")])
def test_puzzle_plus_kernel_pre_rope_and_int4(int4, key_rope):
    _check_ragged(_ragged_store(2, 3, 32, 140, page_size=16, budget=0.9, storage_dtype="float32", int4=int4,
                                key_rope=key_rope), pages_per_split=2)


def test_puzzle_plus_kernel_bf16_page_not_power_of_two_and_query_rows():
    """bf16 factors, 24-token pages (tiles padded to 32), 12 queries x group 3 = three row blocks."""
    _check_ragged(_ragged_store(2, 3, 32, 200, page_size=24, budget=0.5), n_q=12, atol=2e-2)


def test_puzzle_plus_store_dispatches_to_the_kernel_and_agrees_with_torch():
    outs = []
    for backend in ("torch", "triton"):
        store = _ragged_store(2, 3, 32, 150, seed=3, page_size=16, budget=0.5, attention_backend=backend)
        torch.manual_seed(9)
        q, k, v = torch.randn(6, 1, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32)
        outs.append(store.attend(q, k, v, 32 ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_puzzle_plus_kernel_loops_over_rank_blocks(monkeypatch):
    """Ranks above one rank block (16 here) take several steps of the page's rank loop."""
    from kvpack.attention.triton import puzzle_ragged_op

    monkeypatch.setattr(puzzle_ragged_op, "RANK_BLOCK", 16)
    for key_rope, int4, budget in (("post", False, 0.8), ("pre", True, 0.5)):
        store = _ragged_store(2, 2, 64, 400, page_size=32, budget=budget, key_rope=key_rope, int4=int4)
        assert int(store.keys.rank.max()) > 16 and int(store.values.rank.max()) > 16
        _check_ragged(store, pages_per_split=2, atol=2e-2)
