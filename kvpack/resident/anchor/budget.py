"""AnchorKV's byte budget (Eq. 9): what the anchors and metadata cost (``M_base``) and how many
2-bit residuals the rest of ``θ M_full`` buys. Pure functions of sizes; the layout they count is
described in :mod:`kvpack.attention.anchor`."""

from __future__ import annotations

import math

from ...attention.anchor import PREFIX_BLOCK
from ...ops.accounting import dense_bf16_bytes
from ...ops.residual_codec import ResidualCodec


def residual_bytes(head_dim: int) -> int:
    """``b_res``: packed 2-bit codes of one residual plus its scale."""
    return ResidualCodec.bytes_per_residual(head_dim)


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


def anchors_above_saturation(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                             anchor_bytes: int = 2, narrow_index: bool = False) -> int:
    """Beyond the paper (``anchor_plus``): the anchors a budget above the 2-bit saturation point buys.

    At ``k = n_anchors``, ``θ M_full`` may buy a residual for every non-anchor token-side and leave
    bytes unspent (Eq. 9 has nothing more to buy: AnchorKV's budget curve stops there). Each further
    anchor stores one more token exactly in place of its residual, for a net
    ``2 H (D · anchor_bytes − b_res)`` bytes; this returns the largest ``k ≥ n_anchors`` (at most
    ``seq_len``) whose anchors, metadata and a residual for every remaining token-side fit
    ``θ M_full``, or ``n_anchors`` when the budget does not reach saturation. The cost is
    non-decreasing in ``k`` (the uint8 → int16 index step at 257 anchors included), so a bisection
    finds it.
    """
    budget = theta * dense_bf16_bytes(seq_len, kv_heads, head_dim)

    def cost(k: int) -> int:
        index = index_bytes_for(k, narrow_index)
        return (base_bytes(seq_len, kv_heads, head_dim, k, anchor_bytes, index)
                + 2 * kv_heads * (seq_len - k) * residual_bytes(head_dim))

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
