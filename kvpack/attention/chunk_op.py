"""The end of a decode step as one custom op, ``kvpack::chunk_attend``: the stored parts' softmax
states merged, the store's dense tail and the chunk's own tokens (causal) folded in, normalised.

One schema, two backends: the native CPU kernel (``cpu/csrc/chunk.cpp``) and the Triton kernel, which
``triton/chunk_attend.py`` registers for CUDA when it is imported (it imports this module, never the
reverse; under ``TRITON_INTERPRET=1`` it calls its launcher directly on CPU tensors). This module never
imports Triton. :func:`native_history_and_chunk` is the CPU stores' path; ``history_and_chunk.py`` picks a
store's path (``softmax_merge.attend_history_and_chunk`` is the reference).
"""

from __future__ import annotations

import torch

from .softmax_merge import PartialAttention, ungroup_output


@torch.library.custom_op("kvpack::chunk_attend", mutates_args=())
def chunk_attend(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, qg: torch.Tensor, tail_k: torch.Tensor,
                 tail_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [H, M, D], m [H, M], l [H, M])`` fp32: attention of grouped queries ``qg [H, M, D]`` over
    the stored states ``m, l [H, S, M]``, ``o [H, S, M, D]``, the stored dense tokens ``tail_k,
    tail_v [H, T, D]`` (``T`` may be 0) and the chunk ``k, v [H, Q, D]`` (causal within the chunk),
    normalised; ``m, l`` are the merged state's, for callers that keep the log-sum-exp.

    Raises:
        NotImplementedError: tensors on a device with no kernel registered (CUDA before
            ``kvpack.attention.triton.chunk_attend`` is imported, which the Triton stores do).
    """
    raise NotImplementedError(f"kvpack::chunk_attend has no kernel for {qg.device.type} tensors (CUDA: import "
                              "kvpack.attention.triton.chunk_attend, which registers the Triton kernel)")


@chunk_attend.register_fake
def _(m, l, o, qg, tail_k, tail_v, k, v, scaling):
    H, M, D = qg.shape
    return (qg.new_empty(H, M, D, dtype=torch.float32), qg.new_empty(H, M, dtype=torch.float32),
            qg.new_empty(H, M, dtype=torch.float32))


def stacked_states(history: list[PartialAttention], qg: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``m, l [H, S, M]``, ``o [H, S, M, D]`` fp32 of the stored states (one state is a view; several
    are stacked: three copies of ``[H, M(, d)]``, small)."""
    if len(history) == 1:
        m, l, o = (t.unsqueeze(1) for t in history[0])
    elif history:
        m, l, o = (torch.stack(ts, dim=1) for ts in zip(*history))
    else:
        H, M, D = qg.shape
        m, l, o = qg.new_empty(H, 0, M), qg.new_empty(H, 0, M), qg.new_empty(H, 0, M, D)
    return m.float().contiguous(), l.float().contiguous(), o.float().contiguous()


def native_history_and_chunk(history: list[PartialAttention], qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scaling: float, q_heads: int, tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attend_history_and_chunk`` through the op's native CPU kernel: ``(out [q_heads, Q, d] fp32, m, l
    [H, M])``; ``tail``: stored dense keys and values ``[H, T, d]`` every row sees, read in place."""
    m, l, o = stacked_states(history, qg)
    tail_k, tail_v = tail if tail is not None else (k[:, :0], v[:, :0])
    out, m_out, l_out = chunk_attend(m, l, o, qg.float().contiguous(), tail_k.contiguous(), tail_v.contiguous(),
                                     k.contiguous(), v.contiguous(), float(scaling))
    return ungroup_output(out, q_heads), m_out, l_out
