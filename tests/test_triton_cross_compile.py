"""The Triton kernels compiled for real CUDA GPUs (sm_80, sm_90) on this GPU-less machine, and the
launcher's fallback when a device grants less shared memory than a kernel's pipelining asks for.

The interpreter tests check what the kernels compute; only a compile for a GPU target checks what
the interpreter accepts and a GPU would not (``tl.dot`` shapes and dtypes, layouts) and what they
cost in registers, spills and shared memory. ``benchmarks/kernel_resources.py`` compiles them with
Triton's own compiler and bundled ptxas for the Llama-8B head shape; nothing runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed: kernel tests skipped (pip install triton)")
pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend to compile for CUDA GPUs")

ROOT = Path(__file__).resolve().parents[1]
H100_SHARED = 227 * 1024  # largest shared memory a block may opt into on sm_90
A100_SHARED = 163 * 1024  # on sm_80


# Spills measured at a segment length that is not a multiple of 16 (Triton then cannot assume aligned
# per-token rows): bytes per thread, an upper bound that catches growth (docs/kernels.md). Every other
# configuration, length and target spills nothing.
KNOWN_SPILLS = {
    ("anchor_plus 4-bit tier 0.3", 80): 16,
    ("anchor_plus 4-bit tier 0.3", 90): 64,
    ("puzzle_plus P=64 0.5", 80): 8,  # the 64-query chunk only
}


def test_kernels_compile_for_a100_and_h100_without_new_spills():
    """One decode step (GQA group of 4 rows) and a 64-query chunk (256 rows, as a prefill over the
    stored history): the chunk's rows go to programs in blocks of 16, so it compiles to the decode
    step's resources (with one block of all its rows, it spilled up to 4 KB per thread). Two store
    lengths, because Triton compiles a binary per specialization of the integer arguments: 2040
    tokens (not a multiple of 16, two blocks per program — most real prompts) and 1024 (a multiple of
    16, one block per program); a check at 1024 alone had hidden the spills of the first."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--arch", "80,90",
                          "--tokens", "2040,1024", "--queries", "1,64", "--json"],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    configs = {r["config"] for r in rows}
    assert len(configs) == 10 and {r["arch"] for r in rows} == {80, 90} and {r["queries"] for r in rows} == {1, 16, 64}
    assert {r["tokens"] for r in rows} == {2040, 1024, None}  # None: the chunk attention, independent of the stores
    # Per configuration, length, architecture and chunk length: the split kernel and the split merge;
    # per architecture and chunk length, the chunk attention that ends a decode step.
    assert len(rows) == 148 and sum(r["name"] == "merge_splits_kernel" for r in rows) == 72
    assert sum(r["name"] == "chunk_attend_kernel" for r in rows) == 4
    for r in rows:
        allowed = KNOWN_SPILLS.get((r["config"], r["arch"]), 0) if r["tokens"] == 2040 else 0
        assert r["spill_bytes"] <= allowed, r  # nothing (or no more than measured) spilled to local memory
        assert 0 < r["registers"] <= 255
    assert all(r["shared_bytes"] <= H100_SHARED for r in rows if r["arch"] == 90)
    # At 3 stages only PuzzleKV with 64-token INT4 pages asks an A100 for more than it grants; the
    # launcher then pipelines less deeply (next test).
    assert {r["config"] for r in rows if r["arch"] == 80 and r["shared_bytes"] > A100_SHARED} <= \
        {"puzzle P=64 INT4 0.6"}


def test_launch_falls_back_to_fewer_stages_when_shared_memory_runs_out():
    from triton.runtime.errors import OutOfResources

    from kvpack.attention.triton import _launch

    class Kernel:
        """Accepts a launch only at <= ``fits`` stages, like a device with too little shared memory."""

        __name__ = "fake_kernel"

        def __init__(self, fits):
            self.fits, self.tried = fits, []

        def __getitem__(self, grid):
            def run(*args, num_stages, **kw):
                self.tried.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(num_stages * 1000, self.fits * 1000, "shared memory")
            return run

    k = Kernel(fits=2)
    _launch.launch(k, (1,), 5, BM=16)
    _launch.launch(k, (1,), 5, BM=16)  # remembered: straight to 2 stages
    assert k.tried == [3, 2, 2]
    k1 = Kernel(fits=1)
    k1.__name__ = "other"
    _launch.launch(k1, (1,), 5, BM=32)
    assert k1.tried == [3, 2, 1]
    with pytest.raises(OutOfResources):  # nothing fits: the error surfaces
        _launch.launch(Kernel(fits=0), (1,), 5, BM=64)
