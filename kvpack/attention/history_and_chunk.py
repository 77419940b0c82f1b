"""The end of every decode step on the path the store resolved: the stored parts' states, the dense tail and the
chunk's own tokens merged — one Triton launch, the native CPU kernel (both ``kvpack::chunk_attend``,
``chunk_op.py``) or the PyTorch reference (``softmax_merge.attend_history_and_chunk``)."""

from __future__ import annotations

import torch

from .chunk_op import native_history_and_chunk
from .dense import dense_state
from .softmax_merge import attend_history_and_chunk

FUSED_CHUNK_MAX = 16  # queries per chunk that the one-launch chunk attention takes (decode, draft verification)


def history_and_chunk(history: list, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                      q_heads: int, backend: str, tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's attention over the stored states, the stored dense ``tail`` (keys, values
    ``[kv_heads, T, d]``, or None) and itself: ``(out [q_heads, Q, d] fp32, m, l)`` (``m, l
    [kv_heads, group · Q]``: the merged state's). One Triton launch
    (``triton/chunk_attend.fused_history_and_chunk``) where ``backend`` (a resolved path,
    :func:`kvpack.attention.backend.resolve_backend`) is ``"triton"`` and the
    chunk has at most ``FUSED_CHUNK_MAX`` queries; ``softmax_merge.attend_history_and_chunk``
    otherwise (longer chunks, such as a prompt after a compressed history, keep the PyTorch path's
    one block of logits; the kernel would loop over them in 16-row tiles — not measured against it).
    The same op's native kernel where ``backend`` is ``"native"`` (fp64 queries: the reference)."""
    if k.shape[1] <= FUSED_CHUNK_MAX and backend == "triton":
        from .triton.chunk_attend import fused_history_and_chunk

        return fused_history_and_chunk(history, qg, k, v, scaling, q_heads, tail)
    if k.shape[1] <= FUSED_CHUNK_MAX and qg.dtype != torch.float64 and backend == "native":
        return native_history_and_chunk(history, qg, k, v, scaling, q_heads, tail)
    if tail is not None and tail[0].shape[1]:
        history = [*history, dense_state(qg, *tail, scaling, backend)]
    out, merged = attend_history_and_chunk(history, qg, k, v, scaling, q_heads)
    return out, merged.m, merged.l
