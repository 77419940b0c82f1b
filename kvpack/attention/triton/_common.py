"""Pieces the kernels share: block products, RoPE'd scores, the online-softmax step, writing a split's
state and merging stored states."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """``tl.dot`` with TF32 inputs for fp32 operands (tensor cores; fp32 accumulation), stated rather
    than left to ``TRITON_F32_DEFAULT``. TF32 keeps 10 mantissa bits, more than the bf16 that the
    dense SDPA baseline multiplies in; the interpreter computes in full fp32, so a GPU will sit a
    little further from the fp64 reference than the interpreter tests' tolerances (see
    docs/kernels.md)."""
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos, row_mask, offs_h, HALF, W,
                   SAME_HALVES: tl.constexpr):
    """``q · RoPE(k)`` ``[BM, BN]`` for key halves ``k1, k2 [BN, BDH]`` at positions ``pos [BN]``
    (``rotate_half`` convention) and query halves ``q1, q2``. cos/sin are the shared fp32 tables
    ``[positions, W]`` read by position: ``W = HALF`` and ``SAME_HALVES`` when both halves of a row
    are equal (the table keeps one), ``W = D`` otherwise."""
    pm = row_mask[:, None] & (offs_h[None, :] < HALF)
    c1 = tl.load(cos_ptr + pos[:, None] * W + offs_h[None, :], mask=pm, other=0.0)
    s1 = tl.load(sin_ptr + pos[:, None] * W + offs_h[None, :], mask=pm, other=0.0)
    if SAME_HALVES:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(cos_ptr + pos[:, None] * W + HALF + offs_h[None, :], mask=pm, other=0.0)
        s2 = tl.load(sin_ptr + pos[:, None] * W + HALF + offs_h[None, :], mask=pm, other=0.0)
    return dot(q1, tl.trans(k1 * c1 - k2 * s1)) + dot(q2, tl.trans(k2 * c2 + k1 * s2))


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
def store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc, offs_m, offs_c, col0, n_cols):
    """Write one program's ``(m, l, o)`` to ``m, l [H, n_splits, M]``, ``o [H, n_splits, M, D]``; ``acc``
    holds the output columns ``[col0, col0 + n_cols)`` (``offs_c`` spans them)."""
    mask_m = offs_m < M
    out = (h * n_splits + s) * M
    tl.store(m_ptr + out + offs_m, m_i, mask=mask_m)
    tl.store(l_ptr + out + offs_m, l_i, mask=mask_m)
    tl.store(o_ptr + out * D + offs_m[:, None] * D + col0 + offs_c[None, :], acc,
             mask=mask_m[:, None] & (offs_c[None, :] < n_cols))


@triton.jit
def merge_states(m_ptr, l_ptr, o_ptr, h, S, M, D, offs_m, mask_m, offs_c, mask_c,
                 BM: tl.constexpr, BC: tl.constexpr):
    """Merge ``S`` partial states ``m, l [H, S, M]``, ``o [H, S, M, D]`` (fp32, contiguous) of head
    ``h``'s rows ``offs_m`` and output columns ``offs_c`` with ``softmax_merge.merge_partials``'
    arithmetic: each row's maximum over the states first, then the normalisers and outputs weighted
    by ``e^(m_s − m)``. Returns ``(m [BM], l [BM], o [BM, BC])``; states that saw no key
    (``m = -inf``) weigh zero, and a row no state saw gets ``m = -inf``, ``l = 0``, ``o = 0``."""
    m_i = tl.full([BM], float("-inf"), tl.float32)
    for s in range(S):
        m_i = tl.maximum(m_i, tl.load(m_ptr + (h * S + s) * M + offs_m, mask=mask_m, other=float("-inf")))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)  # exp(-inf - 0) = 0 for rows no state saw
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BC], tl.float32)
    for s in range(S):
        row = (h * S + s) * M + offs_m
        w = tl.exp(tl.load(m_ptr + row, mask=mask_m, other=float("-inf")) - m_safe)
        l_i += tl.load(l_ptr + row, mask=mask_m, other=0.0) * w
        acc += tl.load(o_ptr + row[:, None] * D + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :],
                       other=0.0) * w[:, None]
    return m_i, l_i, acc
