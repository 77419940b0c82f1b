"""The PuzzleKV decode kernel as a PyTorch custom op (``kvpack::puzzle_attention``), plus its launcher.

Registered with ``torch.library.custom_op`` and a fake (meta) implementation, so ``torch.compile``
traces around the Triton launch. One schema, two backends: the Triton kernel (CUDA tensors; CPU
tensors under ``TRITON_INTERPRET=1``, the launcher called directly) and the native CPU kernel
(``kvpack/attention/cpu/csrc/puzzle.cpp``), bound to the op's CPU dispatch in C++ (``csrc/bindings.cpp``).
:func:`puzzle_partial` is what ``PuzzleStore`` calls with its :class:`PuzzlePages` view: it returns
the merged softmax state of the grouped queries over the layer's sink, factorized pages and tail.
"""

from __future__ import annotations

import math

import torch

from .. import cpu
from ..pages import PAGES_OPERANDS, PuzzlePages
from ..softmax_merge import PartialAttention
from ._launch import ROW_BLOCK, empty_state, kernel_arg, launch, pow2, row_blocks, split_state_buffers


def _triton_puzzle_attention(
    q: torch.Tensor, pages: list[torch.Tensor], page_size: int, rank_k: int, rank_v: int, scaling: float, int4: bool,
    pre_rope: bool, first_position: int, pages_per_split: int, tokens_per_split: int, bf16_products: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]``
    over a PuzzleKV layer (``pages``: its tensors as :data:`~kvpack.attention.pages.PAGES_OPERANDS` names
    them, :meth:`PuzzlePages.operands`): ``N`` factorized pages (``lk`` etc., layouts in
    ``puzzle_decode.puzzle_split_kernel``), the ``N2`` pages that follow them (``lk2`` etc., the store's
    recent set; empty when there is none) and the dense sink ``[H, TS, D]`` and tail tokens. ``cos``/``sin``
    are the shared RoPE tables (``RotaryTable.table``: half-width rows when both halves are equal) and
    ``first_position`` the position of the first page's first token (pre-RoPE keys; the tables are unused
    otherwise). ``bf16_products``: the native CPU kernel rebuilds pre-RoPE keys with bf16 products where the
    CPU has AVX-512 BF16 (``cpu.bf16_products``); the Triton kernel ignores it."""
    from .puzzle_decode import puzzle_split_kernel
    from .split_merge import merge_splits

    if len(pages) != len(PAGES_OPERANDS):
        raise ValueError(f"puzzle_attention: expected the {len(PAGES_OPERANDS)} tensors of PAGES_OPERANDS, "
                         f"got {len(pages)}")
    t = dict(zip(PAGES_OPERANDS, pages))
    sink_k, tail_k, cos = t["sink_k"], t["tail_k"], t["cos"]
    H, M, D = q.shape
    N = t["lk"].shape[1] if t["lk"].numel() else 0
    N2 = t["lk2"].shape[1] if t["lk2"].numel() else 0
    TS, T = sink_k.shape[1], sink_k.shape[1] + tail_k.shape[1]
    n_main_splits = math.ceil(N / pages_per_split)
    n_page_splits = n_main_splits + math.ceil(N2 / pages_per_split)
    n_splits = n_page_splits + (math.ceil(T / tokens_per_split) if T else 0)
    dev = q.device
    # The kernel picks one set's pointers per split: an empty set stands in as the other set's
    # tensors (same dtypes; never read, it has no pages).
    first, second = pages[:8], pages[8:16]
    if not N:
        first = second
    elif not N2:
        second = first
    if n_splits == 0:
        return empty_state(H, M, D, dev)
    m, l, o = split_state_buffers(H, M, D, n_splits, dev)
    W = cos.shape[1] if cos.numel() else D
    launch(puzzle_split_kernel, (H, n_splits, row_blocks(M)),
        q.float().contiguous(), *(kernel_arg(x) for x in first), *(kernel_arg(x) for x in second),
        *(kernel_arg(t[name]) for name in ("cos", "sin", "sink_k", "sink_v", "tail_k", "tail_v")), m, l, o,
        M, N, N2, page_size, rank_k, rank_v, D, TS, T, scaling, first_position, W,
        pages_per_split, tokens_per_split, n_main_splits, n_page_splits, n_splits,
        INT4=int4, PRE_ROPE=pre_rope, SAME_HALVES=W != D,
        BM=ROW_BLOCK, BP=pow2(page_size), BRK=pow2(rank_k), BRV=pow2(rank_v), BD=pow2(D),
        BDH=pow2(D // 2), BT=32,
    )
    return merge_splits(m, l, o)  # one more launch (flash-decoding's reduction)


# The op is the Triton launcher itself (its default implementation, for CUDA); the CPU kernel is native.
puzzle_attention = torch.library.custom_op("kvpack::puzzle_attention", mutates_args=())(_triton_puzzle_attention)


@puzzle_attention.register_fake
def _(q, pages, *args):
    H, M, D = q.shape
    return q.new_empty(H, M, dtype=torch.float32), q.new_empty(H, M, dtype=torch.float32), \
        q.new_empty(H, M, D, dtype=torch.float32)


def puzzle_partial(pages: PuzzlePages, qg: torch.Tensor, scaling: float, pages_per_split: int | None = None,
                   tokens_per_split: int = 256, native: bool = False,
                   dot_precision: str = "float32") -> PartialAttention:
    """Merged state of ``qg [kv_heads, rows, d]`` over everything a PuzzleKV store holds (its
    :class:`PuzzlePages` view), read in place: no per-step copy of the factors or of RoPE rows.

    Args:
        pages_per_split: factorized pages per program (default: about 32 programs per KV head).
        tokens_per_split: dense tokens per program.
        native: run the op's native CPU kernel (CPU tensors); otherwise the Triton kernel (on CPU
            tensors: the launcher itself, under the interpreter).
        dot_precision: how the native kernel rebuilds pre-RoPE keys (``cpu.bf16_products``; the store's
            config passes its own, ``auto`` by default; ``float32`` here, the reference numerics).
    """
    d = pages.head_dim
    pre_rope = pages.rope is not None
    if pre_rope and d % 4 and not native:
        raise ValueError(f"the Triton PuzzleKV kernel needs head_dim % 4 == 0 for pre-RoPE keys, got {d}")
    operands = pages.operands(qg.device)
    N, P, first = pages.n_pages, pages.page_size, pages.first_position
    pps = pages_per_split or max(1, math.ceil(N / 32))  # the recent set (<= max(8, √N) pages) adds a few
    bf16 = cpu.bf16_products(dot_precision, pages.int4, operands[0].dtype)
    # On CPU tensors without `native`, the Triton launcher itself (the interpreter); else the op.
    run = _triton_puzzle_attention if not native and qg.device.type == "cpu" else puzzle_attention
    m, l, o = run(qg.float().contiguous(), operands, P, pages.rank_k, pages.rank_v, float(scaling), pages.int4,
                  pre_rope, first, pps, tokens_per_split, bf16)
    return PartialAttention(m=m, l=l, o=o)
