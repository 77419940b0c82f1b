"""Prefill time of every codec's cache (selection / compression included) vs the dense prefill.

SmolLM2 on CPU, a needle prompt of ``--tokens`` tokens. Each method's prefill goes through kvpack's
cache and attention path, which computes the method's statistics (H2O's accumulated attention,
SnapKV's observation votes) in query chunks and compresses each layer right after its attention
(``puzzle_plus``: every layer's pages at the last layer, one whole-cache rank allocation). The
baseline is transformers' own prefill into a ``DynamicCache``, measured again after every row, so
each row's ratio is against the mean of the two baseline runs around it (this shared machine's speed
drifts by ±10–25% within a run). Beside the ratio: the seconds spent inside the stores' prefill
``append`` calls, which is the compression (and, for every method, the copy into its store) timed on
its own, as a share of the same baselines.

Rows as in ``bench_decode_e2e.py``: ``METHOD[@BUDGET][+KEY=VALUE...]``.

Usage: python benchmarks/bench_prefill_overhead.py [--tokens 4096] [--dtype float32] [--repeats 3] [--warmup 1]
    [--rows full,puzzle,anchor@0.25,...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _util import machine, median_seconds  # noqa: E402
from bench_decode_e2e import parse_row  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpack import attach  # noqa: E402
from kvpack.hf.cache import KVPackCache, cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402
from kvpack.resident.base import LayerStore  # noqa: E402

DEFAULT_ROWS = ("full", "puzzle", "puzzle_plus", "puzzle_plus@0.25", "anchor", "anchor_plus", "anchor_plus@0.25",
                "svd@0.25", "kivi@0.25", "streaming@0.25", "h2o@0.25", "snapkv@0.25")


class PrefillAppendClock:
    """Seconds spent inside the stores' ``append`` while they hold nothing yet (the prefill chunk),
    summed over every layer. Each store class's own ``append`` is wrapped; a call nested in another
    (a subclass calling ``super().append``) is counted once, by the outermost."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0
        self._saved: list[tuple[type, object]] = []

    def _wrap(self, fn):
        @functools.wraps(fn)
        def timed(store, *args, **kwargs):
            if self._depth or store.seq_len:
                return fn(store, *args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(store, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1
        return timed

    def __enter__(self):
        classes, todo = set(), [LayerStore]
        while todo:
            cls = todo.pop()
            classes.add(cls)
            todo.extend(cls.__subclasses__())
        for cls in classes:
            if "append" in vars(cls):
                self._saved.append((cls, vars(cls)["append"]))
                cls.append = self._wrap(vars(cls)["append"])
        return self

    def __exit__(self, *exc):
        for cls, fn in self._saved:
            cls.append = fn
        self._saved.clear()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each row's repeats")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated METHOD[@BUDGET] rows")
    args = parser.parse_args()
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    prompt, _ = needle_prompt(tok, args.tokens, 0.5, seed=0)
    ids = tok(prompt, return_tensors="pt").input_ids[:, : model.config.max_position_embeddings]

    def prefill(make_cache, tokens=ids):
        def run():
            cache = make_cache()
            with attach(model, cache=cache) if isinstance(cache, KVPackCache) else contextlib.nullcontext():
                model(tokens, logits_to_keep=1, **cache_kwargs(model, cache))
        return run

    rows = [(row, *parse_row(row)) for row in args.rows.split(",") if row]
    # Every row once on a short prompt first, untimed: one-time loads and builds stay out of the figures.
    prefill(lambda: DynamicCache(config=model.config), ids[:, :1024])()
    for _, name, cfg in rows:
        prefill(lambda: KVPackCache(model, name, **cfg), ids[:, :1024])()

    def dense() -> float:
        return median_seconds(prefill(lambda: DynamicCache(config=model.config)), args.repeats, args.warmup)

    print(f"# bench_prefill_overhead  ({machine()}), SmolLM2 {args.dtype}, {ids.shape[1]} tokens, "
          f"medians of {args.repeats}; each row against the mean of the DynamicCache runs before and after it")
    print(f"{'cache':<24}{'prefill s':>10}{'base s':>14}{'vs dense':>10}{'in appends s':>14}{'share':>8}")
    before = dense()
    print(f"{'DynamicCache':<24}{before:>10.2f}", flush=True)
    for row, name, cfg in rows:
        with PrefillAppendClock() as clock:
            t = median_seconds(prefill(lambda: KVPackCache(model, name, **cfg)), args.repeats, args.warmup)
        inside = clock.seconds / (args.repeats + args.warmup)  # mean over every run, warm-up included
        after = dense()
        base = statistics.fmean((before, after))
        print(f"{row:<24}{t:>10.2f}{before:>7.2f}/{after:<6.2f}{t / base - 1:>+10.1%}{inside:>14.2f}"
              f"{inside / base:>8.1%}", flush=True)
        before = after


if __name__ == "__main__":
    main()
