"""Attention over AnchorKV segments, tile by tile (AnchorKV §2, decode path), and the segment view.

An :class:`AnchorSegment` is what a store hands to attention: exactly the tensors and sizes the
PyTorch tiles and the Triton kernel read, nothing of the store itself. Each tile of ``tile``
positions has its keys reconstructed from anchors, coefficients, anchor indices and the tile's
2-bit residuals and rotated by RoPE at their positions (:func:`tile_keys`); the values are never
reconstructed: the weighted sum over the tile is taken on the stored form (:func:`tile_value_sum`:
probabilities scattered into anchor bins, residuals summed in the codec's rotated domain). Only one
tile of keys is ever materialised, so the transient memory is ``O(tile)``, not ``O(S)``.

Layout of one side (keys or values) of a segment of ``n`` tokens, ``H`` KV heads, head dim ``D``:
``index [H, n]`` int16 or uint8 (the token's anchor), ``coef [H, n]`` fp16 (γ), ``mask`` packed
bits ``[H, ⌈n/8⌉]`` (which tokens have a residual), ``prefix [H, ⌈n/32⌉]`` int32 (slot of the
first residual of each 32-token block, counted over all heads before it), ``res [slots, D/4]``
uint8 (2-bit codes, head-major slots) and ``scale [slots]`` fp32.

Beyond the paper (``anchor_plus``), a side may also hold a **fine tier**: the same four tensors for
the token-sides whose residual is coded in 4 bits (``res [slots, D/2]``) instead of 2. A token-side
has at most one residual (its bit is set in at most one of the two masks); both tiers are coded with
the same rotation, so their residuals share one rotated domain (summed there, unrotated once).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.bitpack import unpack_bits
from ..ops.residual_codec import ResidualCodec
from ..ops.rope import RotaryTable, apply_rope
from .softmax_merge import PartialAttention, state_from_logits

PREFIX_BLOCK = 32  # tokens per prefix count (a tile must start on a multiple of it)

# The tensors of ``kvpack::anchor_segment_attention``'s ``segment`` operand, in order
# (:meth:`AnchorSegment.operands` flattens a segment into them; the Triton launcher reads them by these names and
# the C++ kernel's ``AnchorOperands`` by these positions). The fine tier's nine are empty when it has none.
SEGMENT_OPERANDS = (
    "anchor_k", "anchor_v", "hmat", "signs", "cos", "sin",
    "index_k", "coef_k", "mask_k", "prefix_k", "res_k", "scale_k",
    "index_v", "coef_v", "mask_v", "prefix_v", "res_v", "scale_v",
    "fine_mask_k", "fine_prefix_k", "fine_res_k", "fine_scale_k",
    "fine_mask_v", "fine_prefix_v", "fine_res_v", "fine_scale_v", "fine_levels",
)


@dataclass(frozen=True)
class FineResiduals:
    """The fine (4-bit) tier of one side: ``mask [H, ⌈n/8⌉]`` packed bits, ``prefix [H, ⌈n/32⌉]``
    int32, ``res [slots, D/2]`` uint8 (packed 4-bit codes, head-major slots), ``scale [slots]`` fp32."""

    mask: torch.Tensor
    prefix: torch.Tensor
    res: torch.Tensor
    scale: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(mask, prefix, res, scale)``, the order the kernel takes them in."""
        return self.mask, self.prefix, self.res, self.scale


@dataclass(frozen=True)
class AnchorSide:
    """One side (keys pre-RoPE, or values) of a segment; layouts in the module doc. ``fine``: the
    4-bit tier (``anchor_plus`` above the 2-bit saturation point), or None (the paper's layout)."""

    index: torch.Tensor
    coef: torch.Tensor
    mask: torch.Tensor
    prefix: torch.Tensor
    res: torch.Tensor
    scale: torch.Tensor
    fine: FineResiduals | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(index, coef, mask, prefix, res, scale)``, the order the kernel takes them in."""
        return self.index, self.coef, self.mask, self.prefix, self.res, self.scale

    def tiers(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(mask, prefix, res, scale)`` of each residual tier held: the 2-bit one, then the fine one."""
        tiers = [(self.mask, self.prefix, self.res, self.scale)]
        if self.fine is not None:
            tiers.append(self.fine.tensors())
        return tiers


@dataclass(frozen=True)
class AnchorSegment:
    """One compressed AnchorKV segment as attention reads it.

    Attributes:
        anchor_k, anchor_v: ``[H, k, D]`` anchor keys (pre-RoPE) and values (the layer's, shared by
            its segments).
        keys, values: the two sides.
        start: position of the segment's first token; ``length``: its tokens ``n``.
        codec: the residual codec (rotation, levels) the 2-bit residuals were coded with.
        rope: the layer's RoPE table (keys are rotated to ``start + t``).
        tile: tokens per PyTorch attention tile (a multiple of 32).
        fine_codec: the 4-bit codec of the fine tier (same rotation as ``codec``), or None when no
            side has a fine tier.
    """

    anchor_k: torch.Tensor
    anchor_v: torch.Tensor
    keys: AnchorSide
    values: AnchorSide
    start: int
    length: int
    codec: ResidualCodec
    rope: RotaryTable
    tile: int
    fine_codec: ResidualCodec | None = None

    def side(self, name: str) -> AnchorSide:
        return self.keys if name == "k" else self.values

    def operands(self, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """The segment as ``kvpack::anchor_segment_attention``'s ``segment`` operand (:data:`SEGMENT_OPERANDS`),
        on the anchors' device, with the shared RoPE tables ``cos``/``sin`` (``RotaryTable.table``)."""
        dev = self.anchor_k.device
        tables = self.codec.on(dev)
        none = torch.empty(0, device=dev)
        fine = [*self.keys.fine.tensors(), *self.values.fine.tensors(), self.fine_codec.on(dev).levels] \
            if self.fine_codec is not None else [none] * 9
        return [self.anchor_k, self.anchor_v, tables.kernel_matrix, tables.signs, cos, sin, *self.keys.tensors(),
                *self.values.tensors(), *fine]

    def tier_codecs(self) -> list[ResidualCodec]:
        """The codec of each tier :meth:`AnchorSide.tiers` lists (2-bit, then the fine one)."""
        return [self.codec] if self.fine_codec is None else [self.codec, self.fine_codec]

    def tiles(self) -> Iterator[tuple[int, int]]:
        """``(lo, hi)`` of every attention tile, in position order."""
        for lo in range(0, self.length, self.tile):
            yield lo, min(lo + self.tile, self.length)


def tile_residuals(seg: AnchorSegment, side: str, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tile's stored residuals of one side, one ``(where, rotated)`` per tier that has any in the
    tile: flat ``head * n + token`` positions ``[N]`` (head-major, ascending) and the residuals in the
    codecs' shared rotated domain ``[N, D]``. ``lo`` must be a multiple of 32."""
    s = seg.side(side)
    H = s.index.shape[0]
    n = hi - lo
    found = []
    for (mask_bits, prefix, res, scale), codec in zip(s.tiers(), seg.tier_codecs()):
        # lo is a multiple of 32: the tile's bits start on a byte boundary.
        mask = unpack_bits(mask_bits[:, lo // 8: (hi + 7) // 8], 1, n).bool()
        where = mask.flatten().nonzero().squeeze(-1)
        if not where.numel():
            continue
        # Slot = prefix count of the token's 32-token block + residuals before it in the block.
        padded = F.pad(mask, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).int()
        before = (padded.cumsum(-1) - padded).reshape(H, -1)[:, :n]
        blocks = prefix[:, lo // PREFIX_BLOCK: lo // PREFIX_BLOCK + padded.shape[1]]
        slots = (blocks.repeat_interleave(PREFIX_BLOCK, dim=1)[:, :n] + before).flatten().index_select(0, where).long()
        found.append((where, codec.rotated(res.index_select(0, slots), scale.index_select(0, slots))))
    return found


def scaled_anchors(seg: AnchorSegment, side: str, lo: int, hi: int, anchors: torch.Tensor) -> torch.Tensor:
    """``γ_t a_{i_t}`` ``[H, n, D]`` fp32 for the tile; ``anchors`` ``[H, k, D]`` fp32."""
    H, k, D = anchors.shape
    s = seg.side(side)
    # One flat row lookup (faster than gather with an expanded index): row h*k + index.
    rows = (s.index[:, lo:hi].long() + torch.arange(H, device=anchors.device)[:, None] * k).flatten()
    x = anchors.reshape(H * k, D).index_select(0, rows).reshape(H, hi - lo, D)
    return x.mul_(s.coef[:, lo:hi, None].float())


def tile_side(seg: AnchorSegment, side: str, lo: int, hi: int, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstructed ``x̂ = γ a + r̃`` ``[H, n, D]`` fp32 of one side (keys still pre-RoPE)."""
    if anchors is None:
        anchors = (seg.anchor_k if side == "k" else seg.anchor_v).float()
    H, _, D = anchors.shape
    n = hi - lo
    x = scaled_anchors(seg, side, lo, hi, anchors)
    tiers = tile_residuals(seg, side, lo, hi)
    if tiers:  # the tiers share the rotation: unrotate all their residuals at once
        where = torch.cat([w for w, _ in tiers])
        residuals = seg.codec.unrotate(torch.cat([r for _, r in tiers]))
        x = x.reshape(H * n, D).index_add_(0, where, residuals).reshape(H, n, D)
    return x


def tile_keys(seg: AnchorSegment, lo: int, hi: int, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """Post-RoPE keys ``[H, hi − lo, D]`` fp32 of tokens ``[lo, hi)`` of a segment (``lo`` a
    multiple of 32); ``anchors``: ``anchor_k`` as fp32, when the caller converted it once."""
    x = tile_side(seg, "k", lo, hi, anchors)
    cos, sin = seg.rope.cos_sin(torch.arange(seg.start + lo, seg.start + hi, device=x.device))
    return apply_rope(x, cos, sin)


def tile_value_sum(seg: AnchorSegment, lo: int, hi: int, p: torch.Tensor,
                   anchors: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_t p[h, i, t] v̂_t`` ``[H, rows, D]`` for weights ``p [H, rows, hi − lo]``, without
    reconstructing the values: ``v̂_t = γ_t a_{i_t} + r̃_t`` is linear, so the anchor part is
    ``(Σ_{t: i_t = j} p_t γ_t) a_j`` (a scatter into k bins, then ``[rows, k] × [k, D]``), and the
    residual part sums the rotated-domain residuals and unrotates once per row."""
    if anchors is None:
        anchors = seg.anchor_v.float()
    H, rows, n = p.shape
    s = seg.values
    weights = p * s.coef[:, lo:hi].float()[:, None, :]
    index = s.index[:, lo:hi].long()[:, None, :].expand(-1, rows, -1)
    bins = torch.zeros(H, rows, anchors.shape[1], dtype=p.dtype, device=p.device).scatter_add_(2, index, weights)
    out = torch.bmm(bins, anchors)
    tiers = tile_residuals(seg, "v", lo, hi)
    if tiers:
        summed = torch.zeros(H, rows, anchors.shape[2], dtype=p.dtype, device=p.device)
        p_flat = p.permute(0, 2, 1).reshape(H * n, rows)
        for where, rotated in tiers:  # summed in the shared rotated domain, unrotated once
            p_res = p_flat.index_select(0, where)  # [N, rows]
            counts = torch.bincount(where // n, minlength=H).tolist()
            offset = 0
            for h, c in enumerate(counts):  # where is head-major: each head's residuals are contiguous
                if c:
                    summed[h] += p_res[offset: offset + c].T @ rotated[offset: offset + c]
                    offset += c
        out += seg.codec.unrotate(summed)
    return out


def reconstruct_tile(seg: AnchorSegment, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (post-RoPE) and values ``[H, hi − lo, D]`` fp32 of tokens ``[lo, hi)`` of a segment.

    ``lo`` must be a multiple of 32. Only this tile is materialised (tests and inspection).
    """
    return tile_keys(seg, lo, hi), tile_side(seg, "v", lo, hi)


def anchor_tile_partials(segments: list[AnchorSegment], qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
    """Partial states of grouped queries ``[kv_heads, rows, d]`` (fp32) over the segments, one per tile."""
    if not segments:
        return []
    anchors_k = segments[0].anchor_k.float()  # converted once per call, not per tile
    anchors_v = segments[0].anchor_v.float()
    q = qg.float()
    states = []
    for seg in segments:
        for lo, hi in seg.tiles():
            k = tile_keys(seg, lo, hi, anchors_k)
            s = torch.einsum("hid,htd->hit", q, k) * scaling
            states.append(state_from_logits(
                s, lambda p, sg=seg, a=lo, b=hi: tile_value_sum(sg, a, b, p, anchors_v)))
    return states
