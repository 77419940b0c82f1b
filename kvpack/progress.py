"""Progress indication on stderr for slow steps (model loading, long prefills)."""

from __future__ import annotations

import contextlib
import sys
import time


@contextlib.contextmanager
def status(message: str, stream=None):
    """Print ``message ...`` before a slow step and ``done in X s`` after it, on stderr."""
    stream = stream or sys.stderr
    print(f"[kvpack] {message} ...", file=stream, flush=True)
    start = time.perf_counter()
    yield
    print(f"[kvpack] {message}: done in {time.perf_counter() - start:.1f} s", file=stream, flush=True)
