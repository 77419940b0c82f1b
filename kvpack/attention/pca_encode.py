"""The block coding of ``pca_quant`` (``kvpack::pca_quant_encode``): one (side, KV head)'s coefficients of whole
blocks to its codes, scales and zero points, in the layout :class:`~kvpack.attention.pca_blocks.PCABlocks` reads.

Per block of ``G`` tokens and coded component ``j`` (widths ``w_j`` non-increasing, 1..8): min/max codes with an
fp16 zero point rounded down and an fp16 scale rounded up (:func:`~kvpack.ops.minmax.quantize_minmax`), then the
``G`` codes of each component packed into its width's bit stream, component-major, little-endian
(:func:`~kvpack.ops.bitpack.pack_bitstream_fast`; ``G · w_j`` bits are whole bytes, so component ``j``'s codes
start at byte ``G · Σ_{i<j} w_i / 8`` of the block's run).

The default implementation is the PyTorch path below; the CPU kernel (``cpu/csrc/pca_encode.cpp``) does it in one
pass per block with the same fp32 arithmetic — the same bits (``tests/test_pca_quant.py`` checks it).
"""

from __future__ import annotations

import torch

from ..ops.bitpack import pack_bitstream_fast
from ..ops.minmax import quantize_minmax
from .pca_blocks import width_groups


@torch.library.custom_op("kvpack::pca_quant_encode", mutates_args=())
def pca_quant_encode(coefficients: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """``(codes [blocks, R] uint8, scale [blocks, C] fp16, zero [blocks, C] fp16)`` of ``coefficients [blocks, G,
    C]`` fp32 coded at ``widths [C]`` int32 (``R = G · Σ w / 8``). Default implementation: the PyTorch path."""
    return encode_blocks_reference(coefficients, widths)


def encode_blocks_reference(coefficients: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    """The PyTorch path of :func:`pca_quant_encode` (its default implementation, callable on its own)."""
    codes, scale, zero = quantize_minmax(coefficients, dim=1, bits=widths.to(torch.int64).to(coefficients.device))
    runs = width_groups(widths.reshape(1, 1, -1))[0]
    return pack_width_runs(codes.transpose(1, 2), runs), scale[:, 0], zero[:, 0]


def pack_width_runs(codes: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``codes [blocks, C, G]`` uint8 (component-major) packed into one stream per ``(width, count)`` run, widest
    first, each block's streams side by side: ``[blocks, G · Σ w / 8]`` uint8."""
    blocks = codes.shape[0]
    packed, j = [], 0
    for width, count in runs:
        # each block's stream is whole bytes (G % 8 == 0)
        packed.append(pack_bitstream_fast(codes[:, j:j + count].contiguous(), width).reshape(blocks, -1))
        j += count
    return torch.cat(packed, dim=1) if packed else codes.new_empty(blocks, 0)


@pca_quant_encode.register_fake
def _(coefficients, widths):
    blocks, G, C = coefficients.shape
    R = torch.library.get_ctx().new_dynamic_size()
    return (coefficients.new_empty(blocks, R, dtype=torch.uint8), coefficients.new_empty(blocks, C, dtype=torch.half),
            coefficients.new_empty(blocks, C, dtype=torch.half))

