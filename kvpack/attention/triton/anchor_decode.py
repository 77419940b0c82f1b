"""Triton split-K attention over one AnchorKV segment, keys rebuilt in registers, values never.

Grid ``(kv_heads, n_splits, blocks of BM query rows)``; each program walks its share of the segment
in 32-token blocks (the prefix-count granularity). For a block it gathers each token's anchor row,
scales it by the token's coefficient γ, and adds the token's residual where its mask bit is set: the
slot is the block's prefix count plus the residuals before the token in the block (``tl.cumsum`` of
the mask bits), the 2-bit codes become the codec's levels, and the inverse randomized Hadamard ``x = s ⊙ (Hᵀ y)`` (H is
symmetric) is one ``[32, D] x [D, D/2]`` product per key half. Keys are then rotated by RoPE at their
positions (halves, ``rotate_half`` convention) and meet the queries.

A fine tier (``anchor_plus``, ``FINE``): a second bitmask, prefix counts, 4-bit codes and scales per
side, coded with the same rotation. A token-side has at most one residual, so the block's levels and
scales are taken from whichever tier holds the token's (``tl.where``) and the same product serves
both; the fine levels come from a 16-entry table (fp16 values, so still exact).

Exactness of the rotation on tensor cores: the codec's levels are fp16 values and the matrix is
``factor · M`` with ``M`` exactly ±1 (``ResidualCodec.kernel_matrix``), so ``levels @ M`` runs as an
fp16 product with fp32 accumulation and no rounding at all; the per-token scale, ``factor`` and the
signs are applied after, in fp32. ``M`` is loaded once per program (two ``[D, D/2]`` fp16 halves).
A butterfly would need log D rounds of cross-lane shuffles that Triton does not expose; at D <= 256
the matmul on tensor cores is the cheaper exact form.

Values are never rebuilt: ``v̂ = γ a + s ⊙ (Hᵀ y)`` is linear, so the program accumulates ``p (γ a)``
and, separately, ``p y`` in the rotated domain, and applies the rotation once, when it stores its
state — to the row-normalised ``[M, D]`` accumulator split into two fp16 parts (``hi + lo``, 22
significant bits; normalised so fp16's range cannot overflow). Nothing reconstructed is written back.
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
def _residual_levels(res_ptr, slot, has, offs_d, D, L0, L1, L2, L3):
    """``[32, BD]`` fp16 levels of the 2-bit codes (exact: the codec's levels are fp16 values), zero
    rows where there is no residual."""
    m = has[:, None] & (offs_d[None, :] < D)
    byte = tl.load(res_ptr + slot[:, None] * (D // 4) + offs_d[None, :] // 4, mask=m, other=0).to(tl.int32)
    code = (byte >> ((offs_d[None, :] % 4) * 2)) & 3
    level = tl.where(code == 0, L0, tl.where(code == 1, L1, tl.where(code == 2, L2, L3)))
    return tl.where(m, level, 0.0).to(tl.float16)


@triton.jit
def _fine_levels(res_ptr, slot, has, offs_d, D, levels_ptr):
    """``[32, BD]`` fp16 levels of the fine tier's 4-bit codes (from the 16-entry table at
    ``levels_ptr``), zero rows where the token-side has no fine residual."""
    m = has[:, None] & (offs_d[None, :] < D)
    byte = tl.load(res_ptr + slot[:, None] * (D // 2) + offs_d[None, :] // 2, mask=m, other=0).to(tl.int32)
    code = (byte >> ((offs_d[None, :] % 2) * 4)) & 15
    level = tl.load(levels_ptr + code, mask=m, other=0.0)
    return tl.where(m, level, 0.0).to(tl.float16)


@triton.jit
def _residual_slots(mask_ptr, prefix_ptr, h, n, b, tt, tm):
    """``(slot, has)`` ``[32]`` of one residual tier for a 32-token block: the slot is the block's
    prefix count plus the tier's residuals before the token in the block (``tl.cumsum`` of the bits)."""
    byte = tl.load(mask_ptr + h * ((n + 7) // 8) + tt // 8, mask=tm, other=0).to(tl.int32)
    bit = (byte >> (tt % 8)) & 1
    slot = tl.load(prefix_ptr + h * ((n + 31) // 32) + b) + tl.cumsum(bit, 0) - bit
    return slot, (bit == 1) & tm


@triton.jit
def _block_tokens(idx_ptr, coef_ptr, mask_ptr, prefix_ptr, res_ptr, scale_ptr,
                  fmask_ptr, fprefix_ptr, fres_ptr, fscale_ptr, flevels_ptr,
                  h, n, b, tt, tm, offs_d, D, L0, L1, L2, L3, FINE: tl.constexpr):
    """One side's per-token data of a 32-token block: anchor index, coefficient, residual levels
    ``[32, BD]`` fp16 and residual scale ``[32]`` (both zero where the token-side has no residual;
    from the fine tier where it has a 4-bit one)."""
    idx = tl.load(idx_ptr + h * n + tt, mask=tm, other=0).to(tl.int32)
    coef = tl.load(coef_ptr + h * n + tt, mask=tm, other=0.0).to(tl.float32)
    slot, has = _residual_slots(mask_ptr, prefix_ptr, h, n, b, tt, tm)
    levels = _residual_levels(res_ptr, slot, has, offs_d, D, L0, L1, L2, L3)
    scale = tl.load(scale_ptr + slot, mask=has, other=0.0).to(tl.float32)
    if FINE:  # the tiers are disjoint: take each token-side's levels and scale from the tier holding it
        fslot, fhas = _residual_slots(fmask_ptr, fprefix_ptr, h, n, b, tt, tm)
        levels = tl.where(fhas[:, None], _fine_levels(fres_ptr, fslot, fhas, offs_d, D, flevels_ptr), levels)
        scale = tl.where(fhas, tl.load(fscale_ptr + fslot, mask=fhas, other=0.0).to(tl.float32), scale)
    return idx, coef, levels, scale


@triton.jit
def anchor_split_kernel(
    q_ptr, ak_ptr, av_ptr, hmat_ptr, signs_ptr, cos_ptr, sin_ptr,
    idx_k_ptr, coef_k_ptr, mask_k_ptr, prefix_k_ptr, res_k_ptr, scale_k_ptr,
    idx_v_ptr, coef_v_ptr, mask_v_ptr, prefix_v_ptr, res_v_ptr, scale_v_ptr,
    fmask_k_ptr, fprefix_k_ptr, fres_k_ptr, fscale_k_ptr,
    fmask_v_ptr, fprefix_v_ptr, fres_v_ptr, fscale_v_ptr, flevels_ptr,
    m_ptr, l_ptr, o_ptr,
    M, K, D, n, scaling, hfactor, pos0, W, blocks_per_split, n_splits, L0, L1, L2, L3,
    SAME_HALVES: tl.constexpr, FINE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDH: tl.constexpr,
    BT: tl.constexpr,
):
    """Layouts: q ``[H, M, D]`` fp32; anchors ``[H, K, D]``; hmat ``[D, D]`` fp16, entries exactly 0/±1
    (the codec's matrix divided by ``hfactor``), signs ``[D]``; cos/sin: the shared RoPE tables
    ``[positions, W]`` (the segment's token ``t`` is at ``pos0 + t``); per side: index ``[H, n]``
    int16 or uint8, coef ``[H, n]``, mask ``[H, ceil(n / 8)]`` packed bits, prefix ``[H, ceil(n / 32)]``
    int32 (global slot of the block's first residual), res ``[slots, D / 4]`` packed 2-bit codes,
    scale ``[slots]``; with ``FINE``, per side the fine tier's mask, prefix, res ``[slots, D / 2]``
    (packed 4-bit codes) and scale, and its 16 levels ``flevels`` fp32 (fp16 values). Outputs m, l
    ``[H, n_splits, M]``, o ``[H, n_splits, M, D]``. ``BT`` must be 32
    (prefix blocks).
    """
    h = tl.program_id(0)
    s = tl.program_id(1)
    # Axis 2: blocks of BM query rows (a prefill chunk over the stored history has many).
    HALF = D // 2
    offs_m = tl.program_id(2) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BDH)
    offs_t = tl.arange(0, BT)
    mask_m = offs_m < M
    hm_ = mask_m[:, None] & (offs_h[None, :] < HALF)
    q1 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + offs_h[None, :], mask=hm_, other=0.0)
    q2 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + HALF + offs_h[None, :], mask=hm_, other=0.0)
    # Loop invariants: the 0/±1 matrix's column halves [BD, BDH] fp16; signs times the matrix factor.
    hmask = (offs_d[:, None] < D) & (offs_h[None, :] < HALF)
    h1 = tl.load(hmat_ptr + offs_d[:, None] * D + offs_h[None, :], mask=hmask, other=0.0)
    h2 = tl.load(hmat_ptr + offs_d[:, None] * D + HALF + offs_h[None, :], mask=hmask, other=0.0)
    sg1 = tl.load(signs_ptr + offs_h, mask=offs_h < HALF, other=0.0) * hfactor
    sg2 = tl.load(signs_ptr + HALF + offs_h, mask=offs_h < HALF, other=0.0) * hfactor
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc1 = tl.zeros([BM, BDH], tl.float32)  # value output, column halves
    acc2 = tl.zeros([BM, BDH], tl.float32)
    acc_rot = tl.zeros([BM, BD], tl.float32)  # Σ p · scale · levels, still in the rotated domain
    n_blocks = (n + BT - 1) // BT
    b_lo = s * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    for b in range(b_lo, b_hi):
        tt = b * BT + offs_t
        tm = tt < n
        # Keys: γ · anchor + scale · (levels @ M) · factor ⊙ signs, then RoPE.
        idx, coef, lev, sc = _block_tokens(idx_k_ptr, coef_k_ptr, mask_k_ptr, prefix_k_ptr, res_k_ptr, scale_k_ptr,
                                           fmask_k_ptr, fprefix_k_ptr, fres_k_ptr, fscale_k_ptr, flevels_ptr,
                                           h, n, b, tt, tm, offs_d, D, L0, L1, L2, L3, FINE)
        k1 = _scaled_anchors(ak_ptr, h, K, D, idx, coef, 0, offs_h, HALF, tm) \
            + tl.dot(lev, h1) * sc[:, None] * sg1[None, :]
        k2 = _scaled_anchors(ak_ptr, h, K, D, idx, coef, HALF, offs_h, HALF, tm) \
            + tl.dot(lev, h2) * sc[:, None] * sg2[None, :]
        scores = rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos0 + tt, tm, offs_h, HALF, W,
                                SAME_HALVES) * scaling
        scores = tl.where(mask_m[:, None] & tm[None, :], scores, float("-inf"))
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        # Values, not rebuilt: the anchor part per half, and the residual levels still rotated.
        idx, coef, lev, sc = _block_tokens(idx_v_ptr, coef_v_ptr, mask_v_ptr, prefix_v_ptr, res_v_ptr, scale_v_ptr,
                                           fmask_v_ptr, fprefix_v_ptr, fres_v_ptr, fscale_v_ptr, flevels_ptr,
                                           h, n, b, tt, tm, offs_d, D, L0, L1, L2, L3, FINE)
        acc1 = acc1 * alpha[:, None] + dot(p, _scaled_anchors(av_ptr, h, K, D, idx, coef, 0, offs_h, HALF, tm))
        acc2 = acc2 * alpha[:, None] + dot(p, _scaled_anchors(av_ptr, h, K, D, idx, coef, HALF, offs_h, HALF, tm))
        acc_rot = acc_rot * alpha[:, None] + dot(p * sc[None, :], lev.to(tl.float32))
        m_i = m_new
    # Once per program: acc += (acc_rot @ M) · factor ⊙ signs. acc_rot is normalised per row (a convex
    # combination of scaled levels, so within fp16's range) and split into fp16 hi + lo parts.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    rot = acc_rot / l_safe[:, None]
    hi = rot.to(tl.float16)
    lo = (rot - hi.to(tl.float32)).to(tl.float16)
    acc1 += (tl.dot(hi, h1) + tl.dot(lo, h1)) * sg1[None, :] * l_safe[:, None]
    acc2 += (tl.dot(hi, h2) + tl.dot(lo, h2)) * sg2[None, :] * l_safe[:, None]
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc1, offs_m, offs_h, 0, HALF)
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc2, offs_m, offs_h, HALF, HALF)
