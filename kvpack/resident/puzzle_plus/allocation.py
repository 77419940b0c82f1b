"""Greedy water-filling of page ranks under one byte budget (pure functions).

Each (layer, KV head, page, side) entry offers rank *steps* (``rank_step`` ranks each), step ``j``
with a marginal gain per byte ``g_j`` — the retained energy it adds (its squared singular values,
scaled, see ``store.py``) over its bytes — non-increasing in ``j``. Taking steps in decreasing
order of ``g`` across every entry until the budget is spent is the same as taking, in each entry,
the steps with ``g_j ≥ t`` for one threshold ``t`` (the "water level"): an entry keeps
``clamp(#{j : g_j ≥ t}, floor, cap)`` steps. :func:`fit_threshold` finds the lowest such ``t``
(the most ranks) whose bytes fit, by bisection over the offered gains — exact bytes, whatever the
per-entry costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class RankRequest:
    """One store's pages awaiting ranks in a round.

    Attributes:
        gains: ``[E, S]`` marginal gain per byte of each of the entries' ``S`` rank steps
            (non-increasing along a row).
        floor_steps, cap_steps: each entry keeps at least / at most this many steps.
        projected_bytes: the store's bytes at the end of the coming page cycle if its entries keep
            ``steps [E]`` (the most it will hold before its next round).
        projected_dense_bytes: the same tokens' dense bf16 bytes at that point.
    """

    gains: torch.Tensor
    floor_steps: int
    cap_steps: int
    projected_bytes: Callable[[torch.Tensor], int]
    projected_dense_bytes: int

    def steps_at(self, threshold: float) -> torch.Tensor:
        """``[E]`` int64 steps each entry keeps at water level ``threshold``."""
        taken = (self.gains >= threshold).sum(dim=-1)
        return taken.clamp(self.floor_steps, self.cap_steps)


@dataclass(frozen=True)
class Fit:
    """The outcome of :func:`fit_threshold`: the water level, whether its bytes fit, and the bytes."""

    threshold: float
    fits: bool
    total_bytes: int
    allowance: float


def total_bytes(requests: list[RankRequest], threshold: float) -> int:
    return sum(r.projected_bytes(r.steps_at(threshold)) for r in requests)


def fit_threshold(requests: list[RankRequest], budget: float, minimum: float = 0.0) -> Fit:
    """The lowest water level ``t ≥ minimum`` (among the offered gains) whose projected bytes are
    ≤ ``budget`` × the projected dense bytes.

    ``fits`` is False when even the floor ranks (``t = ∞``) exceed the allowance; ``t`` is then ∞.
    Zero gains are never bought (a step that retains nothing is not worth a byte).
    """
    return fit_allowance(requests, budget * sum(r.projected_dense_bytes for r in requests), minimum)


def fit_allowance(requests: list[RankRequest], allowance: float, minimum: float = 0.0) -> Fit:
    """:func:`fit_threshold` for an allowance in bytes: the lowest level ``t ≥ minimum`` whose projected bytes
    are ≤ ``allowance``."""
    offered = torch.cat([r.gains.reshape(-1) for r in requests]) if requests else torch.empty(0)
    levels = torch.unique(offered[(offered > 0) & (offered >= minimum)].double(), sorted=True).flip(0).tolist()
    # levels[k] descending; bytes(levels[k]) is non-decreasing in k. Find the largest k that fits
    # (k = -1: floor ranks only, t = ∞).
    lo, hi = -1, len(levels) - 1
    at = lambda k: math.inf if k < 0 else levels[k]  # noqa: E731
    floor_bytes = total_bytes(requests, math.inf)
    if floor_bytes > allowance:
        return Fit(math.inf, False, floor_bytes, allowance)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total_bytes(requests, at(mid)) <= allowance:
            lo = mid
        else:
            hi = mid - 1
    return Fit(at(lo), True, total_bytes(requests, at(lo)), allowance)
