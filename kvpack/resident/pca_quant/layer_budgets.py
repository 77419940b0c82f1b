"""Per-layer byte budgets from a measured layer profile: how much each layer's coding costs the model.

A uniform budget gives every layer the same share of the bytes, but layers are not equally sensitive:
coding one of SmolLM2's layers at 0.15 of its bytes moves the next-token distribution up to nine times
more than coding another (KL to the exact cache, the other layers exact). A *layer profile* holds that
measurement for a grid of budgets — ``kl[l][i]``, the mean KL when only layer ``l`` is coded at
``budgets[i]`` — made once per model (``kvpack calibrate --method pca_quant``, which writes
:data:`PROFILE_FILE` into a calibration directory). :meth:`LayerProfile.allocate` then spends a mean budget
where it lowers the summed KL most (each layer's KL interpolated log-linearly between the grid's
budgets; the sum minimised exactly by dynamic programming over budget steps, kvtc's allocation applied to
layers). The layers' budgets average at most the target, and every store keeps its own budget at every
decode step, so the cache keeps the target.

Assumption (measured, not proven): the layers' KLs add. On four 4K SmolLM2 samples at 0.15 the thirty
one-layer KLs (the other layers at 8 bits a component) summed to 0.041, coding them all gave 0.042.

The file is JSON (no pickle); a profile names the model it was measured on (its fingerprint), and a
method refuses a profile made for another model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...presets import unresolved_auto_calibration

PROFILE_FILE = "layer_profile.json"
PROFILE_VERSION = 1
STEP = 0.0025  # the allocation's budget step (a fortieth of a tenth of the bytes)


@dataclass(frozen=True)
class LayerProfile:
    """Attributes:
        method: the method the profile was measured with (its stores code the layers).
        fingerprint: ``kvpack.hf.fingerprint.model_fingerprint`` of the model.
        layers: the profiled layer indices (the model's full-attention layers).
        budgets: the grid of budgets, increasing.
        kl: ``[len(layers)][len(budgets)]`` mean KL(exact ‖ only this layer coded at this budget).
        settings: how it was measured (method config, chunks, tokens, continuation).
        stats: timings and the like.
    """

    method: str
    fingerprint: dict
    layers: list[int]
    budgets: list[float]
    kl: list[list[float]]
    settings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        where = f"layer profile ({self.method})"
        increasing = all(b < c for b, c in zip(self.budgets, self.budgets[1:]))
        if len(self.budgets) < 2 or any(not 0 < b <= 1 for b in self.budgets) or not increasing:
            raise ValueError(f"{where}: budgets must be two or more increasing fractions in (0, 1], "
                             f"got {self.budgets}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"{where}: layers must be distinct layer indices, got {self.layers}")
        if len(self.kl) != len(self.layers) or any(len(row) != len(self.budgets) for row in self.kl):
            raise ValueError(f"{where}: kl must be [{len(self.layers)} layers][{len(self.budgets)} budgets]")
        bad = [(self.layers[i], self.budgets[j]) for i, row in enumerate(self.kl) for j, x in enumerate(row)
               if not (isinstance(x, int | float) and math.isfinite(x) and x >= 0)]
        if bad:
            raise ValueError(f"{where}: KL values must be finite and >= 0; not at (layer, budget) {bad[:4]}")

    # -- files ----------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PROFILE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> LayerProfile:
        """Raises ValueError naming the problem: no profile there, not JSON, wrong fields or values."""
        unresolved_auto_calibration(directory)
        path = Path(directory) / PROFILE_FILE
        if not path.is_file():
            raise ValueError(f"no layer profile at {path}: make one with `kvpack calibrate --method pca_quant "
                             f"--out {directory}`")
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a layer profile (not JSON: {exc})") from None
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path} is not a version-{PROFILE_VERSION} layer profile")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{path} is not a layer profile ({exc})") from None

    def check_fingerprint(self, fingerprint: dict) -> None:
        """Refuse a model other than the profiled one."""
        if fingerprint.get("hash") != self.fingerprint.get("hash"):
            raise ValueError(
                f"the layer profile was made for another model ({self.fingerprint.get('architecture')}, "
                f"{self.fingerprint.get('layers')} layers, fingerprint {str(self.fingerprint.get('hash'))[:12]}) "
                f"than the one given ({fingerprint.get('architecture')}, {fingerprint.get('layers')} layers, "
                f"fingerprint {str(fingerprint.get('hash'))[:12]}): profile this model")

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, budget: float, layers: list[int] | None = None, step: float = STEP,
                 floor: float = 0.0) -> dict[int, float]:
        """Per-layer budgets ``{layer: budget}`` for ``layers`` (default: the profiled ones), each at least
        ``floor``, whose mean is at most ``budget`` and whose summed interpolated KL is least. A budget
        outside the grid's range cannot be priced, nor one below ``floor``: every layer gets ``budget``
        (uniform).

        Raises:
            ValueError: a layer the profile does not hold.
        """
        layers = list(self.layers) if layers is None else list(layers)
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise ValueError(f"the layer profile holds layers {self.layers}, not {missing}")
        lo, hi = self.budgets[0], self.budgets[-1]
        if not max(lo, floor) <= budget <= hi:
            return {layer: budget for layer in layers}
        n = int(math.floor((hi - lo) / step + 1e-9))  # a layer's steps above the grid's lowest budget
        grid = torch.tensor([lo + i * step for i in range(n + 1)], dtype=torch.float64)  # [n + 1]
        row = {layer: i for i, layer in enumerate(self.layers)}
        cost = torch.stack([self._interpolated(row[layer], grid) for layer in layers])  # [L, n + 1]
        cost[:, grid < floor - 1e-12] = float("inf")  # below the floor: not a choice
        total = int(math.floor(len(layers) * (budget - lo) / step + 1e-9))  # steps the layers share
        # best[u]: the least summed KL of the layers so far using exactly u steps; choice[l][u]: layer l's steps
        inf = torch.tensor(float("inf"), dtype=torch.float64)
        best = torch.full((total + 1,), float("inf"), dtype=torch.float64)
        best[: min(n, total) + 1] = cost[0, : min(n, total) + 1]
        choices = [torch.arange(total + 1).clamp(max=n)]
        for c in cost[1:]:
            u = torch.arange(total + 1)[:, None]
            k = torch.arange(n + 1)[None, :]
            prev = u - k  # [total + 1, n + 1]: the steps the earlier layers used
            options = torch.where(prev >= 0, best[prev.clamp(min=0)] + c[None, :], inf)
            best, pick = options.min(dim=1)
            choices.append(pick)
        if not torch.isfinite(best).any():  # the floor, on the step grid, leaves no choice within the budget
            return {layer: budget for layer in layers}
        u = int(torch.argmin(best))  # the fewest-KL total within the budget (spending more never hurts
        steps = []                   # on the grid, but a flat stretch may leave steps unspent)
        for pick in reversed(choices):
            k = int(pick[u])
            steps.append(k)
            u -= k
        steps.reverse()
        return {layer: lo + k * step for layer, k in zip(layers, steps)}

    def _interpolated(self, i: int, grid: torch.Tensor) -> torch.Tensor:
        """Layer row ``i``'s KL at ``grid``: log-linear between the profile's budgets (KL falls about
        exponentially as bits are added), floored at 1e-12."""
        b = torch.tensor(self.budgets, dtype=torch.float64)
        logkl = torch.tensor(self.kl[i], dtype=torch.float64).clamp_min(1e-12).log()
        j = torch.searchsorted(b, grid, right=True).clamp(1, len(b) - 1)
        t = (grid - b[j - 1]) / (b[j] - b[j - 1])
        return (logkl[j - 1] + t * (logkl[j] - logkl[j - 1])).exp()


class LayerBudgets:
    """One sequence's per-layer budgets: :meth:`LayerProfile.allocate`'s, made when the first layer codes,
    once the prompt's length is known — so that no layer gets less than a layer needs at that length for
    its dense sink and tail and no code at all (the floor; in ``generate`` the prompt arrives in chunks of
    2,048 tokens, where the profile's lowest budget is out of reach). Every layer of the sequence codes at
    that same length, the first chunk's end."""

    def __init__(self, profile: LayerProfile, budget: float, layers: list[int]):
        self.profile, self.budget, self.layers = profile, budget, layers
        self.shares: dict[int, float] | None = None

    def budget_for(self, layer: int, floor: Callable[[], float]) -> float:
        """Layer ``layer``'s budget; ``floor()``: the least budget a layer can keep at the first coding length
        (asked once, by the first layer to code, for every layer)."""
        if self.shares is None:
            self.shares = self.profile.allocate(self.budget, self.layers, floor=floor())
        return self.shares[layer]

