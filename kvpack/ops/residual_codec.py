"""AnchorKV's residual codecs: the paper's (randomized Hadamard + Lloyd–Max) and the naive ablation.

Both store, per residual ``r [D]``, ``D · bits / 8`` bytes of packed codes and one fp32 scale, and
decode as ``x̂ = (scale · levels[codes]) Hᵀ ⊙ signs`` — the Triton kernel reads ``levels``,
``matrix`` and ``signs`` and does the same for either codec. The paper's residuals are 2-bit
(``bits = 2``, the default); ``anchor_plus``'s fine tier (beyond the paper) codes its residuals in 4
bits with the same rotation, so residuals of both tiers share one rotated domain.

- :class:`HadamardLloydMax` (the paper, §3.4): rotate with a seeded randomized Hadamard transform,
  scale by the RMS ``‖r‖ / √D`` (the rotated coordinates are then near N(0, 1)), code with the 4-level
  Lloyd–Max quantizer of N(0, 1).
- :class:`NaiveTwoBit` (the "naive 2-bit" ablation of Fig. 5): no rotation, per-residual absmax
  scale, ``2^bits`` evenly spaced levels over ``[−absmax, absmax]`` (2 bits: ``absmax · {−1, −⅓, ⅓,
  1}``), round to nearest.

Levels are rounded once to fp16-representable values (11 significant bits: ±0.452881, ±1.510742 for
2-bit Lloyd–Max instead of ±0.452780, ±1.510418; the Gaussian MSE 0.1174818 changes by 2e-8, the
optimum being flat; at 4 bits it is 0.0095010 and changes by 3e-8), and thresholds sit at their
midpoints. Decoding is then exact in a GPU kernel's fp16 tensor-core products: levels × the ±1
Hadamard matrix (:attr:`ResidualCodec.kernel_matrix`) in fp32 accumulation.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import lloyd_max
from .bitpack import pack_bits
from .hadamard import RandomizedHadamard

BITS = 2  # the paper's residuals
FINE_BITS = 4  # anchor_plus's fine tier (beyond the paper)
SCALE_BYTES = 4  # fp32 per-residual scale


def fp16_exact(levels) -> tuple[float, ...]:
    """``levels`` rounded to the nearest fp16 values (as Python floats)."""
    return tuple(float(x) for x in torch.tensor(levels, dtype=torch.float64).half().double())


def midpoints(levels) -> tuple[float, ...]:
    """Nearest-level thresholds between consecutive ascending levels."""
    return tuple((a + b) / 2 for a, b in zip(levels, levels[1:]))


@functools.lru_cache(maxsize=8)
def _packed_table(levels: tuple[float, ...], bits: int, device_type: str) -> torch.Tensor:
    """``[256, 8 / bits]`` levels of every byte of packed ``bits``-bit codes (first code in the lowest bits)."""
    byte = torch.arange(256)[:, None]
    codes = (byte >> (torch.arange(8 // bits)[None, :] * bits)) & (2 ** bits - 1)
    return torch.tensor(levels)[codes].to(device_type)


class DeviceTables(NamedTuple):
    """A codec's tables on one device (:meth:`ResidualCodec.on`)."""

    matrix: torch.Tensor  # [D, D] rotation
    signs: torch.Tensor  # [D]
    kernel_matrix: torch.Tensor  # [D, D] fp16, entries exactly 0/±1 (ResidualCodec.kernel_matrix)
    levels: torch.Tensor  # [2^bits] fp32 (fp16 values): the kernel's table of the fine tier's levels


class ResidualCodec:
    """Shared decode path: levels from packed codes, times the scale, through the inverse rotation."""

    name = ""
    levels: tuple[float, ...] = ()
    thresholds: tuple[float, ...] = ()

    def __init__(self, dim: int, bits: int = BITS):
        if bits not in (BITS, FINE_BITS):
            raise ValueError(f"residual codes must have {BITS} or {FINE_BITS} bits, got {bits}")
        self.dim = dim
        self.bits = bits
        self._on_device: dict[torch.device, DeviceTables] = {}

    @staticmethod
    def bytes_per_residual(dim: int, bits: int = BITS) -> int:
        """``b_res``: packed codes plus the scale."""
        return dim * bits // 8 + SCALE_BYTES

    # Subclasses: rotation (matrix [D, D], signs [D]) and the scale of a rotated residual.
    matrix: torch.Tensor
    signs: torch.Tensor
    rotates = True

    def _scale(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rotate(self, r: torch.Tensor) -> torch.Tensor:
        """Residual domain ``[..., D]`` -> the rotated domain the codes quantize (fp32); inverted by
        :meth:`unrotate`."""
        if not self.rotates:
            return r.float()
        # H is symmetric, so x @ H == (H xᵀ)ᵀ.
        tables = self.on(r.device)
        return (r.float() * tables.signs) @ tables.matrix

    def encode(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``r [n, D]`` -> packed codes ``[n, D · bits / 8]`` uint8 and fp32 scales ``[n]``."""
        y = self.rotate(r)
        scale = self._scale(y)
        unit = y / scale.clamp_min(1e-30)[:, None]
        # The code of a value is the number of thresholds below it (torch.bucketize's answer, right=False):
        # one vectorised compare per threshold, 2-5x faster than bucketize's per-element binary search
        # here (3 or 15 thresholds; measured on 6,000 x 64 residuals).
        codes = torch.zeros(unit.shape, dtype=torch.uint8, device=r.device)
        for threshold in self.thresholds:
            codes += unit > threshold
        return pack_bits(codes, self.bits), scale

    def rotated(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Packed codes ``[n, D · bits / 8]`` and scales ``[n]`` -> the residuals in the rotated domain ``[n, D]``."""
        table = _packed_table(self.levels, self.bits, codes.device.type)
        # index_select, not table[codes]: advanced indexing is several times slower on CPU.
        levels = table.index_select(0, codes.reshape(-1).long()).reshape(codes.shape[0], -1)
        return levels[:, : self.dim] * scale.float()[:, None]

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Rotated domain ``[..., D]`` -> residual domain. Linear, so it commutes with weighted sums:
        attention sums rotated value residuals first and unrotates once per query row."""
        if not self.rotates:
            return y
        # H is symmetric: inverse of x -> H (s ⊙ x) is y -> s ⊙ (H y).
        tables = self.on(y.device)
        return (y @ tables.matrix) * tables.signs

    def decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Packed codes ``[n, D · bits / 8]`` and scales ``[n]`` -> residuals ``[n, D]`` fp32."""
        return self.unrotate(self.rotated(codes, scale))

    def on(self, device: torch.device) -> DeviceTables:
        """The codec's tables on ``device`` (rotation, signs, kernel matrix M16, levels), copied there
        once and kept: a decode step then moves nothing from the host (a per-step host-to-device copy
        would also stall the GPU and break CUDA-graph capture)."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = DeviceTables(
                self.matrix.to(device), self.signs.to(device), self.kernel_matrix[0].to(device),
                torch.tensor(self.levels, dtype=torch.float32, device=device))
        return self._on_device[device]

    @functools.cached_property
    def kernel_matrix(self) -> tuple[torch.Tensor, float]:
        """``(M16 [D, D] fp16, factor)`` with ``matrix = factor · M16`` and every entry of ``M16`` exactly
        -1, 0 or 1 (the Hadamard's ``±1/√D`` as ``±1`` times ``1/√D``; the identity as itself), so a
        kernel multiplies fp16 levels by it on tensor cores with no rounding."""
        factor = float(self.matrix.abs().max())
        m16 = torch.round(self.matrix / factor)
        if not torch.allclose(m16 * factor, self.matrix, rtol=0, atol=1e-6):
            raise ValueError(f"the {self.name} rotation is not a multiple of a 0/±1 matrix")
        return m16.half(), factor


class HadamardLloydMax(ResidualCodec):
    """The paper's codec: randomized Hadamard rotation (seeded signs), RMS scale, Gaussian Lloyd–Max
    levels (``2^bits`` of them; the rotation depends on ``seed`` only, not on ``bits``)."""

    name = "hadamard_lloyd_max"

    def __init__(self, dim: int, seed: int, bits: int = BITS):
        super().__init__(dim, bits)
        rot = RandomizedHadamard(dim, seed=seed)
        self.matrix, self.signs = rot.matrix, rot.signs
        self.levels = fp16_exact(lloyd_max.lloyd_max_gaussian(2 ** bits)[0])
        self.thresholds = midpoints(self.levels)

    def _scale(self, y):
        # The RMS puts the rotated coordinates at unit variance, where the N(0, 1) codebook is optimal.
        return y.norm(dim=-1) / math.sqrt(self.dim)


class NaiveTwoBit(ResidualCodec):
    """The naive ablation: no rotation, absmax scale, ``2^bits`` evenly spaced levels over
    ``[−absmax, absmax]`` (the name is the paper's ablation; ``bits = 4`` is the fine tier's form)."""

    name = "naive"
    rotates = False

    def __init__(self, dim: int, bits: int = BITS):
        super().__init__(dim, bits)
        n = 2 ** bits
        self.levels = fp16_exact(tuple(-1.0 + 2.0 * i / (n - 1) for i in range(n)))
        self.thresholds = midpoints(self.levels)
        self.matrix = torch.eye(dim)
        self.signs = torch.ones(dim)

    def _scale(self, y):
        return y.abs().amax(dim=-1)


RESIDUAL_CODECS = ("hadamard_lloyd_max", "naive")


def make_residual_codec(name: str, dim: int, seed: int, bits: int = BITS) -> ResidualCodec:
    """The named codec with ``bits``-bit codes; codecs of one ``(name, dim, seed)`` share their rotation."""
    if name == "hadamard_lloyd_max":
        return HadamardLloydMax(dim, seed, bits)
    if name == "naive":
        return NaiveTwoBit(dim, bits)
    raise ValueError(f"residual codec must be one of {RESIDUAL_CODECS}, got {name!r}")
