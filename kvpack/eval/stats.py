"""Uncertainty of evaluation scores: 95% intervals and a paired test against FullKV.

* :func:`wilson_interval` — a proportion's interval (Wilson score, 1927): right at 0 and 1 and for
  the 8–20 samples a cell has, where the normal approximation is not.
* :func:`bootstrap_interval` — a percentile bootstrap of a statistic over samples (seeded), for
  averages of partial-credit scores and for ratios (retention).
* :func:`mcnemar_exact` — the exact (binomial) McNemar test on paired binary outcomes: whether a
  method answers a different set of samples than FullKV does, counting only the samples on which
  the two disagree.

All functions are pure and deterministic (the bootstrap draws from its own seeded generator).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOTSTRAP_RESAMPLES = 2000


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n`` (``(nan, nan)`` when ``n`` is 0)."""
    if n == 0:
        return math.nan, math.nan
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(samples: Sequence, statistic: Callable[[Sequence], float | None],
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over ``samples`` (resampled with replacement;
    resamples on which the statistic is undefined — None — are skipped)."""
    if not samples:
        return math.nan, math.nan
    rng = random.Random(seed)
    n = len(samples)
    values = []
    for _ in range(resamples):
        value = statistic([samples[rng.randrange(n)] for _ in range(n)])
        if value is not None:
            values.append(value)
    if not values:
        return math.nan, math.nan
    values.sort()
    lo = values[int(math.floor((1 - level) / 2 * (len(values) - 1)))]
    hi = values[int(math.ceil((1 + level) / 2 * (len(values) - 1)))]
    return lo, hi


def mcnemar_exact(reference: Sequence[bool], method: Sequence[bool]) -> dict:
    """Exact two-sided McNemar test of paired binary outcomes.

    Returns:
        ``{"only_reference": b, "only_method": c, "p_value": p}``: ``b`` samples only the
        reference answers, ``c`` only the method; ``p = min(1, 2 · P(X ≤ min(b, c)))`` with
        ``X ~ Binomial(b + c, 1/2)`` (1.0 when they never disagree).
    """
    if len(reference) != len(method):
        raise ValueError(f"paired outcomes must have the same length, got {len(reference)} and {len(method)}")
    b = sum(1 for r, m in zip(reference, method) if r and not m)
    c = sum(1 for r, m in zip(reference, method) if m and not r)
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n if n else 1.0
    return {"only_reference": b, "only_method": c, "p_value": min(1.0, 2 * tail)}
