"""Flash-decoding's second kernel: the log-sum-exp merge of the splits' softmax states, in one launch.

Both decode kernels write one state per (KV head, split, query row); this kernel merges them over
the split axis with the arithmetic of ``softmax_merge.merge_partials`` — the rows' maximum over the
splits first, then the weighted sums ``l = Σ_s l_s e^(m_s − m)``, ``o = Σ_s o_s e^(m_s − m)`` in fp32
— so the merged state is the same up to the order of the additions. One launch replaces the ten
PyTorch ops of the merge (a kernel each, on a GPU, however small; in a CUDA graph too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import merge_states
from ._launch import ROW_BLOCK, launch, pow2

_COLS = 64  # output columns per program, at most


@triton.jit
def merge_splits_kernel(m_ptr, l_ptr, o_ptr, m_out, l_out, o_out, S, M, D, BM: tl.constexpr, BC: tl.constexpr):
    """Grid ``(kv_heads, row blocks of BM, column blocks of BC)``. Inputs (contiguous, fp32): m, l
    ``[H, S, M]``, o ``[H, S, M, D]``; outputs m, l ``[H, M]`` (written by the first column block),
    o ``[H, M, D]``. Splits that saw no key (``m = -inf``) weigh zero; a row no split saw keeps
    ``m = -inf``, ``l = 0``, ``o = 0``."""
    h = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    mask_m = offs_m < M
    mask_c = offs_c < D
    m_i, l_i, acc = merge_states(m_ptr, l_ptr, o_ptr, h, S, M, D, offs_m, mask_m, offs_c, mask_c, BM, BC)
    tl.store(o_out + (h * M + offs_m[:, None]) * D + offs_c[None, :], acc, mask=mask_m[:, None] & mask_c[None, :])
    if tl.program_id(2) == 0:
        tl.store(m_out + h * M + offs_m, m_i, mask=mask_m)
        tl.store(l_out + h * M + offs_m, l_i, mask=mask_m)


def merge_splits(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Merge split states ``m, l [H, S, M]``, ``o [H, S, M, D]`` (fp32, contiguous, as the decode
    kernels write them) over the split axis: ``(m [H, M], l [H, M], o [H, M, D])``, one launch."""
    H, S, M = m.shape
    D = o.shape[-1]
    m_out = m.new_empty(H, M)
    l_out = m.new_empty(H, M)
    o_out = o.new_empty(H, M, D)
    BM, BC = min(ROW_BLOCK, pow2(M, floor=1)), min(_COLS, pow2(D, floor=1))
    launch(merge_splits_kernel, (H, triton.cdiv(M, BM), triton.cdiv(D, BC)),
           m, l, o, m_out, l_out, o_out, S, M, D, BM=BM, BC=BC)
    return m_out, l_out, o_out
