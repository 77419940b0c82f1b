"""Attention over an AnchorKV layer, tile by tile (AnchorKV §2, decode path).

Each tile of ``tile`` prompt positions is reconstructed from anchors, coefficients, anchor indices
and the tile's 2-bit residuals (``AnchorStore.reconstruct_tile``), keys rotated by RoPE at their
positions, and reduced to a partial softmax state; only one tile is ever materialised, so the
transient memory is ``O(tile)``, not ``O(S)``.
"""

from __future__ import annotations

from .softmax_merge import PartialAttention, dense_partial


def anchor_tile_partials(store, qg, scaling: float) -> list[PartialAttention]:
    """Partial states of grouped queries ``[kv_heads, rows, d]`` over the store's compressed segments."""
    states = []
    for segment, lo, hi in store.tiles():
        k, v = store.reconstruct_tile(segment, lo, hi)
        states.append(dense_partial(qg, k, v, scaling))
    return states
