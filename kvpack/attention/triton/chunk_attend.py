"""The end of a decode step in one launch: the new tokens' own attention, merged with the stored states.

``softmax_merge.attend_history_and_chunk`` does this in PyTorch — the chunk's logits with their
causal mask, its partial state, the log-sum-exp merge with every stored state, the normalisation —
about thirty ops, each a kernel launch on a GPU, on every layer of every decode step. Here it is one
kernel: per (KV head, block of query rows) it merges the stored states (their rows' maximum first,
then the rescaled normalisers and outputs, as ``merge_partials``), continues the online softmax over
the chunk's keys (row ``r`` of a head's group is query ``r mod Q``, which sees chunk keys ``j <= r mod
Q``) and writes the normalised output. All fp32; the chunk's products in full fp32
(``input_precision="ieee"``, as PyTorch computes them), not TF32: they are a few tokens, the most
recent ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_op import chunk_attend, stacked_states
from ..softmax_merge import PartialAttention, ungroup_output
from ._common import merge_states, online_softmax_step
from ._launch import ROW_BLOCK, kernel_arg, launch, pow2, row_blocks

_CHUNK_BLOCK = 16  # chunk keys per loop step (tl.dot's smallest tile)


@triton.jit
def _dense_keys(q, m_i, l_i, acc, k_ptr, v_ptr, h, n, last_seen, mask_m, offs_t, offs_d, D, scaling,
                BT: tl.constexpr):
    """Fold ``n`` dense keys/values ``[H, n, D]`` into the rows' online-softmax state; row ``i`` sees
    keys ``j <= last_seen[i]``. Products in full fp32."""
    for t0 in range(0, n, BT):
        tt = t0 + offs_t
        mask_td = (tt[:, None] < n) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + (h * n + tt[:, None]) * D + offs_d[None, :], mask=mask_td, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (h * n + tt[:, None]) * D + offs_d[None, :], mask=mask_td, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        seen = mask_m[:, None] & (tt[None, :] < n) & (tt[None, :] <= last_seen[:, None])
        m_new, l_i, alpha, p = online_softmax_step(m_i, l_i, tl.where(seen, scores, float("-inf")))
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


# Not specialised on the counts: Triton compiles an integer argument equal to 1 as a constant, and
# with Q = 1 (every decode step) this kernel then took 255 registers and spilled 312 bytes per
# thread on sm_80 and sm_90 (95 registers, nothing spilled, without); one binary serves all lengths.
@triton.jit(do_not_specialize=["S", "T", "Q"])
def chunk_attend_kernel(m_ptr, l_ptr, o_ptr, q_ptr, tk_ptr, tv_ptr, k_ptr, v_ptr, out_ptr, m_out, l_out,
                        S, M, T, Q, D, scaling,
                        BM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Grid ``(kv_heads, row blocks of BM)``. Inputs (contiguous): stored states m, l ``[H, S, M]``,
    o ``[H, S, M, D]`` fp32 (``S`` may be 0); grouped queries ``[H, M, D]`` fp32 with ``M = group ·
    Q``; ``T`` stored dense tokens every row sees (a store's tail, ``[H, T, D]``; may be 0); the
    chunk's keys and values ``[H, Q, D]``. Outputs: normalised ``out [H, M, D]`` and the merged
    ``m, l [H, M]`` fp32."""
    h = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask_m = offs_m < M
    mask_md = mask_m[:, None] & (offs_d[None, :] < D)
    m_i, l_i, acc = merge_states(m_ptr, l_ptr, o_ptr, h, S, M, D, offs_m, mask_m, offs_d, offs_d < D, BM, BD)
    # The stored dense tokens, then the chunk, causal within itself (group_queries' layout: row r is
    # query r mod Q).
    q = tl.load(q_ptr + (h * M + offs_m[:, None]) * D + offs_d[None, :], mask=mask_md, other=0.0)
    offs_t = tl.arange(0, BT)
    m_i, l_i, acc = _dense_keys(q, m_i, l_i, acc, tk_ptr, tv_ptr, h, T, tl.zeros([BM], tl.int32) + T, mask_m,
                                offs_t, offs_d, D, scaling, BT)
    m_i, l_i, acc = _dense_keys(q, m_i, l_i, acc, k_ptr, v_ptr, h, Q, offs_m % Q, mask_m, offs_t, offs_d, D,
                                scaling, BT)
    # Rows that saw no key at all (l = 0, o = 0) give 0, as finalize does.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (h * M + offs_m[:, None]) * D + offs_d[None, :], out, mask=mask_md)
    tl.store(m_out + h * M + offs_m, m_i, mask=mask_m)
    tl.store(l_out + h * M + offs_m, l_i, mask=mask_m)


def _triton_chunk_attend(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, qg: torch.Tensor, tail_k: torch.Tensor,
                         tail_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel of ``kvpack::chunk_attend`` (its contract and shapes:
    ``kvpack.attention.chunk_op.chunk_attend``, which declares the op without importing Triton)."""
    H, S, M = m.shape
    T, Q, D = tail_k.shape[1], k.shape[1], k.shape[2]
    out = qg.new_empty(H, M, D, dtype=torch.float32)
    m_out = qg.new_empty(H, M, dtype=torch.float32)
    l_out = qg.new_empty(H, M, dtype=torch.float32)
    launch(chunk_attend_kernel, (H, row_blocks(M)),
           kernel_arg(m), kernel_arg(l), kernel_arg(o), qg.float().contiguous(), kernel_arg(tail_k), kernel_arg(tail_v),
           kernel_arg(k), kernel_arg(v), out, m_out, l_out, S, M, T, Q, D, scaling,
           BM=ROW_BLOCK, BT=_CHUNK_BLOCK, BD=pow2(D))
    return out, m_out, l_out


chunk_attend.register_kernel("cuda")(_triton_chunk_attend)


def fused_history_and_chunk(history: list[PartialAttention], qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scaling: float, q_heads: int,
                            tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """``attend_history_and_chunk`` in one launch: ``(out [q_heads, Q, d] fp32, m [H, M], l [H, M])``
    with ``m, l`` the merged state's. ``tail``: stored dense keys and values ``[H, T, d]`` that every
    row sees, read by the kernel in place (instead of a PyTorch partial state for them). One stored
    state (PuzzleKV's op) is passed as a view; several are stacked first (three copies of
    ``[H, M(, d)]``, small)."""
    m, l, o = stacked_states(history, qg)
    tail_k, tail_v = tail if tail is not None else (k[:, :0], v[:, :0])
    # On CPU tensors (the interpreter) the launcher itself; the op's CPU kernel is the native one.
    run = _triton_chunk_attend if qg.device.type == "cpu" else chunk_attend
    out, m_out, l_out = run(m, l, o, qg.float().contiguous(), tail_k, tail_v, k, v, float(scaling))
    return ungroup_output(out, q_heads), m_out, l_out
