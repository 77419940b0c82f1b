"""Asymmetric min/max quantization with fp16 scale and zero point (KIVI's groups, pca_quant's blocks).

The zero point is rounded down to fp16 and the scale up, so every value of a group lies in
``[zero, zero + (2**bits - 1) * scale]`` and the error is at most ``scale / 2``.
"""

from __future__ import annotations

import torch


def fp16_zero_point(lo: torch.Tensor) -> torch.Tensor:
    """``lo`` (fp32) rounded to fp16, downwards: every value ``>= lo`` is ``>=`` the zero point."""
    zero = lo.half()
    return torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -float("inf"))), zero)


def fp16_scale(step: torch.Tensor) -> torch.Tensor:
    """``step`` (fp32) rounded to fp16, upwards: the top level stays at or above the range's top."""
    scale = step.half()
    return torch.where(scale.float() < step, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


def quantize_minmax(x: torch.Tensor, dim: int,
                    bits: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization with fp16 scale/zero reduced over ``dim`` (kept as size 1).

    The fp16 zero point is rounded down and the fp16 scale up, so every value lies in
    ``[zero, zero + (2**bits - 1) * scale]`` and the error is at most ``scale / 2``. ``bits`` is one width,
    or a tensor of widths that broadcasts against ``x`` (e.g. one per column of the last axis).

    Returns:
        ``(codes uint8, scale fp16, zero fp16)``.
    """
    levels = (1 << bits) - 1
    if isinstance(levels, torch.Tensor):
        levels = levels.to(device=x.device, dtype=torch.float32)
    xf = x.float()
    lo, hi = torch.aminmax(xf, dim=dim, keepdim=True)  # one pass (amin then amax was two strided ones)
    zero = fp16_zero_point(lo)
    step = (hi - zero.float()) / levels
    scale = fp16_scale(step)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(step))
    codes = torch.round((xf - zero.float()) / safe).clamp_min(0)
    codes = torch.minimum(codes, levels) if isinstance(levels, torch.Tensor) else codes.clamp_max(levels)
    codes = codes.to(torch.uint8)
    return codes, scale, zero
