"""kvtc's bit allocation: dynamic programming over groups of consecutive PCA components.

Given the squared error that coding each group of components at each width would cause (measured on
calibration data), choose a partition of the first ``r`` components into groups and a width per
group that minimises the total error under a bit budget per token. A group of ``g`` components at
``w > 0`` bits costs ``w·g`` payload bits plus a 16-bit shift and a 16-bit scale; ``w = 0`` drops the
group and costs nothing. Group sizes come from ``{1, 16, 64, 256, 1024}``, widths from 0..8.

Groups are aligned: a group of size ``g`` starts at a multiple of ``g`` (as microscaling blocks do).
That makes every group's error a fixed number that can be measured once, so the DP is exact over
that search space: ``err[i][b]`` = least error of the first ``i`` components using at most ``b``
bits, ``err[i][b] = min_{g | i, w} err[i-g][b - cost(g, w)] + E(i-g, g, w)``, with back-pointers.
Cost O(r · budget · options) time, O(r · budget) bytes of back-pointers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .group_quant import group_squared_errors

GROUP_SIZES = (1, 16, 64, 256, 1024)
WIDTHS = tuple(range(9))  # 0 (dropped) .. 8 bits
GROUP_OVERHEAD_BITS = 32  # 16-bit shift + 16-bit scale per coded group


@dataclass(frozen=True)
class Allocation:
    """Widths for the first ``n_components`` PCA components, as consecutive groups.

    Attributes:
        groups: ``((start, size, width), ...)`` in order, covering ``[0, n_components)``.
        budget_bits: the per-token bit budget it was solved for.
        used_bits: payload + shift/scale bits per token it actually uses (<= budget_bits).
        error: expected squared error per token over the first ``n_components`` (calibration data).
    """

    groups: tuple[tuple[int, int, int], ...]
    budget_bits: int
    used_bits: int
    error: float

    @property
    def n_components(self) -> int:
        return sum(size for _, size, _ in self.groups)

    @property
    def coded_extent(self) -> int:
        """Components up to the end of the last coded group (the rest decode as 0 and need no basis)."""
        return max((start + size for start, size, width in self.groups if width), default=0)

    def widths(self) -> np.ndarray:
        """Width of each component, ``[n_components]`` int."""
        out = np.zeros(self.n_components, dtype=np.int64)
        for start, size, width in self.groups:
            out[start:start + size] = width
        return out

    def coded_groups(self) -> list[tuple[int, int, int]]:
        """The groups with a nonzero width (the ones that are stored)."""
        return [g for g in self.groups if g[2] > 0]

    def to_dict(self) -> dict:
        return {"groups": [list(g) for g in self.groups], "budget_bits": self.budget_bits,
                "used_bits": self.used_bits, "error": self.error}

    @classmethod
    def from_dict(cls, data: dict) -> Allocation:
        groups = tuple(tuple(int(v) for v in g) for g in data["groups"])
        alloc = cls(groups=groups, budget_bits=int(data["budget_bits"]), used_bits=int(data["used_bits"]),
                    error=float(data["error"]))
        alloc.check()
        return alloc

    def check(self) -> None:
        """Raise ``ValueError`` unless the groups tile ``[0, n)`` with valid sizes/widths within budget."""
        pos = 0
        used = 0
        for start, size, width in self.groups:
            if start != pos or size < 1 or not 0 <= width <= 8:
                raise ValueError(f"invalid allocation group {(start, size, width)} at component {pos}")
            pos += size
            used += group_cost(size, width)
        if used != self.used_bits or used > self.budget_bits:
            raise ValueError(f"allocation uses {used} bits, records {self.used_bits}, budget {self.budget_bits}")


def group_cost(size: int, width: int, overhead: int = GROUP_OVERHEAD_BITS) -> int:
    """Bits per token of one group: payload plus shift/scale (nothing for a dropped group)."""
    return width * size + (overhead if width else 0)


def aligned_group_errors(coeffs: torch.Tensor, sizes=GROUP_SIZES, widths=WIDTHS) -> dict[int, np.ndarray]:
    """Mean squared error per token of coding every aligned group at every width.

    Args:
        coeffs: ``[n, r]`` PCA coefficients of ``n`` calibration tokens.

    Returns:
        ``{size: errors [r // size, len(widths)]}`` (fp64), errors averaged over the ``n`` tokens.
    """
    n, r = coeffs.shape
    out: dict[int, np.ndarray] = {}
    for size in sizes:
        n_groups = r // size
        if n_groups == 0:
            continue
        grouped = coeffs[:, : n_groups * size].reshape(n, n_groups, size)
        table = np.empty((n_groups, len(widths)))
        for j, width in enumerate(widths):
            table[:, j] = (group_squared_errors(grouped, width).sum(0) / n).numpy()
        out[size] = table
    return out


def allocate_bits(errors: dict[int, np.ndarray], n_components: int, budget_bits: int, widths=WIDTHS,
                  overhead: int = GROUP_OVERHEAD_BITS) -> Allocation:
    """Least-error partition of ``n_components`` components into aligned groups with widths.

    Args:
        errors: :func:`aligned_group_errors` output (its widths in the order of ``widths``).
        n_components: how many leading components to allocate (``<=`` the measured ones).
        budget_bits: bits per token available for payload, shifts and scales.

    Raises:
        ValueError: non-positive budget or too few measured components.
    """
    if budget_bits < 0:
        raise ValueError(f"budget_bits must be >= 0, got {budget_bits}")
    if 1 not in errors or errors[1].shape[0] < n_components:
        raise ValueError(f"errors must cover {n_components} components with groups of size 1")
    B = int(budget_bits)
    options = [(size, j, group_cost(size, w, overhead)) for size in sorted(errors) for j, w in enumerate(widths)
               if group_cost(size, w, overhead) <= B]
    if len(options) > 127:
        raise ValueError("too many (size, width) options for int8 back-pointers")
    rows: dict[int, np.ndarray] = {0: np.zeros(B + 1)}
    choice = np.full((n_components + 1, B + 1), -1, dtype=np.int8)
    larger = [s for s in errors if s > 1]
    keep_every = min(larger, default=n_components + 1)
    if any(s % keep_every for s in larger):
        keep_every = 1  # sizes not nested: keep every row
    for i in range(1, n_components + 1):
        row = np.full(B + 1, np.inf)
        ch = choice[i]
        for k, (size, j, cost) in enumerate(options):
            if i % size or i < size:
                continue
            prev = rows[i - size]
            cand = np.full(B + 1, np.inf)
            cand[cost:] = prev[: B + 1 - cost] + errors[size][(i - size) // size, j]
            better = cand < row
            row[better] = cand[better]
            ch[better] = k
        rows[i] = row
        # Rows are needed again only as the start of a later group: i - 1 always, multiples of the
        # smallest size > 1 for the larger groups.
        if i - 1 > 0 and (i - 1) % keep_every:
            rows.pop(i - 1, None)
    if not np.isfinite(rows[n_components][B]):
        raise ValueError(f"no allocation of {n_components} components fits {B} bits")
    groups = []
    i, b = n_components, B
    while i > 0:
        size, j, cost = options[int(choice[i, b])]
        groups.append((i - size, size, widths[j]))
        i -= size
        b -= cost
    groups.reverse()
    merged = _merge_dropped(groups)
    used = sum(group_cost(s, w, overhead) for _, s, w in merged)
    return Allocation(groups=tuple(merged), budget_bits=B, used_bits=used, error=float(rows[n_components][B]))


def _merge_dropped(groups: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join neighbouring zero-width groups (they cost nothing and store nothing)."""
    out: list[tuple[int, int, int]] = []
    for start, size, width in groups:
        if width == 0 and out and out[-1][2] == 0:
            out[-1] = (out[-1][0], out[-1][1] + size, 0)
        else:
            out.append((start, size, width))
    return out
