"""kvpack's native CPU kernels: the CPU backend of the ``kvpack::`` decode-attention custom ops, and
kvtc's memory passes (``kvtc.cpp``: quantize + pack, unpack + dequantize, mean + RoPE + transpose +
cast), which its coder calls directly.

The C++ sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension`` (g++ and
ninja; no network) into kvpack's cache directory, one build per (source hash, torch version, CPU
capability), so a later process loads the library in a fraction of a second. Threads come from
torch's own intra-op pool (``at::parallel_for``), so kernels and torch's ops never oversubscribe the
cores. Where no compiler is present, or ``KVPACK_NATIVE=0`` is set, :func:`native` returns None after
one warning line and every caller uses the PyTorch path.

Compile flags per capability (``torch.backends.cpu.get_cpu_capability()``): ``avx512`` and ``avx2``
get the matching ``-m`` flags, anything else the compiler's baseline; never ``-march=native``, so a
cache shared between machines holds a build per capability that runs on each.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ...paths import cache_dir

NATIVE_CHOICES = ("auto", "native", "torch")  # attention_backend of methods with no Triton kernel
# dot_precision of the PuzzleKV stores: how the native kernels rebuild pre-RoPE keys (see bf16_products)
DOT_PRECISIONS = ("auto", "float32", "bfloat16")
NATIVE_ENV = "KVPACK_NATIVE"  # "0" turns the native kernels off (the PyTorch path everywhere)
SOURCES = ("common.h", "pages.h", "bindings.cpp", "dense.cpp", "kivi.cpp", "puzzle.cpp", "ragged.cpp", "anchor.cpp",
           "chunk.cpp", "kvtc.cpp")
_CSRC = Path(__file__).parent / "csrc"

# -O3 and OpenMP (at::parallel_for is OpenMP inside torch's CPU build; the libgomp it links is the one
# torch already loaded, same soname, so there is one runtime and one pool); no -ffast-math (the
# online softmax relies on -inf).
_BASE_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
_CAPABILITY_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def capability() -> str:
    """The running CPU's vector capability as torch sees it (``avx512``, ``avx2``, ``default``...)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def build_key() -> str:
    """Hash of the sources, the compile flags, torch's version and the CPU capability."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (_CSRC / name).read_bytes())
    flags = _BASE_FLAGS + _CAPABILITY_FLAGS.get(capability(), [])
    h.update(" ".join(flags).encode() + torch.__version__.encode() + capability().encode())
    return h.hexdigest()[:16]


@torch.compiler.assume_constant_result
def native_disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") in ("0", "false", "no")


@functools.cache
def native() -> ModuleType | None:
    """The compiled kernels (built on first call), or None where they cannot be built or are off."""
    if native_disabled():
        return None
    try:
        from torch.utils import cpp_extension

        key = build_key()
        build_dir = cache_dir() / "native" / f"{key}-{capability()}"
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            print(f"kvpack: compiling the native CPU kernels into {build_dir} (once, about a minute)",
                  file=sys.stderr, flush=True)
        flags = _BASE_FLAGS + _CAPABILITY_FLAGS.get(capability(), [])
        return cpp_extension.load(
            name=f"kvpack_cpu_{key}", sources=[str(_CSRC / n) for n in SOURCES if n.endswith(".cpp")],
            build_directory=str(build_dir), extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch path still works
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(f"kvpack: native CPU kernels unavailable ({first_line}); using the PyTorch path",
                      RuntimeWarning, stacklevel=2)
        return None


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


_interpreter = threading.local()


@contextlib.contextmanager
def triton_on_cpu():
    """Inside this block the ops' CPU kernels run the Triton launcher (the interpreter, under
    ``TRITON_INTERPRET=1``) instead of the native code: how ``attention_backend="triton"`` reaches
    the Triton kernels on CPU tensors through the same op the GPU path calls."""
    previous = getattr(_interpreter, "on", False)
    _interpreter.on = True
    try:
        yield
    finally:
        _interpreter.on = previous


def triton_requested() -> bool:
    """Whether the calling thread is inside :func:`triton_on_cpu`."""
    return getattr(_interpreter, "on", False)


def register_cpu_kernel(op, triton_launcher, native_name: str) -> None:
    """Make the native function ``native_name`` the ``cpu`` kernel of the custom op ``op``; inside
    :func:`triton_on_cpu` (``attention_backend="triton"`` on CPU tensors, the interpreter) or where the
    kernels are not built, the op's CPU kernel runs ``triton_launcher`` instead."""

    @op.register_kernel("cpu")
    def _(*args):
        lib = None if triton_requested() else native()
        if lib is None:
            return triton_launcher(*args)
        return getattr(lib, native_name)(*args)
