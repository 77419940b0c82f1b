"""Partial softmax-attention states and their exact merge (the online-softmax / flash-decoding identity).

A *partial state* summarises attention of a set of query rows over one part of the keys:

    m[h, i]    = max_j s[h, i, j]                    (running max of the scaled logits)
    l[h, i]    = sum_j exp(s[h, i, j] - m[h, i])     (normaliser relative to m)
    o[h, i, :] = sum_j exp(s[h, i, j] - m[h, i]) v_j  (unnormalised output relative to m)

Query rows are grouped per KV head: ``q`` is ``[kv_heads, rows, head_dim]`` where the rows of one KV
head are its GQA group's query heads times the queries (``rows = group * queries``). Merging the
states of disjoint key sets gives exactly softmax attention over their union. All arithmetic is
fp32 (or the input's dtype when it is fp64, for references).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PartialAttention(NamedTuple):
    """Softmax state of query rows over one part of the keys. Shapes: m, l ``[kv_heads, rows]``;
    o ``[kv_heads, rows, head_dim_v]``. Rows that see no key have m = -inf, l = 0, o = 0."""

    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def state_from_logits(s: torch.Tensor, v_contract) -> PartialAttention:
    """Build a state from logits ``s[kv_heads, rows, ...keys]`` (``-inf`` = masked).

    ``v_contract(p)`` maps the unnormalised probabilities ``p`` (same shape as ``s``) to the output
    ``[kv_heads, rows, head_dim_v]``; it is where dense and factorized parts differ.
    """
    key_dims = tuple(range(2, s.dim()))
    m = s.amax(dim=key_dims)
    # Rows with every key masked have m = -inf; subtracting 0 there keeps exp() at 0 instead of NaN.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe.reshape(m.shape + (1,) * len(key_dims)))
    return PartialAttention(m=m, l=p.sum(dim=key_dims), o=v_contract(p))


def dense_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
) -> PartialAttention:
    """Partial state of grouped queries over dense keys/values.

    Args:
        q: ``[kv_heads, rows, d]`` grouped queries.
        k, v: ``[kv_heads, T, d]`` keys (post-RoPE) and values, any float dtype (upcast to fp32).
        scaling: logit scale (usually ``d ** -0.5``).
        mask: optional ``[rows, T]`` or ``[kv_heads, rows, T]`` bool, True = attend.
    """
    dt = _compute_dtype(q)
    s = torch.einsum("hid,htd->hit", q.to(dt), k.to(dt)) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    vv = v.to(dt)
    return state_from_logits(s, lambda p: torch.einsum("hit,htd->hid", p, vv))


def merge_partials(states: list[PartialAttention]) -> PartialAttention:
    """Merge the states of disjoint key sets into one state (log-sum-exp rescaling)."""
    if len(states) == 1:
        return states[0]
    m = torch.stack([st.m for st in states]).amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.zeros_like(states[0].l)
    o = torch.zeros_like(states[0].o)
    for st in states:
        # exp(-inf - m) = 0 for parts that saw no key.
        w = torch.exp(st.m - m_safe)
        l = l + st.l * w
        o = o + st.o * w.unsqueeze(-1)
    return PartialAttention(m=m, l=l, o=o)


def finalize(state: PartialAttention) -> torch.Tensor:
    """Normalised attention output ``[kv_heads, rows, d]``; rows that saw no key give 0."""
    return state.o / state.l.clamp_min(torch.finfo(state.l.dtype).tiny).unsqueeze(-1)


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[q_heads, Q, d]`` -> ``[kv_heads, group * Q, d]`` (query head h belongs to KV head h // group)."""
    q_heads, n_q, d = q.shape
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    return q.reshape(kv_heads, (q_heads // kv_heads) * n_q, d)


def ungroup_output(o: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Inverse of :func:`group_queries`: ``[kv_heads, group * Q, d]`` -> ``[q_heads, Q, d]``."""
    kv_heads, rows, d = o.shape
    return o.reshape(q_heads, rows * kv_heads // q_heads, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact causal attention of a chunk over itself (an empty history): ``q [Hq, Q, d]``,
    ``k, v [Hkv, Q, d]`` -> ``[Hq, Q, d]``, with SDPA as the model itself computes it."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None].to(q.dtype), v[None].to(q.dtype), is_causal=q.shape[1] > 1, scale=scaling,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out[0]


def attend_history_and_chunk(history: list[PartialAttention], qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scaling: float, q_heads: int) -> tuple[torch.Tensor, PartialAttention]:
    """One softmax over the history's partial states and the new chunk (causal within the chunk).

    Args:
        history: partial states of ``qg`` over every stored part.
        qg: ``[kv_heads, group * Q, d]`` grouped queries of the chunk; k, v: ``[kv_heads, Q, d]``.

    Returns:
        ``(out [q_heads, Q, d] fp32, merged state)``.
    """
    n_q = k.shape[1]
    group = q_heads // k.shape[0]
    mask = causal_chunk_mask(n_q, group, qg.device) if n_q > 1 else None
    merged = merge_partials([*history, dense_partial(qg, k, v, scaling, mask=mask)])
    return ungroup_output(finalize(merged), q_heads), merged


def causal_chunk_mask(n_q: int, group: int, device) -> torch.Tensor:
    """``[group * Q, Q]`` bool: row ``g*Q + i`` (query i of head g) may see chunk keys ``j <= i``."""
    causal = torch.ones(n_q, n_q, dtype=torch.bool, device=device).tril()
    return causal.repeat(group, 1)
