"""Host-side cost of one decode step's attention on the Triton path, with the kernels' launches stubbed.

In eager decoding on a GPU, every PyTorch op of a step is a kernel launch the host pays for, however
small its work. This counts the ops of ``attend`` + ``append`` of one decode token per layer (a
recording dispatch mode; views, which launch nothing, not counted; each of kvpack's custom ops
counted once: ``puzzle_attention`` and ``anchor_segment_attention`` make two Triton launches,
``chunk_attend`` one) and times ``attend`` on CPU tensors with every Triton launch
replaced by a no-op, so that what is timed is Python, dispatch and the small PyTorch ops — the work a
GPU host does per layer and step. Llama-8B head shape (8 KV heads, 32 query heads, d = 128).

A CPU measure of host work, not a GPU timing. Usage: python benchmarks/bench_decode_host.py
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # the launchers run on CPU tensors; the kernels are stubbed

import torch  # noqa: E402
from gpu_check import build_store  # noqa: E402

_KERNELS = [("kvpack.attention.triton.puzzle_decode", "puzzle_split_kernel"),
            ("kvpack.attention.triton.anchor_decode", "anchor_split_kernel"),
            ("kvpack.attention.triton.split_merge", "merge_splits_kernel"),
            ("kvpack.attention.triton.chunk_attend", "chunk_attend_kernel")]
_VIEWS = {"view", "unsqueeze", "permute", "squeeze", "alias", "_unsafe_view", "expand", "reshape", "t", "transpose",
          "slice", "select", "new_empty", "empty", "detach"}


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0] if func.namespace == "aten" else f"{func.namespace}::{func.__name__}"
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _stub_launches() -> None:
    no_launch = type("NoLaunch", (), {"__getitem__": lambda self, grid: lambda *a, **k: None})()
    for module, name in _KERNELS:
        try:
            setattr(importlib.import_module(module), name, no_launch)
        except ModuleNotFoundError:  # a tree without that kernel
            pass


def main() -> int:
    _stub_launches()
    warnings.simplefilter("ignore")  # stubbed kernels leave outputs unwritten; later kernels read them
    torch.set_num_threads(1)
    H, G, d = 8, 4, 128
    print("| config | GPU ops per decode step (attend + append) | the ops | attend host µs (median) |")
    print("|---|---|---|---|")
    for method, cfg, label in [("puzzle", {"budget": 0.6}, "puzzle P=32 budget 0.6"),
                               ("anchor", {"budget": 0.1}, "anchor theta 0.1")]:
        store, _, _ = build_store(method, {**cfg, "attention_backend": "triton", "check_finite": False}, H, G, d, 2048,
                                  torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        # bf16, as a model's
        toks = [tuple(torch.randn(n, 1, d, generator=g).bfloat16() for n in (H * G, H, H)) for _ in range(8)]
        for q, k, v in toks[:4]:  # a tail of a few tokens, as while decoding
            store.append(k, v, q, store.attend(q, k, v, d ** -0.5))
        q, k, v = toks[4]
        with _RecordOps() as rec:
            store.append(k, v, q, store.attend(q, k, v, d ** -0.5))
        launching = [op for op in rec.ops if op not in _VIEWS]
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(30):
                store.attend(q, k, v, d ** -0.5)
            runs.append((time.perf_counter() - start) / 30)
        print(f"| {label} | {len(launching)} | {' '.join(launching)} | {statistics.median(runs) * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
