"""``pca_quant``'s bit allocation, pure functions: what a width costs a component (modelled or measured on the
prompt's blocks) and the order in which the water-filling buys bits (the store spends them under its budget).
"""

from __future__ import annotations

import math

import torch

from ...ops.minmax import fp16_scale, fp16_zero_point

PARAM_BYTES = 4  # fp16 scale and zero point of one coded component in one block
# the measured distortion's blocks at most (evenly spaced over the prompt's): the error of a width is a mean
# over blocks, and 32 blocks (2,048 coefficients a component at blocks of 64) settle it; all 127 of an 8K
# prompt took 36 of a layer's 85 ms of compression
MEASURED_BLOCKS = 32


def minmax_distortion(width: int, block: int) -> float:
    """Mean squared error of a unit-variance Gaussian coefficient coded at ``width`` bits by the block's
    min/max quantizer, relative to dropping it (1.0 = no better than its mean).

    The range of ``block`` Gaussian samples is about ``2 sqrt(2 ln block)`` (5.8 at 64, 6.2 at 128); a
    uniform step over it errs by ``step² / 12``. At one bit that is worse than dropping the component
    (the two levels sit at the extremes), which is why a component's first purchase is two bits.
    """
    if width == 0:
        return 1.0
    step = 2.0 * math.sqrt(2.0 * math.log(block)) / (2 ** width - 1)
    return min(1.0, step * step / 12.0)


def water_fill_order(variances: torch.Tensor, max_bits: int, block: int, first_cost: float,
                     distortion: torch.Tensor | None = None, per_side: bool = False) -> torch.Tensor:
    """The order in which bits are bought: ``[K, 4]`` int64 rows ``(head, side, component, new width)``, best
    gain per bit first.

    Args:
        variances: ``[H, 2, d]`` what each component's error costs (keys then values): its variance, or
            for keys a price in logit error (``key_metric="queries"``).
        max_bits: the widest code (at least 2).
        block: tokens per block (the quantizer's range, :func:`minmax_distortion`).
        first_cost: the extra cost, in bits per token, of coding a component at all (its block scale and
            zero point, its basis column), added to its first purchase.
        distortion: the relative error left at each width, ``[max_bits + 1]`` for every component (default:
            :func:`minmax_distortion`) or ``[H, 2, d, max_bits + 1]`` per component.
        per_side: the gain of a purchase is the share of its side's total (every head's) it removes, so the
            heads of a side compete on one scale and the two sides on their shares; else the share of its
            (head, side)'s total, so every (head, side) competes on the share of its own energy.

    A component is bought at 2 bits first, then one bit at a time; the gain of a purchase is the share of
    the total it removes (``per_side``; :func:`minmax_distortion`). Components of zero variance are never
    coded.

    This is greedy water-filling (a heap that offers a component's next purchase once its previous one is
    bought), computed as one sort: each purchase keyed by its gain per bit, lowered to the smallest key of
    the component's earlier purchases (where a first purchase, which also pays ``first_cost``, gains less
    per bit than the next one, the heap buys the next one right after it, as the lowered key does); ties
    fall in (head, side, component, width) order, as the heap's tuples do.
    """
    total = variances.double().sum(dim=(0, 2) if per_side else -1, keepdim=True)
    share = variances.double() / total.clamp_min(1e-30)
    if distortion is None:
        distortion = torch.tensor([minmax_distortion(w, block) for w in range(max_bits + 1)], dtype=torch.float64)
    dist = distortion.double().expand(*share.shape, max_bits + 1)  # [H, 2, d, widths 0..max_bits]
    new = torch.arange(2, max_bits + 1)  # the purchases of one component: 0 -> 2, 2 -> 3, ..., -> max_bits
    prev = torch.cat([new.new_zeros(1), new[:-1]])
    cost = (new - prev).double() + first_cost * (prev == 0).double()
    gain = share[..., None] * ((dist[..., prev] - dist[..., new]) / cost)  # [H, 2, d, purchases]
    key = torch.cummin(gain, dim=-1).values
    H, S, d = share.shape
    index = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(S), torch.arange(d), new, indexing="ij"), dim=-1)
    coded = (share > 0)[..., None].expand_as(key)
    key, index = key[coded], index[coded]  # [K], [K, 4] in (head, side, component, width) order
    return index[torch.sort(key, descending=True, stable=True).indices]


def measured_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """The tokens of ``x [2, H, n, d]`` the measured distortion reads: its whole blocks, at most
    :data:`MEASURED_BLOCKS` of them, evenly spaced (the table is a mean over blocks; a few dozen settle it):
    ``[2, H, blocks · block, d]``. Chosen before the projection onto the basis, which then projects 32
    blocks, not an 8K prompt's 127."""
    G = block
    nb = x.shape[2] // G
    if nb <= MEASURED_BLOCKS:
        return x[:, :, :nb * G]
    pick = torch.linspace(0, nb - 1, MEASURED_BLOCKS).round().long().to(x.device)
    blocks = x[:, :, :nb * G].reshape(*x.shape[:2], nb, G, x.shape[-1])[:, :, pick]
    return blocks.reshape(*x.shape[:2], MEASURED_BLOCKS * G, x.shape[-1])

def measured_distortion(c: torch.Tensor, block: int, max_bits: int) -> torch.Tensor | None:
    """``[H, 2, d, max_bits + 1]``: the squared error of each component's min/max code at each width over
    the given whole blocks (:func:`measured_blocks` of the fitted tokens), relative to
    its variance over them (width 0: 1) — what the water-filling
    buys against with ``distortion="measured"``; None with no whole block. Width 1, which the
    water-filling never buys (a component's first purchase is 2 bits), is left at 1.

    The codes are :func:`~kvpack.ops.minmax.quantize_minmax`'s (its fp16 zero point and scale,
    :func:`~kvpack.ops.minmax.fp16_zero_point` / :func:`~kvpack.ops.minmax.fp16_scale`), computed
    without it: the zero point and the offsets from it are the same at every width, so only the scale,
    the rounding and the error are recomputed per width, in one buffer (2.7x faster; the error differs
    from dequantizing the codes in the last bits of fp32).

    Args:
        c: ``[2, H, blocks · block, d]`` coefficients (centred) of whole blocks.
    """
    G, top = block, max_bits
    nb = c.shape[2] // G
    if not nb:
        return None
    blocks = c.reshape(c.shape[0], c.shape[1], nb, G, -1).float()  # [2, H, blocks, G, d]
    var = blocks.var(dim=(2, 3), correction=0).clamp_min(1e-30)
    lo, hi = torch.aminmax(blocks, dim=3, keepdim=True)
    zero = fp16_zero_point(lo)
    offset = blocks - zero.float()
    span = hi - zero.float()
    out = torch.ones(*var.shape, top + 1)
    err = torch.empty_like(blocks)
    for w in range(2, top + 1):
        levels = (1 << w) - 1
        scale = fp16_scale(span / levels).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        torch.div(offset, safe, out=err).round_().clamp_(0, levels)
        err.mul_(scale).sub_(offset)  # the code's value minus the coefficient
        out[..., w] = (err.square_().mean(dim=(2, 3)) / var).clamp(max=1.0)
    return out.permute(1, 0, 2, 3)
