"""AnchorKV's byte budget (Eq. 9): what the anchors and metadata cost (``M_base``) and how many
2-bit residuals the rest of ``θ M_full`` buys; and, beyond the paper (``anchor_plus``), what a budget
above the 2-bit saturation point buys: 4-bit residuals (the fine tier) and more anchors. Pure
functions of sizes; the layout they count is described in :mod:`kvpack.attention.anchor`."""

from __future__ import annotations

import math

from ...attention.anchor import PREFIX_BLOCK
from ...ops.accounting import dense_bf16_bytes
from ...ops.residual_codec import BITS, FINE_BITS, ResidualCodec


def residual_bytes(head_dim: int, bits: int = BITS) -> int:
    """``b_res``: packed ``bits``-bit codes of one residual plus its scale (2 bits: the paper's)."""
    return ResidualCodec.bytes_per_residual(head_dim, bits)


def fine_tier_bytes(seq_len: int, kv_heads: int) -> int:
    """Metadata of the fine (4-bit) tier of a segment, both sides: its bitmask and per-32-token
    prefix counts, as the 2-bit tier's (the codes and scales are counted per residual)."""
    return 2 * kv_heads * (math.ceil(seq_len / 8) + math.ceil(seq_len / PREFIX_BLOCK) * 4)


def index_bytes_for(n_anchors: int, narrow: bool) -> int:
    """Bytes of one stored anchor index: 2 (int16, the paper's accounting), or 1 (uint8) when
    ``narrow`` and ``k ≤ 256``."""
    return 1 if narrow and n_anchors <= 256 else 2


def base_bytes(seq_len: int, kv_heads: int, head_dim: int, n_anchors: int, anchor_bytes: int = 2,
               index_bytes: int = 2) -> int:
    """``M_base``: every byte besides the residual codes and scales (see module doc)."""
    per_side = (kv_heads * n_anchors * head_dim * anchor_bytes  # anchor vectors
                + kv_heads * seq_len * (index_bytes + 2)  # anchor index + fp16 coefficient
                + kv_heads * math.ceil(seq_len / 8)  # residual bitmask
                + kv_heads * math.ceil(seq_len / PREFIX_BLOCK) * 4)  # int32 prefix counts
    return 2 * per_side


def below_fixed_cost(theta: float, seq_len: int, m_base: int, m_full: int, n_anchors: int) -> ValueError:
    return ValueError(
        f"anchor: budget θ = {theta} is below AnchorKV's fixed cost at {seq_len} tokens: anchors and metadata "
        f"need {m_base / m_full:.4f} of the dense bytes (k = {n_anchors} anchors per head)"
    )


def residual_slots(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                   anchor_bytes: int = 2, index_bytes: int = 2) -> int:
    """Eq. 9: residuals the budget buys (raises below the fixed cost)."""
    m_full = dense_bf16_bytes(seq_len, kv_heads, head_dim)
    m_base = base_bytes(seq_len, kv_heads, head_dim, n_anchors, anchor_bytes, index_bytes)
    if theta * m_full < m_base:
        raise below_fixed_cost(theta, seq_len, m_base, m_full, n_anchors)
    return max(0, math.floor((theta * m_full - m_base) / residual_bytes(head_dim)))


def anchors_for_budget(theta: float, seq_len: int, kv_heads: int, head_dim: int, window: int,
                       anchor_bytes: int = 2, narrow_index: bool = False) -> tuple[int, int]:
    """The "no residuals" ablation: ``(k, index bytes)`` with the most anchors per head whose
    ``M_base`` fits ``θ M_full`` (at most ``seq_len``; raises when not even the window fits)."""
    m_full = dense_bf16_bytes(seq_len, kv_heads, head_dim)
    per_anchor = 2 * kv_heads * head_dim * anchor_bytes
    for index_bytes in ((1, 2) if narrow_index else (2,)):
        fixed = base_bytes(seq_len, kv_heads, head_dim, 0, anchor_bytes, index_bytes)
        k = min(seq_len, math.floor((theta * m_full - fixed) / per_anchor))
        if index_bytes_for(k, narrow_index) == index_bytes:
            break
    if k < window:
        raise below_fixed_cost(theta, seq_len, base_bytes(seq_len, kv_heads, head_dim, window, anchor_bytes,
                                                            index_bytes), m_full, window)
    return k, index_bytes


def saturation_cost(seq_len: int, kv_heads: int, head_dim: int, n_anchors: int, anchor_bytes: int = 2,
                    index_bytes: int = 2, bits: int = BITS) -> int:
    """Bytes of a segment where every non-anchor token-side has a ``bits``-bit residual (with 4 bits,
    the fine tier's metadata included)."""
    fine = fine_tier_bytes(seq_len, kv_heads) if bits == FINE_BITS else 0
    return (base_bytes(seq_len, kv_heads, head_dim, n_anchors, anchor_bytes, index_bytes) + fine
            + 2 * kv_heads * (seq_len - n_anchors) * residual_bytes(head_dim, bits))


def fine_residual_slots(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                        anchor_bytes: int = 2, index_bytes: int = 2) -> int:
    """Beyond the paper (``anchor_plus``, ``above_saturation = "residual4"``): how many token-sides a
    budget above the 2-bit saturation point upgrades from a 2-bit to a 4-bit residual.

    Past saturation every non-anchor token-side has a 2-bit residual; the fine tier's metadata
    (:func:`fine_tier_bytes`) is paid once, then each upgrade costs ``b_res(4) − b_res(2) = D/4``
    bytes. Returns 0 when the budget does not reach saturation plus the tier's metadata plus one
    upgrade, and at most ``2 H (S − k)`` (every candidate upgraded).
    """
    budget = theta * dense_bf16_bytes(seq_len, kv_heads, head_dim)
    spare = (budget - saturation_cost(seq_len, kv_heads, head_dim, n_anchors, anchor_bytes, index_bytes)
             - fine_tier_bytes(seq_len, kv_heads))
    step = residual_bytes(head_dim, FINE_BITS) - residual_bytes(head_dim)
    if spare < step:
        return 0
    return min(2 * kv_heads * (seq_len - n_anchors), math.floor(spare / step))


def anchors_above_saturation(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                             anchor_bytes: int = 2, narrow_index: bool = False, bits: int = BITS) -> int:
    """Beyond the paper (``anchor_plus``): the anchors a budget above the ``bits``-bit saturation point buys.

    At ``k = n_anchors``, ``θ M_full`` may buy a ``bits``-bit residual for every non-anchor token-side
    and leave bytes unspent (with 2 bits, Eq. 9 has nothing more to buy: AnchorKV's budget curve
    stops there). Each further anchor stores one more token exactly in place of its residual, for a
    net ``2 H (D · anchor_bytes − b_res)`` bytes; this returns the largest ``k ≥ n_anchors`` (at most
    ``seq_len``) whose anchors, metadata and a residual for every remaining token-side fit
    ``θ M_full``, or ``n_anchors`` when the budget does not reach saturation. The cost is
    non-decreasing in ``k`` (the uint8 → int16 index step at 257 anchors included), so a bisection
    finds it.
    """
    budget = theta * dense_bf16_bytes(seq_len, kv_heads, head_dim)

    def cost(k: int) -> int:
        return saturation_cost(seq_len, kv_heads, head_dim, k, anchor_bytes, index_bytes_for(k, narrow_index), bits)

    if cost(n_anchors) > budget:
        return n_anchors
    lo, hi = n_anchors, seq_len  # cost(lo) fits; find the last k that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
