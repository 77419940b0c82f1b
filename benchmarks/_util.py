"""Timing helpers shared by the benchmarks (medians of repeated runs, never asserted)."""

from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    import platform

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    return f"{platform.machine()} {dev}, torch {torch.__version__}"
