"""Attention statistics of a prefill chunk for eviction policies, computed in query chunks.

Neither function materialises the full ``S × S`` attention matrix: queries are processed
``chunk`` rows at a time against the keys they can see (causal), so the transient memory is
``O(chunk × S)`` per head.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

# The memo of :func:`shared_prefill_scores`' block (None outside one): ``{"scores": {key: (q, k, scores)},
# "hits": int}``.
_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvpack_prefill_score_memo", default=None)


@contextlib.contextmanager
def shared_prefill_scores() -> Iterator[dict]:
    """Within the block, :func:`accumulated_attention` computes each (queries, keys, scale, chunk) once.

    For an evaluation that builds one method at several budgets from one prefill (H2O's scores do not depend
    on the budget): the later builds reuse the first's scores. Yields the memo; its ``"hits"`` counts the
    reuses (the harness marks a row whose build reused scores, as its compression time then leaves them
    out). The memo holds the inputs it saw, so their memory is not reused by other tensors while the block
    lives (a key is the storage address, offset, shape, strides, dtype and version of each input: an
    in-place change of an input misses); everything is released when the block ends.
    """
    memo = {"scores": {}, "hits": 0}
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device),
            t._version)


def _group_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """``q [Hq, n, d]``, ``k [Hkv, T, d]`` -> logits ``[Hkv, group, n, T]`` in fp32."""
    hkv = k.shape[0]
    qg = q.float().reshape(hkv, q.shape[0] // hkv, q.shape[1], q.shape[2])
    return torch.einsum("hgnd,htd->hgnt", qg, k.float()) * scaling


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, scaling: float, chunk: int = 256) -> torch.Tensor:
    """H2O scores: post-softmax attention mass each key receives from all (causal) queries.

    Args:
        q: ``[q_heads, S, d]`` queries of positions ``0..S-1``; k: ``[kv_heads, S, d]`` keys.
        scaling: logit scale.

    Returns:
        ``[kv_heads, S]`` fp32: per KV head, the attention probabilities summed over every query
        and over the query heads of its GQA group (inside :func:`shared_prefill_scores`, computed once
        per input; each call gets its own copy).
    """
    memo = _MEMO.get()
    if memo is None:
        return _accumulated_attention(q, k, scaling, chunk)
    key = (_tensor_key(q), _tensor_key(k), float(scaling), int(chunk))
    if key in memo["scores"]:
        memo["hits"] += 1
    else:
        memo["scores"][key] = (q, k, _accumulated_attention(q, k, scaling, chunk))
    return memo["scores"][key][2].clone()


def _accumulated_attention(q: torch.Tensor, k: torch.Tensor, scaling: float, chunk: int) -> torch.Tensor:
    S = k.shape[1]
    scores = torch.zeros(k.shape[0], S, dtype=torch.float32, device=k.device)
    for lo in range(0, S, chunk):
        hi = min(lo + chunk, S)
        s = _group_logits(q[:, lo:hi], k[:, :hi], scaling)  # [H, g, n, hi]
        causal = torch.arange(hi, device=k.device)[None, :] <= torch.arange(lo, hi, device=k.device)[:, None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        scores[:, :hi] += p.sum(dim=(1, 2))
    return scores


def mask_unseen_keys_(logits: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Causal mask, in place: ``logits [..., Q, S]`` to ``-inf`` where key position > query position.

    ``key_positions [S]`` must be ascending (a prompt, or a stretch of it); ``query_positions [Q]`` any
    order. Only keys after the earliest query can be hidden from some query, so only that suffix of
    columns is touched (the last ``W − 1`` keys for an observation window at the end of a prompt).
    """
    first = int(torch.searchsorted(key_positions, query_positions.min(), right=True))
    if first < logits.shape[-1]:
        logits[..., first:].masked_fill_(key_positions[first:] > query_positions[:, None], float("-inf"))
    return logits


def observation_probabilities(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """Attention probabilities ``[kv_heads, group, window, S]`` fp32 of the last ``window`` queries
    (``q [q_heads, ≥window, d]``, the last rows taken) over all ``S`` keys ``k [kv_heads, S, d]``,
    causal: the query at position ``p`` sees keys ``0..p``."""
    S = k.shape[1]
    s = _group_logits(q[:, -window:], k, scaling)  # [H, g, W, S]
    mask_unseen_keys_(s, torch.arange(S, device=k.device), torch.arange(S - window, S, device=k.device))
    return torch.softmax(s, dim=-1)


def observation_votes(probs: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV votes ``[kv_heads, S - window]`` from :func:`observation_probabilities`' ``probs``: the
    probabilities given the prefix keys, summed over the observation queries and the query heads of
    each GQA group, average-pooled along the sequence with ``kernel`` (stride 1, same length)."""
    S, window = probs.shape[-1], probs.shape[-2]
    votes = probs[..., : S - window].sum(dim=(1, 2))  # [H, S - W]
    if kernel > 1:
        # As SnapKV's reference code: zero padding counted in the average at the ends.
        votes = torch.nn.functional.avg_pool1d(votes[:, None], kernel, stride=1,
                                               padding=kernel // 2)[:, 0, : S - window]
    return votes


def observation_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, kernel: int) -> torch.Tensor:
    """SnapKV scores of the prefix keys from the last ``window`` queries.

    The observation queries (the last ``window`` positions; ``q`` may hold all ``S`` positions or just
    those ``window``) attend causally over all ``S`` keys;
    the probabilities they give the ``S - window`` prefix keys are summed over the observation
    queries and the query heads of each GQA group, then average-pooled along the sequence with
    ``kernel`` (stride 1, same length).

    Returns:
        ``[kv_heads, S - window]`` fp32.
    """
    return observation_votes(observation_probabilities(q, k, scaling, window), kernel)
