"""Lloyd–Max scalar quantizer for a standard Gaussian source (its codes: ``kvpack.ops.residual_codec``).

The optimal 4-level quantizer of N(0, 1) (Max, 1960) has levels ±0.4528, ±1.5104 and thresholds
0, ±0.9816; :func:`lloyd_max_gaussian` computes it by Lloyd's iteration (thresholds at midpoints,
levels at the conditional means ``(φ(a) − φ(b)) / (Φ(b) − Φ(a))``).
"""

from __future__ import annotations

import functools
import math


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@functools.lru_cache(maxsize=8)
def lloyd_max_gaussian(n_levels: int = 4, iterations: int = 500) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(levels, thresholds)`` of the MSE-optimal ``n_levels`` quantizer of N(0, 1), ascending."""
    if n_levels < 2:
        raise ValueError(f"n_levels must be >= 2, got {n_levels}")
    levels = [(i + 0.5) / n_levels * 6 - 3 for i in range(n_levels)]
    for _ in range(iterations):
        thresholds = [(a + b) / 2 for a, b in zip(levels, levels[1:])]
        edges = [-math.inf, *thresholds, math.inf]
        levels = [(_pdf(a) - _pdf(b)) / max(_cdf(b) - _cdf(a), 1e-300) for a, b in zip(edges, edges[1:])]
    thresholds = [(a + b) / 2 for a, b in zip(levels, levels[1:])]
    return tuple(levels), tuple(thresholds)
