"""Bit-packing of unsigned integer codes of 1, 2, 4 or 8 bits into uint8 (real low-bit storage).

Codes are packed along the last axis, ``8 // bits`` per byte, the first code in the lowest bits;
the last axis is zero-padded to a whole byte. :func:`pack_bitstream` packs any width 1..8 into one
continuous stream (widths that do not divide 8 straddle bytes).
"""

from __future__ import annotations

import numpy as np
import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` uint8 codes in ``[0, 2**bits)`` -> ``[..., ceil(n * bits / 8)]`` uint8."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects uint8 codes, got {codes.dtype}")
    per = 8 // bits
    if codes.numel() == 0:  # e.g. no residual got a slot: keep the shape, hold nothing
        return torch.empty(*codes.shape[:-1], (codes.shape[-1] + per - 1) // per, dtype=torch.uint8,
                           device=codes.device)
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


def pack_bitstream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Any width 1..8: ``codes`` (uint8, any shape, values < ``2**bits``) flattened into one stream of
    ``bits``-bit fields, little-endian within each byte, zero-padded to a whole byte.

    Returns ``[ceil(codes.numel() * bits / 8)]`` uint8.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bitstream expects uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1).cpu().numpy()
    planes = np.unpackbits(flat[:, None], axis=1, bitorder="little")[:, :bits]  # [n, bits], LSB first
    return torch.from_numpy(np.packbits(planes.reshape(-1), bitorder="little"))


def pack_bitstream_fast(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bitstream` in vectorised torch ops on ``codes``' device, for a multiple of 8 codes: eight
    codes of ``bits`` bits are exactly ``bits`` bytes, so each eight are summed into one 64-bit word
    (code ``k`` shifted by ``k · bits``) whose low ``bits`` bytes are the stream's. Returns
    ``[codes.numel() · bits / 8]`` uint8, the same bytes as :func:`pack_bitstream`."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_bitstream_fast expects uint8 codes, got {codes.dtype}")
    if codes.numel() % 8:
        raise ValueError(f"pack_bitstream_fast packs a multiple of 8 codes, got {codes.numel()}")
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (codes.reshape(-1, 8).to(torch.int64) << shifts).sum(dim=1)  # [n / 8], at most 64 bits used
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bitstream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitstream`: ``n`` codes ``[n]`` uint8 from a ``bits``-bit stream."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    need = (n * bits + 7) // 8
    if packed.numel() < need:
        raise ValueError(f"bit stream too short: {packed.numel()} bytes for {n} codes of {bits} bits")
    planes = np.unpackbits(packed.reshape(-1).cpu().numpy()[:need], bitorder="little")[: n * bits]
    codes = np.packbits(planes.reshape(n, bits), axis=1, bitorder="little")[:, 0]
    return torch.from_numpy(codes)


def unpack_bitstream_fast(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack_bitstream` in vectorised torch ops on ``packed``'s device (no NumPy round trip):
    code ``i`` sits at bit ``i · bits``; a code of at most 8 bits spans at most two bytes, so each is one
    16-bit window shifted and masked. Returns ``[n]`` uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    need = (n * bits + 7) // 8
    if packed.numel() < need:
        raise ValueError(f"bit stream too short: {packed.numel()} bytes for {n} codes of {bits} bits")
    stream = torch.cat([packed.reshape(-1)[:need], packed.new_zeros(1)]).to(torch.int32)
    first = torch.arange(n, device=packed.device, dtype=torch.int64) * bits
    byte, shift = first >> 3, (first & 7).to(torch.int32)
    word = stream[byte] | (stream[byte + 1] << 8)
    return ((word >> shift) & ((1 << bits) - 1)).to(torch.uint8)
