"""Attention over factorized KV pages, straight from their factors (PuzzleKV §3.3, ④).

For a page with ``K̂ = L_K R_K`` and ``V̂ = L_V R_V`` the logits are ``s = (q R_Kᵀ) L_Kᵀ`` and the
page's unnormalised output is ``(exp(s − m) L_V) R_V``: the query meets the small factors first and
the dense ``K̂``/``V̂`` (``P × d``) of a page never exist. One call handles a tile of pages of every
KV head; the caller merges tiles and dense parts with :func:`merge_partials`.

:class:`PuzzlePages` is what a PuzzleKV store hands to attention (this module's PyTorch path and
the Triton kernel): exactly the tensors and sizes they read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.int4 import dequantize_int4
from ..ops.rope import RotaryTable, apply_rope
from .softmax_merge import PartialAttention, state_from_logits


def factorized_pages_partial(
    qg: torch.Tensor,
    lk: torch.Tensor,
    rk: torch.Tensor,
    lv: torch.Tensor,
    rv: torch.Tensor,
    scaling: float,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PartialAttention:
    """Partial softmax state of grouped queries over a tile of factorized pages.

    Args:
        qg: ``[H, M, d]`` queries grouped per KV head (``M = group × queries``).
        lk: ``[H, N, P, r_K]``; rk: ``[H, N, r_K, d]`` key factors of N pages.
        lv: ``[H, N, P, r_V]``; rv: ``[H, N, r_V, d]`` value factors.
        scaling: logit scale.
        rope: for pre-RoPE key factors, ``(cos, sin)`` of the pages' positions, each ``[N, P, d]``.
            The rotation depends on the position inside the page, so the tile's keys are then
            reconstructed in tile memory (``[H, N, P, d]``), rotated and contracted; values still go
            through their factors.

    Returns:
        The tile's state (m, l ``[H, M]``; o ``[H, M, d]``), fp32 (fp64 for fp64 queries).
    """
    dt = torch.float64 if qg.dtype == torch.float64 else torch.float32
    q = qg.to(dt)
    lk, rk, lv, rv = lk.to(dt), rk.to(dt), lv.to(dt), rv.to(dt)
    if rope is None:
        q_r = torch.einsum("hmd,hnrd->hnmr", q, rk)  # q Rᵀ: [H, N, M, r_K]
        s = torch.einsum("hnmr,hnpr->hmnp", q_r, lk) * scaling  # (q Rᵀ) Lᵀ: [H, M, N, P]
    else:
        cos, sin = rope
        keys = apply_rope(lk @ rk, cos.to(dt), sin.to(dt))  # [H, N, P, d], tile-local
        s = torch.einsum("hmd,hnpd->hmnp", q, keys) * scaling

    def contract(p: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("hmnp,hnpr->hmnr", p, lv)  # exp(s − m) L_V: [H, M, N, r_V]
        return torch.einsum("hmnr,hnrd->hmd", u, rv)  # ... R_V, summed over the tile's pages

    return state_from_logits(s, contract)


# --------------------------------------------------------------------------------------------
# PuzzleKV's pages as attention reads them
# --------------------------------------------------------------------------------------------

FACTOR_NAMES = ("lk", "rk", "lv", "rv")


# The tensors of ``kvpack::puzzle_attention``'s ``pages`` operand, in order (:meth:`PuzzlePages.operands`
# flattens a view into them; the Triton launcher reads them by these names and the C++ kernel's
# ``PagesOperands`` by these positions): two page sets' factors (``lk``..``rvs``: INT4 scales empty in
# float form; the second set, the pages factorized since the main set, empty when there is none), the RoPE
# tables (empty for post-RoPE keys), the dense sink and tail.
PAGES_OPERANDS = (
    "lk", "rk", "lv", "rv", "lks", "rks", "lvs", "rvs",
    "lk2", "rk2", "lv2", "rv2", "lks2", "rks2", "lvs2", "rvs2",
    "cos", "sin", "sink_k", "sink_v", "tail_k", "tail_v",
)


@dataclass(frozen=True)
class PageSet:
    """Factors of consecutive factorized pages of one layer (``N`` pages, ``H`` KV heads).

    Float form: ``lk [H, N, P, r_K]``, ``rk [H, N, r_K, d]``, ``lv [H, N, P, r_V]``, ``rv [H, N, r_V, d]``
    and ``scales`` None. INT4 form (PuzzleKV §4.3): the same matrices as packed nibbles (last axis
    halved, uint8) and ``scales`` their fp16 scales, in the order ``(lk, rk, lv, rv)``: column-wise
    for ``lk``, ``rk`` and ``rv``, row-wise for ``lv``.
    """

    lk: torch.Tensor
    rk: torch.Tensor
    lv: torch.Tensor
    rv: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def n_pages(self) -> int:
        return self.lk.shape[1]

    def matrices(self) -> tuple[torch.Tensor, ...]:
        """``(lk, rk, lv, rv)`` then, in INT4 form, their four scales (the kernel's argument order)."""
        return (self.lk, self.rk, self.lv, self.rv, *(self.scales or ()))

    def pages(self, lo: int, hi: int) -> PageSet:
        """Pages ``[lo, hi)`` of this set (views)."""
        cut = lambda t: t[:, lo:hi]  # noqa: E731
        return PageSet(*map(cut, (self.lk, self.rk, self.lv, self.rv)),
                       scales=None if self.scales is None else tuple(map(cut, self.scales)))


@dataclass(frozen=True)
class PuzzlePages:
    """Everything a PuzzleKV layer store holds, as attention reads it.

    Attributes:
        sink_k, sink_v, tail_k, tail_v: dense ``[H, T, d]`` tokens before and after the pages.
        sets: the factorized pages in position order, as one or two :class:`PageSet` (the store's
            main set and the pages factorized since), read in place.
        page_size: ``P``; rank_k, rank_v: the factors' ranks; head_dim: ``d``.
        rope: the RoPE table when keys were factorized before RoPE (``key_rope="pre"``), else None.
        tile_pages: pages per PyTorch attention tile (bounds transient memory).
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    sets: tuple[PageSet, ...]
    page_size: int
    rank_k: int
    rank_v: int
    head_dim: int
    rope: RotaryTable | None = None
    tile_pages: int = 256

    @property
    def int4(self) -> bool:
        return bool(self.sets) and self.sets[0].scales is not None

    @property
    def n_pages(self) -> int:
        return sum(s.n_pages for s in self.sets)

    @property
    def first_position(self) -> int:
        """Position of the first page's first token."""
        return self.sink_k.shape[1]

    def operands(self, device: torch.device) -> list[torch.Tensor]:
        """This view as ``kvpack::puzzle_attention``'s ``pages`` operand (:data:`PAGES_OPERANDS`), with the
        RoPE tables made on ``device`` for pre-RoPE keys."""
        if len(self.sets) > 2:
            raise ValueError(f"the PuzzleKV kernels read at most two page sets, got {len(self.sets)}")
        empty = torch.empty(0, device=self.sink_k.device)

        def factors(s: PageSet | None) -> list[torch.Tensor]:  # one set's 8 operands
            mats = list(s.matrices()) if s is not None else []
            return mats + [empty] * (8 - len(mats))

        sets = list(self.sets) + [None] * (2 - len(self.sets))
        cos = sin = empty
        if self.n_pages and self.rope is not None:
            cos, sin = self.rope.table(self.first_position + self.n_pages * self.page_size, device)
        return [*factors(sets[0]), *factors(sets[1]), cos, sin, self.sink_k, self.sink_v, self.tail_k, self.tail_v]

    def float_factors(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        """``(lk, rk, lv, rv)`` of pages ``[lo, hi)`` as floats (dequantized in INT4 form; a tile that
        spans both sets joins the two slices)."""
        parts, offset = [], 0
        for s in self.sets:
            a, b = max(lo - offset, 0), min(hi - offset, s.n_pages)
            if a < b:
                parts.append(s.pages(a, b))
            offset += s.n_pages
        mats = [p.matrices() for p in parts]
        joined = mats[0] if len(mats) == 1 else tuple(torch.cat(ts, dim=1) for ts in zip(*mats))
        if not self.int4:
            return joined
        lk, rk, lv, rv, lks, rks, lvs, rvs = joined
        d = self.head_dim
        return (dequantize_int4(lk, lks, self.rank_k), dequantize_int4(rk, rks, d),
                dequantize_int4(lv, lvs, self.rank_v), dequantize_int4(rv, rvs, d))


def puzzle_pages_partials(pages: PuzzlePages, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
    """Partial states of grouped queries ``[H, M, d]`` over the factorized pages (not the sink or
    tail), one per tile of ``tile_pages`` pages; pre-RoPE keys are rotated at their positions."""
    states = []
    P, tile, first = pages.page_size, pages.tile_pages, pages.first_position
    for lo in range(0, pages.n_pages, tile):
        hi = min(lo + tile, pages.n_pages)
        rope = None
        if pages.rope is not None:
            cos, sin = pages.rope.cos_sin(torch.arange(first + lo * P, first + hi * P, device=qg.device))
            rope = (cos.reshape(hi - lo, P, -1), sin.reshape(hi - lo, P, -1))
        states.append(factorized_pages_partial(qg, *pages.float_factors(lo, hi), scaling, rope=rope))
    return states
