"""Triton split-K attention over one ``puzzle_plus`` layer: dense sink/tail tokens and factorized
pages whose ranks differ per (KV head, page, side).

The same scheme as ``puzzle_decode`` (one launch per layer; grid ``(kv_heads, splits, row
blocks)``; splits of pages, then of dense tokens; online softmax per program, merged by
``split_merge``), with one difference: a page's factors are not at fixed strides. For KV head ``h``
and page ``n`` the program reads the page's rank ``r`` and rank offset ``o`` from the side's tables
(``rank [N, H]``, ``offset [N, H]``) and loads ``L [P, r]`` from element ``o·P`` (row stride ``r``)
and ``R [r, d]`` from element ``o·d`` of the flat buffers (INT4: bytes ``o·P/2`` and ``o·d/2``,
row strides ``r/2`` and ``d/2``; L's column scales at ``o``, R's at ``(n·H + h)·d``), ``BR`` ranks
at a time (``ceil(r / BR)`` steps, the last one masked to ``r``): the work follows each page's
rank, and no padding exists in memory.

Numerics: fp32 accumulation; inputs fp32/bf16/fp16 (or INT4 codes). Tiles ≥ 16 for ``tl.dot``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import dot, online_softmax_step, rotated_scores, store_split_state
from .puzzle_decode import _dense_tokens, _load_factor, _query_halves


@triton.jit
def _ragged_pages(q, q1, q2, m_i, l_i, acc, h, H, n_lo, n_hi, pos_first,
                  lk_ptr, rk_ptr, lv_ptr, rv_ptr, lks_ptr, rks_ptr, lvs_ptr, rvs_ptr,
                  krank_ptr, koff_ptr, vrank_ptr, voff_ptr, cos_ptr, sin_ptr,
                  P, D, W, scaling, mask_m, offs_p, offs_r, offs_d, offs_h,
                  INT4: tl.constexpr, PRE_ROPE: tl.constexpr, SAME_HALVES: tl.constexpr,
                  BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BDH: tl.constexpr):
    """Fold pages ``[n_lo, n_hi)`` of KV head ``h`` into the online-softmax state. A page's ranks are
    taken in blocks of ``BR`` (a loop of ``ceil(r / BR)`` steps): the work follows the page's rank,
    and the tiles stay ``[P, BR]`` / ``[BR, d]`` whatever the largest rank."""
    HALF = D // 2
    for n in range(n_lo, n_hi):
        entry = n * H + h
        rk = tl.load(krank_ptr + entry).to(tl.int32)
        ok = tl.load(koff_ptr + entry).to(tl.int32)
        rv = tl.load(vrank_ptr + entry).to(tl.int32)
        ov = tl.load(voff_ptr + entry).to(tl.int32)
        if INT4:  # packed codes: two per byte along a row
            lk_base, lk_stride, rk_base = ok * P // 2, rk // 2, ok * D // 2
            lv_base, lv_stride, rv_base = ov * P // 2, rv // 2, ov * D // 2
            d_stride, half_cols = D // 2, HALF // 2
        else:
            lk_base, lk_stride, rk_base = ok * P, rk, ok * D
            lv_base, lv_stride, rv_base = ov * P, rv, ov * D
            d_stride, half_cols = D, HALF
        if PRE_ROPE:
            k1 = tl.zeros([BP, BDH], tl.float32)
            k2 = tl.zeros([BP, BDH], tl.float32)
            for r0 in range(0, rk, BR):
                offs = r0 + offs_r
                lk = _load_factor(lk_ptr, lk_base, P, rk, lk_stride, offs_p, offs, INT4, lks_ptr, ok, 0, 1)
                rk1 = _load_factor(rk_ptr, rk_base, rk, HALF, d_stride, offs, offs_h, INT4, rks_ptr, entry * D, 0, 1)
                rk2 = _load_factor(rk_ptr, rk_base + half_cols, rk, HALF, d_stride, offs, offs_h, INT4,
                                   rks_ptr, entry * D + HALF, 0, 1)
                k1 += dot(lk, rk1)
                k2 += dot(lk, rk2)
            scores = rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos_first + n * P + offs_p, offs_p < P,
                                    offs_h, HALF, W, SAME_HALVES)
        else:
            scores = tl.zeros([BM, BP], tl.float32)
            for r0 in range(0, rk, BR):
                offs = r0 + offs_r
                lk = _load_factor(lk_ptr, lk_base, P, rk, lk_stride, offs_p, offs, INT4, lks_ptr, ok, 0, 1)
                rkf = _load_factor(rk_ptr, rk_base, rk, D, d_stride, offs, offs_d, INT4, rks_ptr, entry * D, 0, 1)
                scores += dot(dot(q, tl.trans(rkf)), tl.trans(lk))  # (q R_Kᵀ) L_Kᵀ: [BM, BP]
        scores = scores * scaling
        scores = tl.where(mask_m[:, None] & (offs_p[None, :] < P), scores, float("-inf"))
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        pv = tl.zeros([BM, BD], tl.float32)
        for r0 in range(0, rv, BR):
            offs = r0 + offs_r
            lv = _load_factor(lv_ptr, lv_base, P, rv, lv_stride, offs_p, offs, INT4, lvs_ptr, ov, 0, 1)
            rvf = _load_factor(rv_ptr, rv_base, rv, D, d_stride, offs, offs_d, INT4, rvs_ptr, entry * D, 0, 1)
            pv += dot(dot(p, lv), rvf)  # (p L_V) R_V in rank space first
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def puzzle_ragged_split_kernel(
    q_ptr, lk_ptr, rk_ptr, lv_ptr, rv_ptr, lks_ptr, rks_ptr, lvs_ptr, rvs_ptr,
    krank_ptr, koff_ptr, vrank_ptr, voff_ptr, cos_ptr, sin_ptr,
    sk_ptr, sv_ptr, tk_ptr, tv_ptr, m_ptr, l_ptr, o_ptr,
    H, M, N, P, D, TS, T, scaling, pos0, W, pages_per_split, tokens_per_split, n_page_splits, n_splits,
    INT4: tl.constexpr, PRE_ROPE: tl.constexpr, SAME_HALVES: tl.constexpr,
    BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BDH: tl.constexpr, BT: tl.constexpr,
):
    """Grid ``(kv_heads, n_splits, row blocks)``: splits of the ``N`` pages, then of the dense tokens.

    q ``[H, M, D]`` fp32; per side the flat factor buffers, the INT4 scales (L's ``[Σ r]``, R's
    ``[N, H, D]``; unused placeholders otherwise), ``rank`` and ``offset`` ``[N, H]``; cos/sin the
    shared RoPE tables (PRE_ROPE; page ``n`` starts at position ``pos0 + n·P``); dense sink
    ``[H, TS, D]`` and tail ``[H, T − TS, D]``; outputs m, l ``[H, n_splits, M]``, o
    ``[H, n_splits, M, D]`` fp32.
    """
    h = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.program_id(2) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask_m = offs_m < M
    q = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    offs_p = tl.arange(0, BP)
    offs_r = tl.arange(0, BR)
    offs_h = tl.arange(0, BDH)
    q1, q2 = _query_halves(q_ptr, h, M, D, offs_m, mask_m, offs_h)  # for pre-RoPE keys (unused otherwise)
    if s < n_page_splits:
        n_lo = s * pages_per_split
        m_i, l_i, acc = _ragged_pages(q, q1, q2, m_i, l_i, acc, h, H, n_lo, tl.minimum(n_lo + pages_per_split, N),
                                      pos0, lk_ptr, rk_ptr, lv_ptr, rv_ptr, lks_ptr, rks_ptr, lvs_ptr, rvs_ptr,
                                      krank_ptr, koff_ptr, vrank_ptr, voff_ptr, cos_ptr, sin_ptr,
                                      P, D, W, scaling, mask_m, offs_p, offs_r, offs_d, offs_h,
                                      INT4, PRE_ROPE, SAME_HALVES, BM, BP, BR, BD, BDH)
    else:
        t_lo = (s - n_page_splits) * tokens_per_split
        m_i, l_i, acc = _dense_tokens(q, m_i, l_i, acc, h, t_lo, tl.minimum(t_lo + tokens_per_split, T),
                                      sk_ptr, sv_ptr, tk_ptr, tv_ptr, TS, T, D, scaling, mask_m, offs_d, BT)
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc, offs_m, offs_d, 0, D)
