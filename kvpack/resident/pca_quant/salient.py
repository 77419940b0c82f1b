"""Salient tokens: exact copies of the prompt tokens its last queries attend to most, held beside a coded history
(``pca_quant``'s ``salient`` option; beyond the papers).

A coded history at a few bits a coefficient keeps the distribution of attention but blurs the few tokens a
question reads (a needle's digits). AnchorKV's answer is to spend bytes on the tokens that matter most,
ranked by the attention of the prompt's observation window (SnapKV's votes; when the question ends the
prompt, its own queries). Here those tokens are kept exact, in the storage dtype, and the coded history
holds a *ghost* in their place whose reconstruction is known without decoding the codes:

* **Selection** (:func:`select_salient`): the attention of the last ``window`` queries over the prompt,
  summed over the query group and the window's rows, max-pooled over ``pooling`` neighbouring positions
  (a needle spans several tokens), and the top ``n`` of each KV head among the tokens being coded.
* **Ghost** (:func:`ghost_coefficients`, :func:`ghost_codes`): before a block is quantized, each salient
  token's coefficient of a component is set to the block's other tokens' minimum, so the block's range, scale
  and zero point (and the other tokens' codes) are what they would be without it; after, its code is
  overwritten with the level nearest 0 (the prompt's mean) on the block's grid, ``clamp(round(-zero /
  scale), 0, levels)``: a code computed from the block's stored scale and zero point alone. So the blocks
  hold a ghost whose reconstruction (:func:`ghost_tokens`) is known without decoding the codes, and which is
  a typical token (near the mean), never an extreme one whose weight would dominate the subtraction.
* **Attention**: the coded history's softmax state with the ghosts left out (the native kernel and the
  PyTorch path give each ghost a -inf logit: ``PCABlocks.skip``), plus the exact tokens' — attention over the
  history with the salient tokens exact. The Triton kernel attends the ghosts too; its state is corrected by
  subtracting theirs (a state with negated normaliser and output: the states merge linearly;
  :func:`corrected_partials`).
"""

from __future__ import annotations

import torch

from ...attention.scores import observation_probabilities
from ...attention.softmax_merge import PartialAttention, dense_partial
from ..anchor.selection import pool_neighbourhood

POSITION_BYTES = 4  # int32 position of a salient token, per KV head


def salient_bytes(count: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of ``count`` salient tokens per KV head: exact key and value in the storage dtype and a position."""
    return count * kv_heads * (2 * head_dim * elem_bytes + POSITION_BYTES)


def select_salient(q_window: torch.Tensor, k: torch.Tensor, scaling: float, lo: int, hi: int, count: int,
                   pooling: int) -> torch.Tensor:
    """Positions ``[H, count]`` (int64, ascending per head) of each KV head's salient tokens among ``[lo, hi)``.

    Args:
        q_window: ``[q_heads, W, d]`` post-RoPE queries of the prompt's last ``W`` positions.
        k: ``[H, S, d]`` post-RoPE keys of positions ``0 .. S-1`` (every token the window saw).
        scaling: the layer's logit scale.
        lo, hi: the candidates (the tokens being coded); ``count <= hi - lo``.
        pooling: odd max-pool window over positions of the votes (1: none).
    """
    W = q_window.shape[1]
    probs = observation_probabilities(q_window.float(), k.float(), scaling, W)  # [H, g, W, S]
    votes = probs.sum(dim=(1, 2))[:, lo:hi]  # [H, hi - lo]
    votes = pool_neighbourhood(votes, pooling)
    top = torch.topk(votes, count, dim=1).indices  # ties: topk's order (deterministic on CPU)
    return (top + lo).sort(dim=1).values


def ghost_coefficients(c: torch.Tensor, salient: torch.Tensor) -> torch.Tensor:
    """``c [blocks, block, C]`` (one head's coefficients of the blocks being coded) with each salient token's
    row set to the other tokens' minimum per (block, component) (0 where every token of the block is salient):
    inside their range, so the block's min and max are theirs. ``salient``: ``[blocks, block]`` bool."""
    mask = salient[:, :, None]
    lo = c.masked_fill(mask, float("inf")).amin(dim=1, keepdim=True)  # [blocks, 1, C]
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
    return torch.where(mask, lo.expand_as(c), c)


def ghost_codes(scale: torch.Tensor, zero: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The ghost's code of each (block, component): the level nearest 0 on the block's grid, ``[..., C]`` uint8
    from the fp16 ``scale``, ``zero`` ``[..., C]`` and the components' ``widths [C]``."""
    levels = ((1 << widths.long()) - 1).float()
    s, z = scale.float(), zero.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    code = torch.where(s > 0, torch.round(-z / safe), torch.zeros_like(s))
    return torch.minimum(code.clamp_min(0), levels).to(torch.uint8)


def ghost_tokens(scale: torch.Tensor, zero: torch.Tensor, widths: torch.Tensor, basis: torch.Tensor,
                 mean: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The coded history's reconstruction of one (side, head)'s salient tokens: ``[n, d]`` fp32, pre-RoPE for keys.

    Args:
        scale, zero: ``[n_blocks, C]`` fp16 of the (side, head)'s ``C`` coded components.
        widths: ``[C]`` their widths; basis: ``[C, d]`` fp16 their basis rows; mean: ``[d]`` fp32.
        blocks: ``[n]`` the block of each salient token.
    """
    if not len(widths):  # nothing coded: its mean stands for every token
        return mean.expand(len(blocks), -1).clone()
    s, z = scale[blocks], zero[blocks]  # [n, C]
    coefficient = ghost_codes(s, z, widths).float() * s.float() + z.float()  # as the blocks dequantize it
    return coefficient @ basis.float() + mean


def corrected_partials(coded: list[PartialAttention], qg: torch.Tensor, scaling: float, ghost_k: torch.Tensor,
                       ghost_v: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor) -> list[PartialAttention]:
    """The coded history's states with the ghosts taken out and the exact salient tokens put in.

    Args:
        coded: states of ``qg [H, M, d]`` over the coded blocks (ghosts included).
        ghost_k, ghost_v: ``[H, n, d]`` the ghosts' reconstruction (keys post-RoPE), as the blocks decode them.
        exact_k, exact_v: ``[H, n, d]`` the salient tokens (keys post-RoPE).

    The ghost state enters with a negated normaliser and output: merging is linear in them, so the merged
    normaliser is the coded one less each ghost's ``exp(s - m)``. The ghosts are among the coded tokens, so
    what is left stays positive up to rounding (the kernels and this path compute a ghost's logit in
    different orders: a relative difference near fp32's epsilon).
    """
    dt = torch.float64 if qg.dtype == torch.float64 else torch.float32
    ghost = dense_partial(qg, ghost_k.to(dt), ghost_v.to(dt), scaling)
    negated = PartialAttention(ghost.m, -ghost.l, -ghost.o)
    return [*coded, negated, dense_partial(qg, exact_k, exact_v, scaling)]
