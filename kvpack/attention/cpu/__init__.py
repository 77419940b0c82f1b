"""kvpack's native CPU kernels: the CPU implementations of the ``kvpack::`` decode-attention ops.

Each kernel is bound to its op's schema in C++ (``TORCH_LIBRARY_IMPL(kvpack, CPU, ...)`` in
``csrc/bindings.cpp``): loading the library (:func:`native`) registers them, and from then on the
dispatcher calls the C++ function for CPU tensors with no Python in between. A store decides its path once,
from its config's ``attention_backend`` and the tensors' device (``kvpack.attention.backend``, which asks
:func:`use_native`, a pure function of the two): it calls an op on CPU tensors only when the kernels are
loaded, and otherwise runs the Triton launcher itself (under the interpreter) or the PyTorch reference.

The C++ sources in ``csrc/`` are compiled on first use (:mod:`kvpack.native_build`: g++ and ninja, no
network, one build per source hash, torch version and CPU capability, into kvpack's cache directory).
Threads come from torch's own intra-op pool (``at::parallel_for``), so kernels and torch's ops never
oversubscribe the cores. Where no compiler is present, or ``KVPACK_NATIVE=0`` is set, :func:`native`
returns None after one warning line and every store uses the PyTorch path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from ...native_build import NATIVE_ENV, capability, load_extension, native_disabled

__all__ = ["DOT_PRECISIONS", "NATIVE_CHOICES", "NATIVE_ENV", "bf16_products", "bf16_products_available", "capability",
           "native", "native_available", "native_disabled", "use_native"]

NATIVE_CHOICES = ("auto", "native", "torch")  # attention_backend of methods with no Triton kernel
# dot_precision of the PuzzleKV stores: how the native kernels rebuild pre-RoPE keys (see bf16_products)
DOT_PRECISIONS = ("auto", "float32", "bfloat16")
SOURCES = ("simd.h", "common.h", "pages.h", "bindings.cpp", "dense.cpp", "kivi.cpp", "puzzle.cpp", "ragged.cpp",
           "anchor.cpp", "chunk.cpp", "pca_quant.cpp", "pca_encode.cpp")
_CSRC = Path(__file__).parent / "csrc"


@functools.cache
def native() -> ModuleType | None:
    """The compiled kernels (built on first call), or None where they cannot be built or are off."""
    return load_extension("kvpack_cpu", _CSRC, SOURCES, "the native CPU kernels")


# A constant for torch.compile: a traced decode step asks once, at trace time, instead of breaking the
# graph on the build machinery.
@torch.compiler.assume_constant_result
def native_available() -> bool:
    return native() is not None


def use_native(choice: str, device: torch.device) -> bool:
    """Whether a store with ``attention_backend=choice`` runs the native CPU kernel for tensors on
    ``device``: ``auto`` on CPU tensors when the kernels are built (or can be), ``native`` always on
    CPU (an error where they cannot be built), never for ``torch``/``triton`` or other devices.

    Raises:
        ValueError: ``choice == "native"`` for non-CPU tensors, or where the kernels cannot be built.
    """
    if choice not in ("auto", "native"):
        return False
    if device.type != "cpu":
        if choice == "native":
            raise ValueError(f"attention_backend='native' is the CPU kernels; these tensors are on {device}")
        return False
    if choice == "native" and native_disabled():
        raise ValueError(f"attention_backend='native' but {NATIVE_ENV}=0 turns the native kernels off")
    ok = native_available()
    if choice == "native" and not ok:
        raise ValueError("attention_backend='native' but the native CPU kernels could not be built "
                         "(see the warning above); use 'auto' or 'torch'")
    return ok


def bf16_products(choice: str, int4: bool, factor_dtype: torch.dtype) -> bool:
    """Whether a PuzzleKV store with ``dot_precision=choice`` lets the native kernels rebuild its pre-RoPE
    keys (``L_K R_K``, r·d multiply-adds per token) with bf16 products, two ranks per AVX-512 BF16
    instruction, fp32 accumulation: ``auto`` where that rounds little or nothing — INT4 factors (a
    4-bit code times an fp16 scale; each factor entry rounds by at most 2^-9, far below its INT4 step)
    or factors stored in bf16 (exact) — but not fp32 factors; ``bfloat16`` always; ``float32`` never
    (the reference numerics). The kernels use it only where the CPU has AVX-512 BF16
    (:func:`bf16_products_available`); elsewhere every choice computes in fp32.

    Raises:
        ValueError: an unknown choice.
    """
    if choice not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {', '.join(DOT_PRECISIONS)}, got {choice!r}")
    return choice == "bfloat16" or (choice == "auto" and (int4 or factor_dtype == torch.bfloat16))


def bf16_products_available() -> bool:
    """Whether the native kernels are built and this CPU runs their bf16 products (AVX-512 BF16)."""
    lib = native()
    return lib is not None and bool(lib.bf16_products_available())
