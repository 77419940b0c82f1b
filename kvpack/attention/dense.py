"""Attention over dense keys/values as one custom op, ``kvpack::dense_attention``.

Its default implementation is the PyTorch path (:func:`softmax_merge.dense_partial`); its CPU kernel
is native code (``kvpack/attention/cpu/csrc/dense.cpp``: split-K over the tokens, keys and values
widened to fp32 a tile at a time, never a converted copy of the whole region). Stores call
:func:`dense_state` with their ``attention_backend``.
"""

from __future__ import annotations

import torch

from .softmax_merge import PartialAttention, dense_partial

TOKENS_PER_SPLIT = 512  # dense tokens per (head, split) job of the native kernel


@torch.library.custom_op("kvpack::dense_attention", mutates_args=())
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    tokens_per_split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]`` over
    dense ``k, v [H, T, D]`` (fp32/bf16/fp16). Default implementation: the PyTorch path."""
    st = dense_partial(q, k, v, scaling)
    return st.m.float(), st.l.float(), st.o.float()


@dense_attention.register_fake
def _(q, k, v, scaling, tokens_per_split):
    H, M, D = q.shape
    return q.new_empty(H, M), q.new_empty(H, M), q.new_empty(H, M, D)


def dense_state(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, backend: str = "torch",
                ) -> PartialAttention:
    """State of grouped queries ``qg [H, M, d]`` over dense ``k, v [H, T, d]``: the native kernel where
    ``backend`` (a resolved path, :func:`kvpack.attention.backend.resolve_backend`) is ``"native"``, the PyTorch
    path otherwise (and for fp64 queries: the reference)."""
    if qg.dtype != torch.float64 and backend == "native":
        return PartialAttention(*dense_attention(qg.float().contiguous(), k, v, float(scaling), TOKENS_PER_SPLIT))
    return dense_partial(qg, k, v, scaling)


def sdpa_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, group: int) -> torch.Tensor:
    """A chunk's attention over every stored token followed by the chunk itself, as transformers
    computes it (SDPA): ``q [q_heads, Q, d]``, ``keys, values [1, kv_heads, T, d]`` whose last ``Q``
    tokens are the chunk's (query ``i`` sits at position ``T - Q + i``; causal within the chunk).
    Returns ``[q_heads, Q, d]`` in ``q.dtype``."""
    n_q, end = q.shape[1], keys.shape[2]
    mask = None
    if n_q > 1 and end > n_q:  # SDPA's is_causal aligns top-left, so a chunk after history is masked explicitly
        pos = torch.arange(end, device=q.device)
        mask = pos[None, :] <= (end - n_q + torch.arange(n_q, device=q.device))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, is_causal=n_q > 1 and mask is None,
        scale=scaling, enable_gqa=group > 1)
    return out.squeeze(0)
