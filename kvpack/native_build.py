"""Build a C++ extension of kvpack's once per machine kind, into kvpack's cache directory.

``torch.utils.cpp_extension.load`` compiles the sources with g++ and ninja (no network) into
``<cache dir>/native/<name>-<key>-<capability>/``; the key hashes the sources, the compile flags, torch's
version and the CPU capability, so a later process loads the library in a fraction of a second and a
cache shared between machines holds a build per capability that runs on each. Flags per capability
(``torch.backends.cpu.get_cpu_capability()``): ``avx512`` and ``avx2`` get the matching ``-m`` flags,
anything else the compiler's baseline; never ``-march=native``. Threads come from torch's own intra-op
pool (``at::parallel_for``, OpenMP inside torch's CPU build: the libgomp linked is the one torch loaded).

Used by the attention kernels (``kvpack.attention.cpu``) and kvtc's codec passes
(``kvpack.storage.kvtc.native``), each its own extension beside its Python code.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .paths import cache_dir

NATIVE_ENV = "KVPACK_NATIVE"  # "0" turns the native code off (the PyTorch paths everywhere)

# -O3 and OpenMP; no -ffast-math (the online softmax relies on -inf, kvtc on exact roundings).
BASE_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
CAPABILITY_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def capability() -> str:
    """The running CPU's vector capability as torch sees it (``avx512``, ``avx2``, ``default``...)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def flags() -> list[str]:
    """The compile flags of this machine's capability."""
    return BASE_FLAGS + CAPABILITY_FLAGS.get(capability(), [])


@torch.compiler.assume_constant_result
def native_disabled() -> bool:
    """Whether ``KVPACK_NATIVE=0`` (or ``false``/``no``) turns the native code off."""
    return os.environ.get(NATIVE_ENV, "1") in ("0", "false", "no")


def build_key(csrc: Path, sources: tuple[str, ...]) -> str:
    """Hash of the sources (headers included), the compile flags, torch's version and the capability."""
    h = hashlib.sha256()
    for name in sources:
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes())
    h.update(" ".join(flags()).encode() + torch.__version__.encode() + capability().encode())
    return h.hexdigest()[:16]


def load_extension(name: str, csrc: Path, sources: tuple[str, ...], what: str) -> ModuleType | None:
    """The extension ``name`` built from ``csrc/<sources>`` (headers listed too: they are hashed, not
    compiled), or None after one warning line where it cannot be built or ``KVPACK_NATIVE=0``.

    Args:
        name: the extension's name (a prefix of the module name; the key is appended).
        csrc: the folder of the sources.
        sources: file names in ``csrc``; the ``.cpp`` files are compiled.
        what: what the extension is, for the one line printed while it builds and the warning.
    """
    if native_disabled():
        return None
    try:
        from torch.utils import cpp_extension

        key = build_key(csrc, sources)
        build_dir = cache_dir() / "native" / f"{name}-{key}-{capability()}"
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            print(f"kvpack: compiling {what} into {build_dir} (once, a minute or two)", file=sys.stderr, flush=True)
        return cpp_extension.load(
            name=f"{name}_{key}", sources=[str(csrc / n) for n in sources if n.endswith(".cpp")],
            build_directory=str(build_dir), extra_cflags=flags(), extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch paths still work
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(f"kvpack: {what} unavailable ({first_line}); using the PyTorch path", RuntimeWarning,
                      stacklevel=3)
        return None
