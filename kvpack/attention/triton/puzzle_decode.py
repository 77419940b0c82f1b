"""Triton split-K attention over one PuzzleKV layer: dense sink/tail tokens and factorized pages.

One launch per layer covers every KV head (grid axis 0) and splits the sequence (grid axis 1) into
chunks of factorized pages — of the store's main and recent page sets, each read in place — and
chunks of dense tokens (flash-decoding); grid axis 2 takes the query rows in blocks of ``BM`` (one
block for a decode step's GQA group; a prefill chunk over the stored history has more). Each
program keeps an online-softmax state for its block of query rows and writes ``(m, l, o)``; the
split-merge kernel then merges the splits by log-sum-exp (``puzzle_op.puzzle_partial`` returns the
merged state).

A factorized page's logits are ``(q R_Kᵀ) L_Kᵀ`` and its output is accumulated as ``(p L_V) R_V``:
the dense ``K̂``/``V̂`` of a page never exist in global memory. With pre-RoPE keys the page's keys
are rebuilt in registers as two halves ``K₁ = L R[:, :d/2]``, ``K₂ = L R[:, d/2:]`` and rotated
(``rotate_half`` convention) before meeting the query. INT4 factors (packed nibbles, code − 8 times
an fp16 scale: column-wise for L_K, R_K, R_V, row-wise for L_V) are dequantized on load.

Numerics: fp32 accumulation throughout; inputs may be fp32/bf16/fp16. Tiles are padded to powers
of two (>= 16, as ``tl.dot`` needs) and masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import dot, online_softmax_step, rotated_scores, store_split_state


@triton.jit
def _load_factor(ptr, base, rows, cols, row_stride, offs_r, offs_c, INT4: tl.constexpr, s_ptr, s_base,
                 s_row_stride, s_col_stride):
    """A ``[len(offs_r), len(offs_c)]`` fp32 tile of a factor matrix (rows x cols valid)."""
    mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
    if INT4:
        byte = tl.load(ptr + base + offs_r[:, None] * row_stride + offs_c[None, :] // 2, mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((offs_c[None, :] % 2) * 4)) & 0xF
        scale = tl.load(s_ptr + s_base + offs_r[:, None] * s_row_stride + offs_c[None, :] * s_col_stride,
                        mask=mask, other=0.0).to(tl.float32)
        return tl.where(mask, (code - 8).to(tl.float32) * scale, 0.0)
    return tl.load(ptr + base + offs_r[:, None] * row_stride + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_dense(sink_ptr, tail_ptr, h, tt, tm, TS, T, D, offs_d):
    """fp32 rows ``tt`` of the dense tokens: the sink ``[H, TS, D]`` followed by the tail
    ``[H, T - TS, D]``, each read where it lives (no concatenated copy)."""
    col = offs_d[None, :] < D
    in_sink = tm & (tt < TS)
    in_tail = tm & (tt >= TS)
    a = tl.load(sink_ptr + (h * TS + tt)[:, None] * D + offs_d[None, :], mask=in_sink[:, None] & col, other=0.0)
    b = tl.load(tail_ptr + (h * (T - TS) + tt - TS)[:, None] * D + offs_d[None, :], mask=in_tail[:, None] & col,
                other=0.0)
    return a.to(tl.float32) + b.to(tl.float32)


@triton.jit
def _query_halves(q_ptr, h, M, D, offs_m, mask_m, offs_h):
    """The two halves ``[BM, BDH]`` fp32 of a block of query rows (for keys rotated by RoPE)."""
    HALF = D // 2
    mask = mask_m[:, None] & (offs_h[None, :] < HALF)
    q1 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + HALF + offs_h[None, :], mask=mask, other=0.0)
    return q1, q2.to(tl.float32)


@triton.jit
def _dense_tokens(q, m_i, l_i, acc, h, t_lo, t_hi, sk_ptr, sv_ptr, tk_ptr, tv_ptr, TS, T, D, scaling, mask_m, offs_d,
                  BT: tl.constexpr):
    """Fold the dense tokens ``[t_lo, t_hi)`` (sink, then tail, read in place) into the
    online-softmax state, ``BT`` at a time."""
    offs_t = tl.arange(0, BT)
    for t0 in range(t_lo, t_hi, BT):
        tt = t0 + offs_t
        tm = tt < t_hi
        k = _load_dense(sk_ptr, tk_ptr, h, tt, tm, TS, T, D, offs_d)
        v = _load_dense(sv_ptr, tv_ptr, h, tt, tm, TS, T, D, offs_d)
        scores = dot(q, tl.trans(k)) * scaling
        scores = tl.where(mask_m[:, None] & tm[None, :], scores, float("-inf"))
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        acc = acc * alpha[:, None] + dot(p, v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _factor_pages(q, q1, q2, m_i, l_i, acc, h, NS, n_lo, n_hi, pos_first,
                  lk_ptr, rk_ptr, lv_ptr, rv_ptr, lks_ptr, rks_ptr, lvs_ptr, rvs_ptr, cos_ptr, sin_ptr,
                  P, RK, RV, D, W, scaling, mask_m, offs_p, offs_rk, offs_rv, offs_d, offs_h,
                  INT4: tl.constexpr, PRE_ROPE: tl.constexpr, SAME_HALVES: tl.constexpr):
    """Fold pages ``[n_lo, n_hi)`` of one factor set (``NS`` pages per head; its page ``n`` starts at
    position ``pos_first + n * P``) into the online-softmax state ``(m_i, l_i, acc)``."""
    HALF = D // 2
    if INT4:
        rk_cols = (RK + 1) // 2
        rv_cols = (RV + 1) // 2
        d_cols = (D + 1) // 2
    else:
        rk_cols = RK
        rv_cols = RV
        d_cols = D
    for n in range(n_lo, n_hi):
        page = h * NS + n
        lk = _load_factor(lk_ptr, page * P * rk_cols, P, RK, rk_cols, offs_p, offs_rk, INT4,
                          lks_ptr, page * RK, 0, 1)
        if PRE_ROPE:
            rk1 = _load_factor(rk_ptr, page * RK * d_cols, RK, HALF, d_cols, offs_rk, offs_h, INT4,
                               rks_ptr, page * D, 0, 1)
            # The second half starts at column HALF (a whole byte when packed: D is even).
            rk2 = _load_factor(rk_ptr, page * RK * d_cols + (HALF // 2 if INT4 else HALF), RK, HALF, d_cols,
                               offs_rk, offs_h, INT4, rks_ptr, page * D + HALF, 0, 1)
            k1 = dot(lk, rk1)  # [BP, BDH]
            k2 = dot(lk, rk2)
            scores = rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos_first + n * P + offs_p, offs_p < P,
                                    offs_h, HALF, W, SAME_HALVES)
        else:
            rk = _load_factor(rk_ptr, page * RK * d_cols, RK, D, d_cols, offs_rk, offs_d, INT4,
                              rks_ptr, page * D, 0, 1)
            scores = dot(dot(q, tl.trans(rk)), tl.trans(lk))  # (q R_Kᵀ) L_Kᵀ: [BM, BP]
        scores = scores * scaling
        scores = tl.where(mask_m[:, None] & (offs_p[None, :] < P), scores, float("-inf"))
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        lv = _load_factor(lv_ptr, page * P * rv_cols, P, RV, rv_cols, offs_p, offs_rv, INT4,
                          lvs_ptr, page * P, 1, 0)
        rv = _load_factor(rv_ptr, page * RV * d_cols, RV, D, d_cols, offs_rv, offs_d, INT4,
                          rvs_ptr, page * D, 0, 1)
        acc = acc * alpha[:, None] + dot(dot(p, lv), rv)  # (p L_V) R_V in rank space first
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def puzzle_split_kernel(
    q_ptr, lk_ptr, rk_ptr, lv_ptr, rv_ptr, lks_ptr, rks_ptr, lvs_ptr, rvs_ptr,
    lk2_ptr, rk2_ptr, lv2_ptr, rv2_ptr, lks2_ptr, rks2_ptr, lvs2_ptr, rvs2_ptr, cos_ptr, sin_ptr,
    sk_ptr, sv_ptr, tk_ptr, tv_ptr, m_ptr, l_ptr, o_ptr,
    M, N, N2, P, RK, RV, D, TS, T, scaling, pos0, W,
    pages_per_split, tokens_per_split, n_main_splits, n_page_splits, n_splits,
    INT4: tl.constexpr, PRE_ROPE: tl.constexpr, SAME_HALVES: tl.constexpr,
    BM: tl.constexpr, BP: tl.constexpr, BRK: tl.constexpr, BRV: tl.constexpr, BD: tl.constexpr,
    BDH: tl.constexpr, BT: tl.constexpr,
):
    """Grid ``(kv_heads, n_splits, row blocks)``: splits of the main pages, then of the recent pages,
    then of the dense tokens. Layouts (contiguous):

    q ``[H, M, D]`` fp32; main factor set, float: lk ``[H, N, P, RK]``, rk ``[H, N, RK, D]``, lv
    ``[H, N, P, RV]``, rv ``[H, N, RV, D]`` — or INT4 packed along the last axis (``ceil(cols / 2)``
    bytes) with scales lks ``[H, N, 1, RK]``, rks ``[H, N, 1, D]``, lvs ``[H, N, P, 1]``, rvs
    ``[H, N, 1, D]``; the recent set (``*2``) the same with ``N2`` pages, which follow the main ones
    (an empty set is passed as the other set's tensors, so both sets' pointers have one type);
    cos/sin: the shared RoPE tables ``[positions, W]`` (PRE_ROPE; page ``n`` starts at position
    ``pos0 + n * P``); dense tokens: sink keys/values ``[H, TS, D]`` then tail ``[H, T - TS, D]``,
    read in place; outputs m, l ``[H, n_splits, M]``, o ``[H, n_splits, M, D]`` fp32.
    """
    h = tl.program_id(0)
    s = tl.program_id(1)
    # Axis 2: blocks of BM query rows (a prefill chunk over the stored history has many).
    offs_m = tl.program_id(2) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask_m = offs_m < M
    q = tl.load(q_ptr + h * M * D + offs_m[:, None] * D + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    offs_p = tl.arange(0, BP)
    offs_rk = tl.arange(0, BRK)
    offs_rv = tl.arange(0, BRV)
    offs_h = tl.arange(0, BDH)
    q1, q2 = _query_halves(q_ptr, h, M, D, offs_m, mask_m, offs_h)  # for pre-RoPE keys (unused otherwise)
    # A split reads one page set; choose its pointers once (one page loop for both sets, so the
    # software pipeline's shared-memory buffers exist once).
    if s < n_main_splits:
        n_set, n_lo, pos_first = N, s * pages_per_split, pos0
        f_lk, f_rk, f_lv, f_rv = lk_ptr, rk_ptr, lv_ptr, rv_ptr
        f_lks, f_rks, f_lvs, f_rvs = lks_ptr, rks_ptr, lvs_ptr, rvs_ptr
    else:
        n_set, n_lo, pos_first = N2, (s - n_main_splits) * pages_per_split, pos0 + N * P
        f_lk, f_rk, f_lv, f_rv = lk2_ptr, rk2_ptr, lv2_ptr, rv2_ptr
        f_lks, f_rks, f_lvs, f_rvs = lks2_ptr, rks2_ptr, lvs2_ptr, rvs2_ptr
    if s < n_page_splits:
        m_i, l_i, acc = _factor_pages(q, q1, q2, m_i, l_i, acc, h, n_set, n_lo,
                                      tl.minimum(n_lo + pages_per_split, n_set), pos_first,
                                      f_lk, f_rk, f_lv, f_rv, f_lks, f_rks, f_lvs, f_rvs, cos_ptr, sin_ptr,
                                      P, RK, RV, D, W, scaling, mask_m, offs_p, offs_rk, offs_rv, offs_d, offs_h,
                                      INT4, PRE_ROPE, SAME_HALVES)
    else:
        t_lo = (s - n_page_splits) * tokens_per_split
        m_i, l_i, acc = _dense_tokens(q, m_i, l_i, acc, h, t_lo, tl.minimum(t_lo + tokens_per_split, T),
                                      sk_ptr, sv_ptr, tk_ptr, tv_ptr, TS, T, D, scaling, mask_m, offs_d, BT)
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, acc, offs_m, offs_d, 0, D)
