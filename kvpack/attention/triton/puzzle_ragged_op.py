"""The ``puzzle_plus`` decode kernel as a PyTorch custom op (``kvpack::puzzle_ragged_attention``) and
its launcher :func:`ragged_puzzle_partial`, which ``PuzzlePlusStore`` calls with its
:class:`RaggedPuzzlePages` view (every tensor read in place). One schema, two backends: the Triton
kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``, the launcher called directly) and the native CPU kernel
(``kvpack/attention/cpu/csrc/ragged.cpp``), bound to the op's CPU dispatch in C++ (``csrc/bindings.cpp``)."""

from __future__ import annotations

import math

import torch

from .. import cpu
from ..ragged_pages import RAGGED_OPERANDS, RaggedPuzzlePages
from ..softmax_merge import PartialAttention
from ._launch import ROW_BLOCK, empty_state, kernel_arg, launch, pow2, row_blocks, split_state_buffers

# Ranks per step of a page's rank loop. 64-rank tiles with pre-RoPE INT4 keys took 255 registers
# and spilled 96 bytes per thread on sm_80 (d = 128, P = 64; benchmarks/kernel_resources.py).
RANK_BLOCK = 32


def _triton_puzzle_ragged_attention(
    q: torch.Tensor, pages: list[torch.Tensor], page_size: int, max_rank: int, scaling: float, int4: bool,
    pre_rope: bool, first_position: int, pages_per_split: int, tokens_per_split: int, bf16_products: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of ``q [H, M, D]`` over a ``puzzle_plus``
    layer (``pages``: its tensors as :data:`~kvpack.attention.ragged_pages.RAGGED_OPERANDS` names them,
    :meth:`RaggedPuzzlePages.operands`): the ragged pages (``k_rank [N, H]`` etc.; layouts in
    ``puzzle_ragged_decode``) and the dense sink and tail. ``bf16_products``: as for ``puzzle_attention``
    (native CPU kernel only)."""
    from .puzzle_ragged_decode import puzzle_ragged_split_kernel
    from .split_merge import merge_splits

    if len(pages) != len(RAGGED_OPERANDS):
        raise ValueError(f"puzzle_ragged_attention: expected the {len(RAGGED_OPERANDS)} tensors of RAGGED_OPERANDS, "
                         f"got {len(pages)}")
    t = dict(zip(RAGGED_OPERANDS, pages))
    sink_k, tail_k, cos = t["sink_k"], t["tail_k"], t["cos"]
    H, M, D = q.shape
    N = t["k_rank"].shape[0]
    TS, T = sink_k.shape[1], sink_k.shape[1] + tail_k.shape[1]
    n_page_splits = math.ceil(N / pages_per_split)
    n_splits = n_page_splits + (math.ceil(T / tokens_per_split) if T else 0)
    dev = q.device
    if n_splits == 0:
        return empty_state(H, M, D, dev)
    m, l, o = split_state_buffers(H, M, D, n_splits, dev)
    W = cos.shape[1] if cos.numel() else D
    launch(puzzle_ragged_split_kernel, (H, n_splits, row_blocks(M)),
        q.float().contiguous(), *(kernel_arg(x) for x in pages),
        m, l, o, H, M, N, page_size, D, TS, T, scaling, first_position, W,
        pages_per_split, tokens_per_split, n_page_splits, n_splits,
        INT4=int4, PRE_ROPE=pre_rope, SAME_HALVES=W != D,
        BM=ROW_BLOCK, BP=pow2(page_size), BR=min(pow2(max_rank), RANK_BLOCK), BD=pow2(D), BDH=pow2(D // 2), BT=32,
    )
    return merge_splits(m, l, o)


# The op is the Triton launcher itself (its default implementation, for CUDA); the CPU kernel is native.
puzzle_ragged_attention = torch.library.custom_op("kvpack::puzzle_ragged_attention", mutates_args=())(
    _triton_puzzle_ragged_attention)


@puzzle_ragged_attention.register_fake
def _(q, pages, *args):
    H, M, D = q.shape
    return q.new_empty(H, M, dtype=torch.float32), q.new_empty(H, M, dtype=torch.float32), \
        q.new_empty(H, M, D, dtype=torch.float32)


def ragged_puzzle_partial(pages: RaggedPuzzlePages, qg: torch.Tensor, scaling: float,
                          pages_per_split: int | None = None, tokens_per_split: int = 256,
                          native: bool = False, dot_precision: str = "float32") -> PartialAttention:
    """Merged state of ``qg [kv_heads, rows, d]`` over everything a ``puzzle_plus`` store holds.

    Args:
        pages_per_split: pages per program (default: about 32 programs per KV head).
        tokens_per_split: dense tokens per program.
        native: run the op's native CPU kernel (CPU tensors); otherwise the Triton kernel (on CPU
            tensors: the launcher itself, under the interpreter).
        dot_precision: how the native kernel rebuilds pre-RoPE keys (``cpu.bf16_products``; the store's
            config passes its own, ``auto`` by default; ``float32`` here, the reference numerics).
    """
    d = pages.head_dim
    pre_rope = pages.rope is not None
    if pre_rope and d % 4 and not native:
        raise ValueError(f"the Triton puzzle_plus kernel needs head_dim % 4 == 0 for pre-RoPE keys, got {d}")
    operands = pages.operands(qg.device)
    keys, values = pages.keys, pages.values
    N, P, first = pages.n_pages, pages.page_size, pages.first_position
    max_rank = max(b.rank for side in (keys, values) for b in side.buckets)
    pps = pages_per_split or max(1, math.ceil(N / 32))
    bf16 = cpu.bf16_products(dot_precision, pages.int4, keys.left.dtype)
    # On CPU tensors without `native`, the Triton launcher itself (the interpreter); else the op.
    run = _triton_puzzle_ragged_attention if not native and qg.device.type == "cpu" else puzzle_ragged_attention
    m, l, o = run(qg.float().contiguous(), operands, P, max_rank, float(scaling), pages.int4, pre_rope, first, pps,
                  tokens_per_split, bf16)
    return PartialAttention(m=m, l=l, o=o)
