"""The AnchorKV decode kernel as a PyTorch custom op (``kvpack::anchor_segment_attention``), plus its launcher.

:func:`anchor_partials` is what ``AnchorStore`` calls: one launch per compressed segment (one
segment unless re-compression is on), returning each segment's merged softmax state.
"""

from __future__ import annotations

import math

import torch

from ..softmax_merge import PartialAttention

_BLOCK = 32  # prefix-count block of the store's residual slots


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, n)))))


@torch.library.custom_op("kvpack::anchor_segment_attention", mutates_args=())
def anchor_segment_attention(
    q: torch.Tensor, anchor_k: torch.Tensor, anchor_v: torch.Tensor, hmat: torch.Tensor, signs: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor,
    index_k: torch.Tensor, coef_k: torch.Tensor, mask_k: torch.Tensor, prefix_k: torch.Tensor,
    res_k: torch.Tensor, scale_k: torch.Tensor,
    index_v: torch.Tensor, coef_v: torch.Tensor, mask_v: torch.Tensor, prefix_v: torch.Tensor,
    res_v: torch.Tensor, scale_v: torch.Tensor,
    levels: list[float], scaling: float, blocks_per_split: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]``
    over one AnchorKV segment of ``n = index_k.shape[1]`` tokens (layouts in
    ``anchor_decode.anchor_split_kernel``)."""
    from .anchor_decode import anchor_split_kernel

    H, M, D = q.shape
    n = index_k.shape[1]
    n_splits = math.ceil(math.ceil(n / _BLOCK) / blocks_per_split)
    dev = q.device
    m = torch.empty(H, n_splits, M, device=dev)
    l = torch.empty(H, n_splits, M, device=dev)
    o = torch.empty(H, n_splits, M, D, device=dev)
    dummy = torch.zeros(1, device=dev)

    def arg(t):
        return t.contiguous() if t.numel() else dummy

    anchor_split_kernel[(H, n_splits)](
        q.float().contiguous(), arg(anchor_k), arg(anchor_v), hmat.float().contiguous(), signs.float().contiguous(),
        cos.float().contiguous(), sin.float().contiguous(),
        arg(index_k), arg(coef_k), arg(mask_k), arg(prefix_k), arg(res_k), arg(scale_k),
        arg(index_v), arg(coef_v), arg(mask_v), arg(prefix_v), arg(res_v), arg(scale_v),
        m, l, o, M, anchor_k.shape[1], D, n, scaling, blocks_per_split, n_splits, *levels,
        BM=_pow2(M), BD=_pow2(D), BDH=_pow2(D // 2), BT=_BLOCK,
    )
    m_all = m.amax(dim=1)
    m_safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    w = torch.exp(m - m_safe[:, None])
    return m_all, (l * w).sum(1), (o * w[..., None]).sum(1)


@anchor_segment_attention.register_fake
def _(q, anchor_k, anchor_v, hmat, signs, cos, sin, index_k, coef_k, mask_k, prefix_k, res_k, scale_k,
      index_v, coef_v, mask_v, prefix_v, res_v, scale_v, levels, scaling, blocks_per_split):
    H, M, D = q.shape
    return q.new_empty(H, M, dtype=torch.float32), q.new_empty(H, M, dtype=torch.float32), \
        q.new_empty(H, M, D, dtype=torch.float32)


def anchor_partials(store, qg: torch.Tensor, scaling: float, blocks_per_split: int | None = None) -> list[PartialAttention]:
    """States of ``qg [kv_heads, rows, d]`` over every compressed segment of an ``AnchorStore``.

    Args:
        blocks_per_split: 32-token blocks per program (default: about 32 programs per KV head).
    """
    dev = qg.device
    codec = store.residual_codec  # levels, rotation matrix and signs of the store's residual codec
    states = []
    for seg, (start, n) in zip(store.segments, store.segment_spans):
        cos, sin = store.layout.rope.cos_sin(torch.arange(start, start + n, device=dev))
        bps = blocks_per_split or max(1, math.ceil(math.ceil(n / _BLOCK) / 32))
        per_side = []
        for side in ("k", "v"):
            per_side += [seg[f"{name}_{side}"] for name in ("index", "coef", "mask", "prefix", "res", "scale")]
        m, l, o = anchor_segment_attention(
            qg.float(), store.anchors["anchor_k"], store.anchors["anchor_v"], codec.matrix.to(dev),
            codec.signs.to(dev), cos, sin, *per_side, [float(x) for x in codec.levels], float(scaling), bps)
        states.append(PartialAttention(m=m, l=l, o=o))
    return states
