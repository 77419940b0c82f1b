"""Triton kernel of ``kvpack::pca_quant_attention``: grouped queries over blocks coded in each KV head's
principal-component basis (layouts in ``kvpack.attention.pca_blocks``), split over the blocks.

Per program (KV head ``h``, split ``s``, rows ``offs_m``), per block ``b`` of ``G`` tokens:

* the key codes of the head's coded components are read as a ``[BT, BC]`` tile (token, component): code
  ``(t, j)`` of a width-``w_j`` stream sits at bit ``start_j + t · w_j`` of the block's run (the streams
  are component-major), read from a 16-bit window (a code of at most 8 bits spans at most two bytes);
  ``start_j`` and ``w_j`` per component come from the launcher (:func:`component_tables`);
* coefficients ``code · scale + zero``, keys ``mean + C @ basis`` (two ``tl.dot``, one per RoPE half),
  scored with RoPE at their positions where the basis is pre-RoPE (``ROPE`` 1), at their block's first
  position where it is block-relative (2);
* values stay in the basis: ``acc [BM, BCv] += (P @ codes) · scale + (Σ_t P) · zero``, and at the end
  ``o = acc @ basis_v + l · mean_v``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pca_blocks import pca_quant_attention
from ._common import dot, online_softmax_step, rotated_scores, store_split_state
from ._launch import ROW_BLOCK, kernel_arg, launch, pow2, row_blocks, split_state_buffers
from .split_merge import merge_splits


@triton.jit
def _codes(codes_ptr, row, start_ptr, width_ptr, sh, D, G, offs_t, offs_c, n_cols):
    """Codes ``[BT, BC]`` fp32 of (side, head) ``sh``'s components ``offs_c`` for tokens ``offs_t`` of the
    block whose run of bytes starts at ``codes_ptr + row``; 0 outside ``n_cols`` / ``G``."""
    cm = offs_c < n_cols
    w = tl.load(width_ptr + sh * D + offs_c, mask=cm, other=0)
    start = tl.load(start_ptr + sh * D + offs_c, mask=cm, other=0)
    bit = start[None, :] + offs_t[:, None] * w[None, :]  # [BT, BC]
    ok = cm[None, :] & (offs_t[:, None] < G)
    byte = bit >> 3
    lo = tl.load(codes_ptr + row + byte, mask=ok, other=0).to(tl.int32)
    # the byte after a code's first one is read only where the code reaches into it (never past the run)
    reach = ok & (((bit & 7) + w[None, :]) > 8)
    hi = tl.load(codes_ptr + row + byte + 1, mask=reach, other=0).to(tl.int32)
    word = lo | (hi << 8)
    return ((word >> (bit & 7)) & ((1 << w[None, :]) - 1)).to(tl.float32)


@triton.jit
def pca_quant_split_kernel(
    q_ptr, codes_ptr, scale_ptr, zero_ptr, basis_ptr, mean_ptr, start_ptr, width_ptr, head_ptr, cos_ptr, sin_ptr,
    m_ptr, l_ptr, o_ptr,
    H, M, D, G, R, C, NB, scaling, first_position, W, blocks_per_split, n_splits,
    ROPE: tl.constexpr, SAME_HALVES: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BD: tl.constexpr, BDH: tl.constexpr,
):
    """Grid ``(H, n_splits, row blocks)``. ``head_ptr [2H, 3]`` int32: per (side, head) its coded count,
    first column (of scale/zero/basis) and first byte (of a block's row); ``start_ptr, width_ptr
    [2H, D]`` int32: per component its stream's first bit within the (side, head)'s run and its width.
    Writes the split's state to ``m, l [H, n_splits, M]``, ``o [H, n_splits, M, D]``."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.program_id(2) * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_t = tl.arange(0, BT)
    offs_c = tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BDH)
    HALF = D // 2
    ck = tl.load(head_ptr + h * 3)
    kcol = tl.load(head_ptr + h * 3 + 1)
    kbyte = tl.load(head_ptr + h * 3 + 2)
    cv = tl.load(head_ptr + (H + h) * 3)
    vcol = tl.load(head_ptr + (H + h) * 3 + 1)
    vbyte = tl.load(head_ptr + (H + h) * 3 + 2)
    kc_mask = offs_c < ck
    vc_mask = offs_c < cv
    # the head's key basis rows by RoPE half [BC, BDH], its value basis rows [BC, BD], the means
    hm = offs_h < HALF
    kb1 = tl.load(basis_ptr + (kcol + offs_c[:, None]) * D + offs_h[None, :], mask=kc_mask[:, None] & hm[None, :],
                  other=0.0).to(tl.float32)
    kb2 = tl.load(basis_ptr + (kcol + offs_c[:, None]) * D + HALF + offs_h[None, :],
                  mask=kc_mask[:, None] & hm[None, :], other=0.0).to(tl.float32)
    vb = tl.load(basis_ptr + (vcol + offs_c[:, None]) * D + offs_d[None, :],
                 mask=vc_mask[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    mk1 = tl.load(mean_ptr + h * D + offs_h, mask=hm, other=0.0)
    mk2 = tl.load(mean_ptr + h * D + HALF + offs_h, mask=hm, other=0.0)
    mv = tl.load(mean_ptr + (H + h) * D + offs_d, mask=offs_d < D, other=0.0)
    qrow = q_ptr + (h * M + offs_m[:, None]) * D
    q1 = tl.load(qrow + offs_h[None, :], mask=mask_m[:, None] & hm[None, :], other=0.0)
    q2 = tl.load(qrow + HALF + offs_h[None, :], mask=mask_m[:, None] & hm[None, :], other=0.0)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BC], tl.float32)
    b0 = s * blocks_per_split
    b1 = tl.minimum(NB, b0 + blocks_per_split)
    for b in range(b0, b1):
        row = b * R
        tmask = offs_t < G
        # keys
        kcode = _codes(codes_ptr, row + kbyte, start_ptr, width_ptr, h, D, G, offs_t, offs_c, ck)
        ks = tl.load(scale_ptr + b * C + kcol + offs_c, mask=kc_mask, other=0.0).to(tl.float32)
        kz = tl.load(zero_ptr + b * C + kcol + offs_c, mask=kc_mask, other=0.0).to(tl.float32)
        coef = tl.where(kc_mask[None, :] & tmask[:, None], kcode * ks[None, :] + kz[None, :], 0.0)
        k1 = dot(coef, kb1) + mk1[None, :]
        k2 = dot(coef, kb2) + mk2[None, :]
        if ROPE != 0:
            pos = first_position + b * G + (offs_t if ROPE == 1 else offs_t * 0)
            scores = rotated_scores(q1, q2, k1, k2, cos_ptr, sin_ptr, pos, tmask, offs_h, HALF, W, SAME_HALVES)
        else:
            scores = dot(q1, tl.trans(k1)) + dot(q2, tl.trans(k2))
        scores = tl.where(tmask[None, :], scores * scaling, float("-inf"))
        m_i, l_i, alpha, p = online_softmax_step(m_i, l_i, scores)
        # values, in the basis: sum_t p_t c_tj = scale_j (P @ codes)_j + zero_j sum_t p_t
        vcode = _codes(codes_ptr, row + vbyte, start_ptr, width_ptr, H + h, D, G, offs_t, offs_c, cv)
        vs = tl.load(scale_ptr + b * C + vcol + offs_c, mask=vc_mask, other=0.0).to(tl.float32)
        vz = tl.load(zero_ptr + b * C + vcol + offs_c, mask=vc_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + dot(p, vcode) * vs[None, :] + tl.sum(p, axis=1)[:, None] * vz[None, :]
    out = dot(acc, vb) + l_i[:, None] * mv[None, :]  # [BM, BD]
    store_split_state(m_ptr, l_ptr, o_ptr, h, s, n_splits, M, D, m_i, l_i, out, offs_m, offs_d, 0, D)


def component_tables(widths: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout the kernel reads, from ``widths [2, H, d]`` (non-increasing per (side, head)), on their
    device: ``heads [2H, 3]`` int32 (coded count, first column, first byte of each (side, head)), ``start,
    width [2H, d]`` int32 (each component's stream's first bit within its (side, head)'s run of a block, and
    its width). The streams are component-major and widest first, so component ``j`` starts after the
    ``block`` codes of every component before it: ``block · Σ_{i<j} w_i`` bits.

    Raises:
        ValueError: widths that increase along a component axis (codes would not be grouped).
    """
    w = widths.reshape(-1, widths.shape[-1]).to(torch.int64)  # [2H, d]
    if bool((w[:, 1:] > w[:, :-1]).any()):
        raise ValueError(f"pca blocks: component widths must be non-increasing, got {w.tolist()}")
    start = block * (torch.cumsum(w, dim=1) - w)
    count = (w > 0).sum(dim=1)
    run_bytes = block * w.sum(dim=1) // 8
    heads = torch.stack([count, torch.cumsum(count, 0) - count, torch.cumsum(run_bytes, 0) - run_bytes], dim=1)
    return heads.to(torch.int32), start.to(torch.int32), w.to(torch.int32)


def triton_pca_quant_attention(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                                basis: torch.Tensor, mean: torch.Tensor, widths: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, skip: torch.Tensor, block: int, rope: int, first_position: int,
                                scaling: float,
                                blocks_per_split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel of ``kvpack::pca_quant_attention`` (its contract and layouts:
    ``kvpack.attention.pca_blocks``, which declares the op without importing Triton). Tokens left out (``skip``)
    are not supported here: a store on this path takes its exact copies' place by subtracting their ghosts."""
    if skip.numel():
        raise NotImplementedError("the Triton pca_quant kernel does not leave tokens out (skip); the store corrects "
                                  "for its salient tokens' ghosts instead")
    H, M, D = q.shape
    NB = codes.shape[0]
    heads, start, width = component_tables(widths, block)
    n_splits = max(1, -(-NB // blocks_per_split))
    m, l, o = split_state_buffers(H, M, D, n_splits, q.device)
    if not rope:
        cos = sin = q.new_zeros(1)
    W = cos.shape[-1] if rope else D
    launch(pca_quant_split_kernel, (H, n_splits, row_blocks(M)),
           q.float().contiguous(), kernel_arg(codes), kernel_arg(scale), kernel_arg(zero), kernel_arg(basis),
           kernel_arg(mean), start, width, heads, kernel_arg(cos), kernel_arg(sin), m, l, o,
           H, M, D, block, codes.shape[1], scale.shape[1], NB, scaling, first_position, W, blocks_per_split, n_splits,
           ROPE=rope, SAME_HALVES=W != D, BM=ROW_BLOCK, BT=pow2(block), BC=pow2(D), BD=pow2(D),
           BDH=pow2(D // 2))
    return merge_splits(m, l, o)


pca_quant_attention.register_kernel("cuda")(triton_pca_quant_attention)
