"""Attention over factorized KV pages, straight from their factors (PuzzleKV §3.3, ④).

For a page with ``K̂ = L_K R_K`` and ``V̂ = L_V R_V`` the logits are ``s = (q R_Kᵀ) L_Kᵀ`` and the
page's unnormalised output is ``(exp(s − m) L_V) R_V``: the query meets the small factors first and
the dense ``K̂``/``V̂`` (``P × d``) of a page never exist. One call handles a tile of pages of every
KV head; the caller merges tiles and dense parts with :func:`merge_partials`.
"""

from __future__ import annotations

import torch

from ..ops.rope import apply_rope
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
