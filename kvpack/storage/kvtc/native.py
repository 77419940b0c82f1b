"""kvtc's native codec passes (``csrc/kvtc.cpp``): quantize + pack, unpack + dequantize, and the inverse
PCA's output pass (mean + RoPE + transpose + cast into the cache's rows), which the coder calls directly.

Built on first use like the attention kernels (:mod:`kvpack.native_build`), as its own extension beside
the codec; where it cannot be built, or ``KVPACK_NATIVE=0``, :func:`native` returns None after one
warning line and the coder uses the PyTorch path, which gives the same bytes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from ...native_build import load_extension

SOURCES = ("kvtc.cpp",)
CSRC = Path(__file__).parent / "csrc"


@functools.cache
def native() -> ModuleType | None:
    """The compiled passes (built on first call), or None where they cannot be built or are off."""
    return load_extension("kvpack_kvtc", CSRC, SOURCES, "kvtc's native codec passes")
