"""Uniform quantization of groups of consecutive coefficients with a 16-bit shift and scale each.

This is kvtc's quantizer (microscaling-style): for one token, a group of ``g`` consecutive PCA
coefficients is coded at ``w`` bits as ``q = round((x - shift) / scale)`` with ``shift`` the group's
minimum and ``scale = (max - min) / (2**w - 1)``, both rounded to fp16 (16 bits each) *before*
coding so that the decoder, which only sees the fp16 values, inverts exactly what was coded.
``w = 0`` stores nothing: the coefficients decode as 0, the PCA mean.
"""

from __future__ import annotations

import torch

SHIFT_SCALE_DTYPE = torch.float16
FP16_MAX = 65504.0


def quantize_groups(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Code ``x [..., g]`` (one group per leading index) at ``width`` bits (1..8).

    Returns:
        ``(codes [..., g] uint8, shift [...] fp16, scale [...] fp16)``.

    Raises:
        ValueError: a coefficient is NaN/Inf or beyond the fp16 range of the shift/scale.
    """
    if not 1 <= width <= 8:
        raise ValueError(f"width must be in 1..8, got {width}")
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("cannot quantize NaN or Inf coefficients")
    if max(float(hi.abs().max()), float(lo.abs().max())) > FP16_MAX / 2:
        raise ValueError(f"coefficient magnitude {float(x.abs().max()):.3g} exceeds the fp16 shift/scale range")
    levels = (1 << width) - 1
    shift = lo.to(SHIFT_SCALE_DTYPE)
    # The range is measured from the fp16 shift so that the top level still reaches the maximum.
    scale = ((hi - shift.float()) / levels).to(SHIFT_SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, ((x.float() - shift.float().unsqueeze(-1)) / safe).round(), torch.zeros_like(x.float()))
    return codes.clamp_(0, levels).to(torch.uint8), shift, scale


def dequantize_groups(codes: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``[..., g]`` fp32."""
    return codes.float() * scale.float().unsqueeze(-1) + shift.float().unsqueeze(-1)


def group_squared_errors(x: torch.Tensor, width: int) -> torch.Tensor:
    """Squared error of coding each group of ``x [..., g]`` at ``width`` bits (0 = dropped),
    summed over the group: ``[...]`` fp64."""
    if width == 0:
        return x.double().pow(2).sum(-1)
    codes, shift, scale = quantize_groups(x, width)
    return (dequantize_groups(codes, shift, scale) - x.float()).double().pow(2).sum(-1)
