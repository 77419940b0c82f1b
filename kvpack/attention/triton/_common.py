"""Pieces both decode kernels share: fp32 block products, the online-softmax step and writing a split's state."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """``tl.dot`` with full fp32 products. Triton's default for fp32 operands on NVIDIA GPUs is TF32
    (10-bit mantissa, ~1e-3 relative error per product); decode attention is bound by memory
    bandwidth, not by tensor-core throughput, so the kernels keep fp32 and match the fp64
    reference to the tolerances the tests state (the interpreter computes in fp32 either way)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def online_softmax_step(m_i, l_i, scores):
    """Fold a ``[BM, BN]`` block of scaled logits (``-inf`` = masked) into the running max ``m_i`` and
    normaliser ``l_i``; returns ``(m_new, l_new, alpha, p)`` where the accumulator must be scaled by
    ``alpha`` before adding ``p @ values``."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay at 0
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc, offs_m, offs_d):
    """Write one program's ``(m, l, o)`` to ``m, l [H, n_splits, M]``, ``o [H, n_splits, M, D]``."""
    mask_m = offs_m < M
    out = (h * n_splits + s) * M
    tl.store(m_ptr + out + offs_m, m_i, mask=mask_m)
    tl.store(l_ptr + out + offs_m, l_i, mask=mask_m)
    tl.store(o_ptr + out * D + offs_m[:, None] * D + offs_d[None, :], acc,
             mask=mask_m[:, None] & (offs_d[None, :] < D))
