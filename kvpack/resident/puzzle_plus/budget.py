"""The whole-cache byte budget of ``puzzle_plus``: one allocation across every compressed layer.

A :class:`WholeCacheBudget` groups the stores of one sequence (one per compressed layer). A store
whose tail holds pages ready to factorize *submits* them. The first *round* runs when every layer of
the group has submitted — at the end of the prefill (the live path: the last layer's first update;
the harness: after the last layer's ``load_prefill``): the group asks each store for its pages'
marginal gains (:class:`RankRequest`), finds the water level (``allocation.fit_threshold``) over the
whole cache and lets each store factorize its pages at the ranks that level gives. That level is the
threshold λ, and each store's bytes over its dense bytes at the end of its coming page cycle is its
*share* (the layers' shares average at most the budget, weighted by their dense bytes).

A page completed while decoding is ranked at once, in a round of its own layer (the layers complete
their pages at different steps where the stores stagger them): λ is the floor of its level — the page
gets the ranks λ gives it, fewer only when the layer's bytes would otherwise exceed its share at the
end of its coming page cycle. Every layer within its share keeps the whole cache within the budget, at
every step. (Without staggering every layer completes its page on the same token; their rounds then
follow one another within that step.)
"""

from __future__ import annotations

from typing import Protocol

from .allocation import Fit, RankRequest, fit_allowance, fit_threshold


class BudgetMember(Protocol):
    share: float | None

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
        """Layer ``layer_idx``'s store has pages ready: after the first round, rank them now (its own round);
        before it, run the first round once every layer has submitted."""
        if self.threshold is not None:
            self._layer_round(self.members[layer_idx])
            return
        if layer_idx in self.submitted:
            raise RuntimeError(f"layer {layer_idx} submitted twice in one round")
        self.submitted[layer_idx] = self.members[layer_idx]
        if len(self.submitted) == len(self.layers):
            self._first_round()

    def _layer_round(self, store: BudgetMember) -> None:
        """One layer's pages completed while decoding: the lowest level ``≥ λ`` within the layer's share."""
        request = store.rank_request()
        fit = fit_allowance([request], store.share * request.projected_dense_bytes, minimum=self.threshold)
        self.rounds.append(fit)
        store.commit(request.steps_at(fit.threshold))

    def _first_round(self) -> None:
        """Every layer's prefill pages: one water level over the whole cache (λ), and each layer's share."""
        stores = [self.submitted[i] for i in self.layers]
        self.submitted = {}
        requests = [s.rank_request() for s in stores]
        fit = fit_threshold(requests, self.budget)
        if not fit.fits:
            raise ValueError(
                f"puzzle_plus: budget {self.budget} is below the cache's fixed cost: with every page at the "
                f"floor rank the cache holds {fit.total_bytes:,} bytes, more than {fit.allowance:,.0f} allowed "
                "(the dense sink and window of every layer dominate); use a longer input, a larger budget, "
                "fewer dense pages or a smaller rank_floor")
        self.threshold = fit.threshold
        self.rounds.append(fit)
        for store, request in zip(stores, requests, strict=True):
            steps = request.steps_at(fit.threshold)
            store.share = request.projected_bytes(steps) / request.projected_dense_bytes
            store.commit(steps)
