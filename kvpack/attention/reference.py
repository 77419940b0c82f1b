"""Plain fp64 reference attention, the yardstick for every fast path."""

from __future__ import annotations

import torch


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None = None, causal_offset: int | None = None
) -> torch.Tensor:
    """Softmax attention in fp64 with GQA.

    Args:
        q: ``[q_heads, Q, d]``; k, v: ``[kv_heads, T, d]`` with ``q_heads % kv_heads == 0``.
        scaling: logit scale, default ``d ** -0.5``.
        causal_offset: when set, query i sits at position ``causal_offset + i`` and sees keys
            ``j <= causal_offset + i`` (keys are positions 0..T-1). None = every query sees every key.

    Returns:
        ``[q_heads, Q, d]`` fp64.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.einsum("hqd,htd->hqt", q, k) * scaling
    if causal_offset is not None:
        pos_q = causal_offset + torch.arange(q.shape[1])[:, None]
        s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqt,htd->hqd", torch.softmax(s, dim=-1), v)
