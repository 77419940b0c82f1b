"""Symmetric INT4 quantization with real 4-bit storage (two codes per uint8).

Codes are integers in [-7, 7] (symmetric, zero exactly representable), stored offset by 8 as
nibbles; the low nibble holds the even element. Scales are one per slice along the reduced axis,
kept in fp16 (2 bytes each, counted by the stores).
"""

from __future__ import annotations

import torch

INT4_MAX = 7


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values ``[..., n]`` (uint8 in [0, 15]) into ``[..., ceil(n/2)]`` uint8."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., ceil(n/2)]`` uint8 -> ``[..., n]`` uint8."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    return out[..., :n]


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 with one scale per slice reduced over ``dim``.

    ``dim`` is the axis the max is taken over: for a matrix ``[rows, cols]``, ``dim=-2`` gives one
    scale per column ("column-wise"), ``dim=-1`` one per row ("row-wise").

    Returns:
        ``(packed, scale)``: ``packed`` uint8 ``[..., ceil(cols/2)]`` (codes packed along the last
        axis), ``scale`` fp16 with ``dim`` kept as size 1.
    """
    xf = x.float()
    # The scale is stored in fp16; values that round past INT4_MAX after that rounding are clamped.
    scale = (xf.abs().amax(dim=dim, keepdim=True) / INT4_MAX).to(torch.float16)
    scale_f = scale.float()
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = torch.round(xf / safe).clamp(-INT4_MAX, INT4_MAX).to(torch.int16) + 8
    return pack_nibbles(codes.to(torch.uint8)), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_int4` for a last axis of length ``n``."""
    codes = unpack_nibbles(packed, n).to(torch.int16) - 8
    return (codes.to(dtype) * scale.to(dtype))
