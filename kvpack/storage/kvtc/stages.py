"""Wall-clock seconds per stage of a kvtc restore (read, verify, inflate, dequantize, inverse PCA,
RoPE, assemble), accumulated over layers and sections: where a time to first token goes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# The stages of a restore, in pipeline order (what `continue --json` and bench_kvtc_ttft.py report).
RESTORE_STAGES = ("read", "verify", "inflate", "dequantize", "inverse_pca", "rope", "assemble", "to_cache")


class StageTimes:
    """Seconds per named stage; ``with times("inflate"): ...`` adds the block's wall time to its stage.

    A no-op stand-in is :data:`NO_TIMES` (the default of every function that takes one), so the
    coder's hot loops pay one attribute lookup when nobody measures.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def timed(self, stage: str, fn: Callable) -> Callable:
        """``fn`` with each call's time added to ``stage``."""

        def wrapper(*args, **kwargs):
            with self(stage):
                return fn(*args, **kwargs)

        return wrapper

    def as_dict(self) -> dict[str, float]:
        """Seconds per stage, pipeline stages first (in order), then any other stage."""
        known = {s: self.seconds[s] for s in RESTORE_STAGES if s in self.seconds}
        return {**known, **{s: v for s, v in self.seconds.items() if s not in known}}


class _NoTimes(StageTimes):
    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        yield

    def add(self, stage: str, seconds: float) -> None:
        pass

    def timed(self, stage: str, fn: Callable) -> Callable:
        return fn


NO_TIMES = _NoTimes()
