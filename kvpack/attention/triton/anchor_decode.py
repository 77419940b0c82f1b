"""Triton split-K attention over one AnchorKV segment, keys and values rebuilt in registers.

Grid ``(kv_heads, n_splits)``; each program walks its share of the segment in 32-token blocks (the
prefix-count granularity). For a block it gathers each token's anchor row, scales it by the token's
coefficient γ, and adds the token's residual where its mask bit is set: the slot is the block's
prefix count plus the residuals before the token in the block (``tl.cumsum`` of the mask bits), the
2-bit codes become Lloyd–Max levels times the token's scale, and the inverse randomized Hadamard is
applied as one ``[32, D] x [D, D]`` product with the orthonormal Sylvester matrix followed by the
signs — exactly the map ``x = s ⊙ (Hᵀ y)`` (H is symmetric), computed as a small dense matmul instead
of a butterfly (at D <= 256 a tensor-core matmul costs less than D log D shuffles between lanes).
Keys are then rotated by RoPE at their positions (halves, ``rotate_half`` convention) and meet the
queries. Values are never rebuilt: ``v̂ = γ a + s ⊙ (Hᵀ y)`` is linear, so the program accumulates
``p (γ a)`` and, separately, ``p y`` in the rotated domain, and applies the inverse rotation once,
to the ``[M, D]`` accumulator, when it stores its state — half the Hadamard products of rebuilding
both sides per block. Nothing reconstructed is written back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import dot, online_softmax_step, rotated_scores, store_split_state


@triton.jit
def _scaled_anchors(anchor_ptr, h, K, D, idx, coef, col0, offs_c, n_cols, tm):
    """Columns ``[col0, col0 + n_cols)`` of ``γ · anchor[idx]`` for a block of tokens."""
    cm = offs_c < n_cols
    a = tl.load(anchor_ptr + (h * K + idx)[:, None] * D + col0 + offs_c[None, :], mask=tm[:, None] & cm[None, :],
                other=0.0).to(tl.float32)
    return a * coef[:, None]


@triton.jit
def _unrotate(y, hmat_ptr, signs_ptr, col0, offs_c, n_cols, offs_dd, D):
    """Columns ``[col0, col0 + n_cols)`` of ``(y Hᵀ) ⊙ s`` for rotated-domain rows ``y [R, BD]``."""
    cm = offs_c < n_cols
    hm = tl.load(hmat_ptr + offs_dd[:, None] * D + col0 + offs_c[None, :],
                 mask=(offs_dd[:, None] < D) & cm[None, :], other=0.0)
    signs = tl.load(signs_ptr + col0 + offs_c, mask=cm, other=0.0)
    return dot(y, hm) * signs[None, :]


@triton.jit
def _residual_levels(res_ptr, scale_ptr, slot, has, offs_d, D, L0, L1, L2, L3):
    """``[32, BD]`` Lloyd–Max levels times the token's scale (zero rows where there is no residual)."""
    m = has[:, None] & (offs_d[None, :] < D)
    byte = tl.load(res_ptr + slot[:, None] * (D // 4) + offs_d[None, :] // 4, mask=m, other=0).to(tl.int32)
    code = (byte >> ((offs_d[None, :] % 4) * 2)) & 3
    level = tl.where(code == 0, L0, tl.where(code == 1, L1, tl.where(code == 2, L2, L3)))
    scale = tl.load(scale_ptr + slot, mask=has, other=0.0).to(tl.float32)
    return tl.where(m, level * scale[:, None], 0.0)


@triton.jit
def _block_tokens(idx_ptr, coef_ptr, mask_ptr, prefix_ptr, res_ptr, scale_ptr, h, n, b, tt, tm, offs_d, D,
                  L0, L1, L2, L3):
    """One side's per-token data of a 32-token block: anchor index, coefficient, and the residual
    levels ``y [32, BD]`` (zero rows where the mask bit is clear)."""
    idx = tl.load(idx_ptr + h * n + tt, mask=tm, other=0).to(tl.int32)
    coef = tl.load(coef_ptr + h * n + tt, mask=tm, other=0.0).to(tl.float32)
    byte = tl.load(mask_ptr + h * ((n + 7) // 8) + tt // 8, mask=tm, other=0).to(tl.int32)
    bit = (byte >> (tt % 8)) & 1
    # Slot = the block's prefix count + residuals before the token in the block.
    slot = tl.load(prefix_ptr + h * ((n + 31) // 32) + b) + tl.cumsum(bit, 0) - bit
    y = _residual_levels(res_ptr, scale_ptr, slot, (bit == 1) & tm, offs_d, D, L0, L1, L2, L3)
    return idx, coef, y


@triton.jit
def anchor_split_kernel(
    q_ptr, ak_ptr, av_ptr, hmat_ptr, signs_ptr, cos_ptr, sin_ptr,
    idx_k_ptr, coef_k_ptr, mask_k_ptr, prefix_k_ptr, res_k_ptr, scale_k_ptr,
    idx_v_ptr, coef_v_ptr, mask_v_ptr, prefix_v_ptr, res_v_ptr, scale_v_ptr,
    m_ptr, l_ptr, o_ptr,
    M, K, D, n, scaling, pos0, W, blocks_per_split, n_splits, L0, L1, L2, L3,
    SAME_HALVES: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDH: tl.constexpr, BT: tl.constexpr,
):
    """Layouts: q ``[H, M, D]`` fp32; anchors ``[H, K, D]``; hmat ``[D, D]``, signs ``[D]``; cos/sin:
    the shared RoPE tables ``[positions, W]`` (the segment's token ``t`` is at ``pos0 + t``); per side: index ``[H, n]`` int16 or uint8, coef ``[H, n]``,
    mask ``[H, ceil(n / 8)]`` packed bits, prefix ``[H, ceil(n / 32)]`` int32 (global slot of the
    block's first residual), res ``[slots, D / 4]`` packed 2-bit codes, scale ``[slots]``.
    Outputs m, l ``[H, n_splits, M]``, o ``[H, n_splits, M, D]``. ``BT`` must be 32 (prefix blocks).
    """
    h = tl.program_id(0)
    s = tl.program_id(1)
    HALF = D // 2
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BDH)
    offs_t = tl.arange(0, BT)
    mask_m = offs_m < M
    hm_ = mask_m[:, None] & (offs_h[None, :] < HALF)
    q1 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + offs_h[None, :], mask=hm_, other=0.0)
    q2 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + HALF + offs_h[None, :], mask=hm_, other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    acc_rot = tl.zeros([BM, BD], tl.float32)
    n_blocks = (n + BT - 1) // BT
    b_lo = s * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    for b in range(b_lo, b_hi):
        tt = b * BT + offs_t
        tm = tt < n
        # Keys: anchors, coefficients, residuals, RoPE.
        idx, coef, y = _block_tokens(idx_k_ptr, coef_k_ptr, mask_k_ptr, prefix_k_ptr, res_k_ptr, scale_k_ptr, h, n,
                                     b, tt, tm, offs_d, D, L0, L1, L2, L3)
        k1 = _scaled_anchors(ak_ptr, h, K, D, idx, coef, 0, offs_h, HALF, tm) \
            + _unrotate(y, hmat_ptr, signs_ptr, 0, offs_h, HALF, offs_d, D)
        k2 = _scaled_anchors(ak_ptr, h, K, D, idx, coef, HALF, offs_h, HALF, tm) \
            + _unrotate(y, hmat_ptr, signs_ptr, HALF, offs_h, HALF, offs_d, D)
        scores = rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos0 + tt, tm, offs_h, HALF, W,
                                SAME_HALVES) * scaling
        scores = tl.where(mask_m[:, None] & tm[None, :], scores, float("-inf"))
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        # Values, not rebuilt: the anchor part, and the residual levels still in the rotated domain.
        idx, coef, y = _block_tokens(idx_v_ptr, coef_v_ptr, mask_v_ptr, prefix_v_ptr, res_v_ptr, scale_v_ptr, h, n,
                                     b, tt, tm, offs_d, D, L0, L1, L2, L3)
        acc = acc * alpha[:, None] + dot(p, _scaled_anchors(av_ptr, h, K, D, idx, coef, 0, offs_d, D, tm))
        acc_rot = acc_rot * alpha[:, None] + dot(p, y)
        m_i = m_new
    acc += _unrotate(acc_rot, hmat_ptr, signs_ptr, 0, offs_d, D, offs_d, D)  # once per program
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc, offs_m, offs_d)
