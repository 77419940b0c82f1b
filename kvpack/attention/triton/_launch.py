"""Launcher helpers both custom ops share (PyTorch only; importing this never imports Triton)."""

from __future__ import annotations

import functools
import math

import torch

# Query rows per program. A decode step's rows (its GQA group: 1 to 16 query heads per KV head) fit
# one block; a longer chunk (a prefill over the stored history) gets one program per block of rows
# (grid axis 2). Tiles with more rows spill: compiled for sm_90, 64-row tiles took 226 registers and
# 129 KiB (PuzzleKV) and 255 registers + 416 bytes spilled (AnchorKV); 256-row tiles spilled 1.8 KB
# and 4.2 KB per thread, with up to 241 KiB of shared memory, more than an H100 grants.
ROW_BLOCK = 16


def row_blocks(m: int) -> int:
    """Programs along grid axis 2 for ``m`` query rows."""
    return -(-m // ROW_BLOCK)


def pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= ``n`` and >= ``floor`` (``tl.dot`` needs tiles of at least 16)."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def split_state_buffers(H: int, M: int, D: int, n_splits: int, device) -> tuple[torch.Tensor, ...]:
    """The split kernels' outputs, uninitialised fp32: ``m, l [H, n_splits, M]``, ``o [H, n_splits, M, D]``."""
    return (torch.empty(H, n_splits, M, device=device), torch.empty(H, n_splits, M, device=device),
            torch.empty(H, n_splits, M, D, device=device))


def empty_state(H: int, M: int, D: int, device) -> tuple[torch.Tensor, ...]:
    """The merged state of rows that saw no key: ``m = -inf``, ``l = 0``, ``o = 0`` (fp32)."""
    return (torch.full((H, M), float("-inf"), device=device), torch.zeros(H, M, device=device),
            torch.zeros(H, M, D, device=device))


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, device=device)


# The kernels compute element offsets in int32 (Triton's type for program ids and integer
# arguments). An offset past 2^31 would wrap and read other memory without an error, so a tensor a
# kernel reads must stay below that, less a tile's worth of masked lanes past its end. At d = 128 a
# PuzzleKV layer's R factors reach it at 1M tokens with rank 64 and 8 KV heads.
MAX_KERNEL_ELEMENTS = 2**31 - 2**24


def kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel pointer argument: contiguous (a no-op for the stores' own tensors), or one
    cached placeholder element when ``t`` is empty (the kernel never reads it).

    Raises:
        ValueError: ``t`` holds more elements than the kernels' int32 offsets can address.
    """
    if t.numel() > MAX_KERNEL_ELEMENTS:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} ({t.numel():,} elements) is too large for the Triton "
                         f"kernels' 32-bit offsets (at most {MAX_KERNEL_ELEMENTS:,}); use attention_backend='torch'")
    return t.contiguous() if t.numel() else _placeholder(t.device)


# Software-pipelining depth that fits each (kernel, device, tile configuration), learned on first
# launch. Triton's default of 3 stages multi-buffers the loop's loads in shared memory; PuzzleKV with
# 64-token INT4 pages needs 164 KiB at 3 stages (measured by benchmarks/kernel_resources.py), over an
# A100's 163 KiB per block and an L40S's 99 KiB, and 68 KiB at 1 stage.
_STAGES = (3, 2, 1)
_fitting_stages: dict[tuple, int] = {}
_compiled: dict[tuple, object] = {}  # what the last launch of each key returned (Triton's CompiledKernel)


def compiled_kernels() -> dict[tuple, tuple[int, object]]:
    """``{(kernel name, device, constexprs): (stages, compiled kernel)}`` of the launches so far (the
    compiled kernel is None under the interpreter); ``gpu_check.py`` prints their registers and spills."""
    return {key: (_fitting_stages[key], _compiled.get(key)) for key in _fitting_stages}


def launch(kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)`` with the deepest pipelining (3, 2, then 1 stages) whose
    shared memory the device grants; the depth that fits is remembered per device and tile
    configuration. Other launch errors propagate."""
    from triton.runtime.errors import OutOfResources

    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    key = (getattr(kernel, "__name__", repr(kernel)), str(device), tuple(sorted(constexprs.items())))
    stages = _STAGES[_STAGES.index(_fitting_stages.get(key, _STAGES[0])):]
    for i, n in enumerate(stages):
        try:
            _compiled[key] = kernel[grid](*args, num_stages=n, **constexprs)
        except OutOfResources:
            if i == len(stages) - 1:
                raise
            continue
        _fitting_stages[key] = n
        return
