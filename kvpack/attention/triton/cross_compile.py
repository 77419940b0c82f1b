"""Compile kvpack's Triton kernels for a CUDA GPU on a machine without one, and report their resources.

Triton's compiler itself needs no GPU: given a target architecture it lowers a kernel to PTX and
assembles it with the ``ptxas`` bundled in Triton's NVIDIA backend. :func:`compile_only` swaps in a
stand-in CUDA driver that names the target and turns every kernel launch inside it into a compile
that stops before running, so the real launchers (``puzzle_partial``, ``anchor_partials``) compile
exactly the specialisations they would launch, from CPU tensors. This checks what the interpreter
cannot — ``tl.dot`` shape and dtype rules, layouts, register and shared-memory limits — and
:class:`KernelBuild` reports registers, spilled bytes and shared memory per kernel.

Must run without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` kernels at import).
Compiled with Triton 3.9; the stand-in driver relies on ``triton.runtime.driver.set_active`` and
``JITFunction.run(..., warmup=True)``, and refuses clearly where those are missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import interpreter_on

_RESOURCE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


@dataclass
class KernelBuild:
    """One compiled kernel: its name, target ``sm_<arch>``, and resources per thread / per block."""

    name: str
    arch: int
    registers: int  # per thread
    spill_bytes: int  # per thread: stack frame + local memory (0 = nothing spilled)
    shared_bytes: int  # per block: Triton's dynamic shared memory plus any static
    num_warps: int
    num_stages: int


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """``(registers, spill bytes, static shared bytes)`` of a cubin, read by Triton's cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    match = _RESOURCE.search(out.stdout)
    if match is None:
        raise RuntimeError(f"could not read the resource usage from cuobjdump: {out.stdout[-400:]!r}")
    reg, stack, shared, local = (int(x) for x in match.groups())
    return reg, stack + local, shared


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[KernelBuild]]:
    """Inside the block, Triton launches compile for ``sm_<arch>`` and return without running; the
    yielded list fills with one :class:`KernelBuild` per compiled kernel. Outputs of the launchers
    (``torch.empty`` split states) are left unwritten: only the compile is real.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1``, or a Triton without the NVIDIA backend or the
            driver hooks this relies on.
    """
    if interpreter_on():
        raise RuntimeError("cross-compiling needs compiled kernels: unset TRITON_INTERPRET")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.driver import CudaDriver
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        raise RuntimeError(f"this Triton cannot cross-compile for CUDA ({e})") from e
    if not hasattr(driver, "set_active"):
        raise RuntimeError("this Triton has no triton.runtime.driver.set_active: cannot cross-compile")

    class StandInCuda(CudaDriver):
        """Names the target; never touches a GPU (no CUDA library is loaded)."""

        def __init__(self):  # CudaDriver.__init__ would load libcuda
            self.target = GPUTarget("cuda", arch, 32)

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            # Triton caches compiled kernels per device: one key per target, never a real device's.
            return f"stand-in sm_{arch}"

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    builds: list[KernelBuild] = []
    launch = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        reg, spill, static_shared = _resources(kernel.asm["cubin"])
        meta = kernel.metadata
        builds.append(KernelBuild(name=self.__name__, arch=arch, registers=reg, spill_bytes=spill,
                                  shared_bytes=meta.shared + static_shared, num_warps=meta.num_warps,
                                  num_stages=meta.num_stages))
        return kernel

    previous = getattr(driver, "_active", None)  # reset_active() would look for a real GPU driver
    driver.set_active(StandInCuda())
    JITFunction.run = compile_instead
    try:
        yield builds
    finally:
        JITFunction.run = launch
        driver.set_active(previous)
