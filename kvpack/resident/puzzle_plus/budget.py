"""The whole-cache byte budget of ``puzzle_plus``: one allocation across every compressed layer.

A :class:`WholeCacheBudget` groups the stores of one sequence (one per compressed layer). A store
whose tail holds pages ready to factorize *submits* them; when every layer of the group has
submitted — at the end of the prefill (the live path: the last layer's first update; the harness:
after the last layer's ``load_prefill``) and whenever a page completes while decoding (every layer
completes its page on the same token) — the group runs a *round*: it asks each store for its
pages' marginal gains (:class:`RankRequest`), finds the water level (``allocation.fit_threshold``)
and lets each store factorize its pages at the ranks that level gives.

The first round's level is the threshold λ. Later rounds use λ as the floor of their level: a page
completed while decoding gets the ranks λ gives it, fewer only when the budget would otherwise be
exceeded at the end of the coming page cycle. So the bytes stay ≤ budget × dense at every step.
"""

from __future__ import annotations

from typing import Protocol

from .allocation import Fit, RankRequest, fit_threshold


class BudgetMember(Protocol):
    def rank_request(self) -> RankRequest: ...

    def commit(self, steps) -> None: ...


class WholeCacheBudget:
    """The rounds of one sequence's ``puzzle_plus`` stores.

    Args:
        layers: the layer indices of the compressed layers (one store each will join).
        budget: bytes / dense bf16 bytes of the whole group.
    """

    def __init__(self, layers: list[int], budget: float):
        if len(set(layers)) != len(layers) or not layers:
            raise ValueError(f"a budget group needs distinct layer indices, got {layers}")
        self.layers = list(layers)
        self.budget = budget
        self.members: dict[int, BudgetMember] = {}
        self.submitted: dict[int, BudgetMember] = {}
        self.threshold: float | None = None  # λ, from the first round
        self.rounds: list[Fit] = []

    def join(self, layer_idx: int, store: BudgetMember) -> None:
        if layer_idx not in self.layers:
            raise ValueError(f"layer {layer_idx} is not in this budget group (layers {self.layers})")
        if layer_idx in self.members:
            raise ValueError(f"layer {layer_idx} already has a store in this budget group")
        self.members[layer_idx] = store

    def submit(self, layer_idx: int) -> None:
        """Layer ``layer_idx``'s store has pages ready; run the round once every layer has."""
        if layer_idx in self.submitted:
            raise RuntimeError(f"layer {layer_idx} submitted twice in one round")
        self.submitted[layer_idx] = self.members[layer_idx]
        if len(self.submitted) == len(self.layers):
            self._round()

    def _round(self) -> None:
        stores = [self.submitted[i] for i in self.layers]
        self.submitted = {}
        requests = [s.rank_request() for s in stores]
        first = self.threshold is None
        fit = fit_threshold(requests, self.budget, minimum=0.0 if first else self.threshold)
        if first and not fit.fits:
            raise ValueError(
                f"puzzle_plus: budget {self.budget} is below the cache's fixed cost: with every page at the "
                f"floor rank the cache holds {fit.total_bytes:,} bytes, more than {fit.allowance:,.0f} allowed "
                "(the dense sink and window of every layer dominate); use a longer input, a larger budget, "
                "fewer dense pages or a smaller rank_floor")
        if first:
            self.threshold = fit.threshold
        self.rounds.append(fit)
        for store, request in zip(stores, requests, strict=True):
            store.commit(request.steps_at(fit.threshold))
