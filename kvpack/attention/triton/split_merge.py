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

from ._launch import ROW_BLOCK, launch, pow2

_SPLITS = 8  # splits per loop step
_COLS = 64  # output columns per program, at most


@triton.jit
def merge_splits_kernel(m_ptr, l_ptr, o_ptr, m_out, l_out, o_out, S, M, D,
                        BS: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """Grid ``(kv_heads, row blocks of BM, column blocks of BC)``. Inputs (contiguous, fp32): m, l
    ``[H, S, M]``, o ``[H, S, M, D]``; outputs m, l ``[H, M]`` (written by the first column block),
    o ``[H, M, D]``. Splits that saw no key (``m = -inf``) weigh zero; a row no split saw keeps
    ``m = -inf``, ``l = 0``, ``o = 0``."""
    h = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    offs_s = tl.arange(0, BS)
    mask_m = offs_m < M
    mask_c = offs_c < D
    # Pass 1: each row's maximum over the splits.
    m_max = tl.full([BM], float("-inf"), tl.float32)
    for s0 in range(0, S, BS):
        ss = s0 + offs_s
        sm = (ss[:, None] < S) & mask_m[None, :]
        m_s = tl.load(m_ptr + (h * S + ss[:, None]) * M + offs_m[None, :], mask=sm, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m_s, axis=0))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # exp(-inf - 0) = 0 for rows no split saw
    # Pass 2: the splits' normalisers and outputs, each weighted by e^(m_s - m).
    l_sum = tl.zeros([BM], tl.float32)
    o_sum = tl.zeros([BM, BC], tl.float32)
    for s0 in range(0, S, BS):
        ss = s0 + offs_s
        sm = (ss[:, None] < S) & mask_m[None, :]
        row = (h * S + ss[:, None]) * M + offs_m[None, :]  # [BS, BM]
        w = tl.exp(tl.load(m_ptr + row, mask=sm, other=float("-inf")) - m_safe[None, :])
        l_sum += tl.sum(tl.load(l_ptr + row, mask=sm, other=0.0) * w, axis=0)
        o_s = tl.load(o_ptr + row[:, :, None] * D + offs_c[None, None, :],
                      mask=sm[:, :, None] & mask_c[None, None, :], other=0.0)  # [BS, BM, BC]
        o_sum += tl.sum(o_s * w[:, :, None], axis=0)
    tl.store(o_out + (h * M + offs_m[:, None]) * D + offs_c[None, :], o_sum,
             mask=mask_m[:, None] & mask_c[None, :])
    if tl.program_id(2) == 0:
        tl.store(m_out + h * M + offs_m, m_max, mask=mask_m)
        tl.store(l_out + h * M + offs_m, l_sum, mask=mask_m)


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
           m, l, o, m_out, l_out, o_out, S, M, D, BS=_SPLITS, BM=BM, BC=BC)
    return m_out, l_out, o_out
