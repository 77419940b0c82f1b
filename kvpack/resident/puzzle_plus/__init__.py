"""``puzzle_plus`` (beyond the paper): PuzzleKV's pages with ranks chosen per (layer, KV head, page,
side) under one byte budget for the whole cache. ``config`` (parameters), ``allocation`` (water-filling,
pure functions), ``budget`` (the cross-layer rounds), ``ragged`` (rank-bucketed storage), ``store``
(registers ``puzzle_plus``). Attention over the ragged pages lives in
:mod:`kvpack.attention.ragged_pages` and the Triton kernel ``puzzle_ragged_decode``."""

from .allocation import Fit, RankRequest, fit_threshold
from .budget import WholeCacheBudget
from .config import PuzzlePlusConfig
from .store import PuzzlePlusStore

__all__ = ["Fit", "PuzzlePlusConfig", "PuzzlePlusStore", "RankRequest", "WholeCacheBudget", "fit_threshold"]
