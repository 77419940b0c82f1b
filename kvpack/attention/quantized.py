"""Attention over KIVI's quantized blocks, straight from the codes (``kvpack::kivi_attention``).

:class:`QuantizedBlocks` is what a KIVI store hands to attention: bit-packed codes with fp16 scales
and zero points (keys per channel over a block of ``group`` tokens, values per token over groups of
``value_group`` channels; layouts below). The op's default implementation is the PyTorch path — each
tile of blocks dequantized to fp32 and attended densely; its CPU kernel is native code that reads the
codes in place (``cpu/csrc/kivi.cpp``: the logit of a block is ``(q · ks) · codes + q · kz``, the values
are weighted sums of codes, and no dequantized block exists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.bitpack import unpack_bits
from .softmax_merge import PartialAttention, dense_partial, merge_partials


def dequantize_minmax(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in fp32 (KIVI's asymmetric min/max codes)."""
    return codes.float() * scale.float() + zero.float()


@dataclass(frozen=True)
class QuantizedBlocks:
    """KIVI's quantized history of one layer (``H`` KV heads, ``B`` blocks of ``G = group`` tokens).

    Attributes:
        kq: ``[H, B, G, ceil(d * bits / 8)]`` uint8 key codes, packed along the channels.
        ks, kz: ``[H, B, 1, d]`` fp16 key scales and zero points (per channel per block).
        vq: ``[H, B, G, d / Gv, ceil(Gv * bits / 8)]`` uint8 value codes (``Gv = value_group``).
        vs, vz: ``[H, B, G, d / Gv, 1]`` fp16 value scales and zero points (per token per group).
        bits: 2 or 4; group: ``G``; value_group: ``Gv``; head_dim: ``d``.
        tile_blocks: blocks per PyTorch attention tile (bounds transient memory).
    """

    kq: torch.Tensor
    ks: torch.Tensor
    kz: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    vz: torch.Tensor
    bits: int
    group: int
    value_group: int
    head_dim: int
    tile_blocks: int = 64

    @property
    def n_blocks(self) -> int:
        return self.kq.shape[1] if self.kq.numel() else 0

    def dequantized(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of blocks ``[lo, hi)`` as ``[H, (hi - lo) * G, d]`` fp32."""
        d, H = self.head_dim, self.kq.shape[0]
        k = dequantize_minmax(unpack_bits(self.kq[:, lo:hi], self.bits, d), self.ks[:, lo:hi], self.kz[:, lo:hi])
        v = dequantize_minmax(unpack_bits(self.vq[:, lo:hi], self.bits, self.value_group), self.vs[:, lo:hi],
                              self.vz[:, lo:hi])
        return k.reshape(H, -1, d), v.reshape(H, -1, d)


def quantized_blocks_partials(blocks: QuantizedBlocks, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
    """The PyTorch path: states of ``qg [H, M, d]`` over the blocks, one per tile of dequantized blocks."""
    tile = blocks.tile_blocks
    return [dense_partial(qg, *blocks.dequantized(lo, min(lo + tile, blocks.n_blocks)), scaling)
            for lo in range(0, blocks.n_blocks, tile)]


BLOCKS_PER_SPLIT = 16  # quantized blocks per (head, split) job of the native kernel
TOKENS_PER_SPLIT = 512  # residual tokens per job


def _reference(q, kq, ks, kz, vq, vs, vz, tail_k, tail_v, bits, group, value_group, scaling):
    blocks = QuantizedBlocks(kq, ks, kz, vq, vs, vz, bits, group, value_group, q.shape[-1])
    states = quantized_blocks_partials(blocks, q, scaling) if kq.numel() else []
    if tail_k.shape[1]:
        states.append(dense_partial(q, tail_k, tail_v, scaling))
    if not states:
        H, M, D = q.shape
        return q.new_full((H, M), float("-inf")), q.new_zeros(H, M), q.new_zeros(H, M, D)
    st = merge_partials(states)
    return st.m, st.l, st.o


@torch.library.custom_op("kvpack::kivi_attention", mutates_args=())
def kivi_attention(q: torch.Tensor, kq: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor, vq: torch.Tensor,
                   vs: torch.Tensor, vz: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, bits: int,
                   group: int, value_group: int, scaling: float, blocks_per_split: int, tokens_per_split: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]`` over
    the quantized blocks (layouts in :class:`QuantizedBlocks`) and the dense residual ``tail_k, tail_v
    [H, T, D]``. Default implementation: the PyTorch path."""
    return _reference(q, kq, ks, kz, vq, vs, vz, tail_k, tail_v, bits, group, value_group, scaling)


@kivi_attention.register_fake
def _(q, kq, ks, kz, vq, vs, vz, tail_k, tail_v, bits, group, value_group, scaling, blocks_per_split, tokens_per_split):
    H, M, D = q.shape
    return q.new_empty(H, M), q.new_empty(H, M), q.new_empty(H, M, D)


def kivi_partial(blocks: QuantizedBlocks, qg: torch.Tensor, scaling: float, tail: tuple[torch.Tensor, torch.Tensor],
                 ) -> PartialAttention:
    """Merged state of ``qg [H, M, d]`` over the quantized blocks and the dense residual ``tail``, in one
    call of ``kvpack::kivi_attention``."""
    empty = torch.empty(0, dtype=torch.uint8)
    half = torch.empty(0, dtype=torch.float16)
    parts = (blocks.kq, blocks.ks, blocks.kz, blocks.vq, blocks.vs, blocks.vz) if blocks.n_blocks else \
        (empty, half, half, empty, half, half)
    m, l, o = kivi_attention(qg.float().contiguous(), *parts, *tail, blocks.bits, blocks.group, blocks.value_group,
                             float(scaling), BLOCKS_PER_SPLIT, TOKENS_PER_SPLIT)
    return PartialAttention(m, l, o)
