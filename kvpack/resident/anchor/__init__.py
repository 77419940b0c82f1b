"""AnchorKV (anchors + per-token scaled anchor copies + budgeted 2-bit residuals) as a package:
``config`` (parameters, ablations), ``budget`` (Eq. 9; past saturation: the fine tier, anchors),
``selection`` (Eq. 1, 2, 6: pure functions),
``store`` (compression, re-compression; registers ``anchor`` and ``anchor_plus``). Tile decoding
lives in :mod:`kvpack.attention.anchor`."""

from .budget import (
    anchors_above_saturation,
    anchors_for_budget,
    base_bytes,
    fine_residual_slots,
    fine_tier_bytes,
    index_bytes_for,
    residual_bytes,
    residual_slots,
    saturation_cost,
)
from .config import RANKINGS, RESIDUAL_SPLITS, AnchorConfig, AnchorPlusConfig
from .selection import (
    ASSIGN_BLOCK_ELEMENTS,
    assign_and_project,
    nearest_anchor,
    observation_weights,
    pool_neighbourhood,
    project_onto_anchors,
    select_anchors,
    top_per_head,
    top_pooled,
    utilities,
)
from .store import AnchorPlusStore, AnchorStore

__all__ = ["ASSIGN_BLOCK_ELEMENTS", "RANKINGS", "RESIDUAL_SPLITS", "AnchorConfig", "AnchorPlusConfig",
           "AnchorPlusStore", "AnchorStore", "anchors_above_saturation", "anchors_for_budget", "assign_and_project",
           "base_bytes", "fine_residual_slots", "fine_tier_bytes",
           "index_bytes_for", "nearest_anchor", "observation_weights", "pool_neighbourhood",
           "project_onto_anchors", "residual_bytes", "residual_slots", "saturation_cost", "select_anchors",
           "top_per_head", "top_pooled", "utilities"]
