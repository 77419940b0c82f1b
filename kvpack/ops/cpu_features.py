"""What this CPU multiplies natively, from torch's own probes (each False where this torch has no probe).

Used where a half-precision product is only fast with hardware support: kvtc's inverse PCA
(``storage/kvtc/coder.py``) and a half-precision model's linear layers (``hf/half_linear.py``).
"""

from __future__ import annotations

import torch


def _probe(name: str) -> bool:
    try:
        return bool(getattr(torch.cpu, name)())
    except AttributeError:  # an older or newer torch without the probe: assume not
        return False


def has_amx() -> bool:
    """Whether this CPU has AMX tiles."""
    return _probe("_is_amx_tile_supported")


def has_bf16_gemm() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU: AMX tiles, or AVX-512 BF16 (``vdpbf16ps``,
    two products per fp32 lane). Elsewhere (AVX2, AVX-512 without BF16) the CPU has no bf16 product
    instruction and torch's bf16 matmul converts element by element (measured on a Zen 1 AVX2 EPYC:
    5.2 GFLOP/s against fp32's 33.1 on one core, ``[2048, 576] @ [576, 1536]``)."""
    return has_amx() or _probe("_is_avx512_bf16_supported")


def has_fp16_gemm() -> bool:
    """Whether this CPU multiplies fp16 natively (AMX-FP16 tiles; torch has no AVX512-FP16 probe, so a CPU
    with only AVX512-FP16 counts as without)."""
    return _probe("_is_amx_fp16_supported")
