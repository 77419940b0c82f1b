"""Randomized Hadamard rotation: ``y = H (s ⊙ x)`` with ``H`` the orthonormal Sylvester–Hadamard
matrix and ``s`` seeded random signs. Orthonormal, so ``x = s ⊙ (Hᵀ y)`` inverts it exactly (up to
floating point). It spreads a vector's energy evenly over coordinates, making them close to
Gaussian — which is what a Gaussian Lloyd–Max codebook expects.
"""

from __future__ import annotations

import math

import torch


def hadamard_matrix(dim: int, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal ``[dim, dim]`` Sylvester–Hadamard matrix (``dim`` a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two dimension, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(dtype)


class RandomizedHadamard:
    """The rotation ``x -> H (s ⊙ x)`` over the last axis, with signs from ``seed`` (applied by
    ``kvpack.ops.residual_codec.HadamardLloydMax``, which keeps the matrix and signs per device)."""

    def __init__(self, dim: int, seed: int):
        self.matrix = hadamard_matrix(dim)
        gen = torch.Generator().manual_seed(seed)
        self.signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
