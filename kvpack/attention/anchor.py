"""Attention over an AnchorKV layer, tile by tile (AnchorKV §2, decode path).

Each tile of ``tile`` prompt positions has its keys reconstructed from anchors, coefficients,
anchor indices and the tile's 2-bit residuals and rotated by RoPE at their positions
(``AnchorStore.tile_keys``); the values are never reconstructed: the weighted sum over the tile
is taken on the stored form (``AnchorStore.tile_value_sum``: probabilities scattered into anchor
bins, residuals summed in the codec's rotated domain). Only one tile of keys is ever
materialised, so the transient memory is ``O(tile)``, not ``O(S)``.
"""

from __future__ import annotations

import torch

from .softmax_merge import PartialAttention, state_from_logits


def anchor_tile_partials(store, qg, scaling: float) -> list[PartialAttention]:
    """Partial states of grouped queries ``[kv_heads, rows, d]`` (fp32) over the store's compressed segments."""
    anchors_k = store.anchors["anchor_k"].float()  # converted once per call, not per tile
    anchors_v = store.anchors["anchor_v"].float()
    q = qg.float()
    states = []
    for segment, lo, hi in store.tiles():
        k = store.tile_keys(segment, lo, hi, anchors_k)
        s = torch.einsum("hid,htd->hit", q, k) * scaling
        states.append(state_from_logits(
            s, lambda p, seg=segment, a=lo, b=hi: store.tile_value_sum(seg, a, b, p, anchors_v)))
    return states
