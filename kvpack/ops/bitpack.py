"""Bit-packing of unsigned integer codes of 1, 2, 4 or 8 bits into uint8 (real low-bit storage).

Codes are packed along the last axis, ``8 // bits`` per byte, the first code in the lowest bits;
the last axis is zero-padded to a whole byte.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` uint8 codes in ``[0, 2**bits)`` -> ``[..., ceil(n * bits / 8)]`` uint8."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects uint8 codes, got {codes.dtype}")
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for a last axis of ``n`` codes."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
