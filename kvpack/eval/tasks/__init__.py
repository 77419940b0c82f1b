"""RULER-style long-context tasks, generated offline and deterministically (see ``base.py``)."""

from . import niah, vt, words  # noqa: F401  (register the tasks)
from .base import TASKS, ResampleError, Sample, register_task

RULER_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "passkey"]
NIAH_TASKS = [t for t in RULER_TASKS if t.startswith("niah")]


def make_sample(tokenizer, task: str, length: int, index: int, samples: int, seed: int = 0) -> Sample:
    """Sample ``index`` of ``samples`` of ``task`` at ``length`` tokens: the needle depth is swept
    evenly over the context ((index + 0.5) / samples) and the content seeded by (seed, task, length,
    index)."""
    import random
    import zlib

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(sorted(TASKS))}")
    depth = (index + 0.5) / samples
    sample_seed = zlib.crc32(f"{seed}/{task}/{length}/{index}".encode())
    for attempt in range(10):
        rng = random.Random(sample_seed + attempt * 7919)
        try:
            sample = TASKS[task](tokenizer, length, depth, rng)
        except ResampleError:
            continue
        sample.seed = sample_seed
        return sample
    raise ValueError(f"{task}: could not generate sample {index}")


__all__ = ["NIAH_TASKS", "RULER_TASKS", "TASKS", "ResampleError", "Sample", "make_sample", "register_task"]
