"""Decode steps of a kvpack cache and of transformers' ``DynamicCache``, interleaved step by step.

``bench_decode_e2e.py`` times whole ``generate`` runs one after the other; on a shared 2-core VM
their baselines drift by 15-25% between runs, more than some targets' margins (``full`` within 5% of
``DynamicCache``). Here both caches are filled from the same prompt (the dense prefill once, each row
decoding from its own copy of it) and then decode in turn, one step of each, the order swapped every
step (ABBA), so a drift of the machine hits both alike. Each cache is fed its own greedy token (a
lossy method's tokens may diverge; a step's cost does not depend on which token it is). The first
``--warmup`` steps of each are not timed. Printed per row: both medians and slowest steps, the ratio
of the medians, the median of the per-step ratios (each kvpack step against the ``DynamicCache``
step next to it), and the KV bytes the kvpack cache's tensors hold ÷ the same tokens in bf16.

A step here is one ``model(...)`` forward with ``use_cache=True`` (no ``generate`` loop around it:
its per-step overhead is the same for both caches).

Usage: python benchmarks/bench_decode_interleaved.py [--length 8192] [--dtype float32] [--steps 60]
    [--warmup 3] [--rows full,puzzle_plus@0.25,...]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _util import machine  # noqa: E402
from bench_decode_e2e import parse_row  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpack.hf.attention import attached  # noqa: E402
from kvpack.hf.cache import KVPackCache, cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402


@torch.no_grad()
def forward(model, tokens: torch.Tensor, cache, position: int) -> torch.Tensor:
    """One forward of ``tokens [1, n]`` at ``position`` over ``cache``; the greedy next token ``[1, 1]``."""
    positions = torch.arange(position, position + tokens.shape[1])[None]
    out = model(tokens, use_cache=True, position_ids=positions, **cache_kwargs(model, cache))
    return out.logits[:, -1:].argmax(-1)


def run_row(model, ids: torch.Tensor, row: str, steps: int, warmup: int,
            prefilled: tuple[DynamicCache, torch.Tensor]) -> dict:
    """Prefill the row's kvpack cache, then alternate its decode steps with those of a copy of the
    ``prefilled`` ``DynamicCache`` (and its greedy next token): one dense prefill serves every row."""
    name, cfg = parse_row(row)
    dynamic, next_dynamic = copy.deepcopy(prefilled[0]), prefilled[1].clone()
    packed = KVPackCache(model, name, **cfg)
    with attached(model, packed):
        next_packed = forward(model, ids, packed, 0)
    same_first = bool(next_dynamic.item() == next_packed.item())
    position, times_dynamic, times_packed = ids.shape[1], [], []

    def step_dynamic():
        nonlocal next_dynamic
        start = time.perf_counter()
        next_dynamic = forward(model, next_dynamic, dynamic, position)
        return time.perf_counter() - start

    def step_packed():
        nonlocal next_packed
        with attached(model, packed):  # switching the attention implementation is outside the timer
            start = time.perf_counter()
            next_packed = forward(model, next_packed, packed, position)
            return time.perf_counter() - start

    for i in range(warmup + steps):
        pair = (step_dynamic(), step_packed()) if i % 2 == 0 else tuple(reversed((step_packed(), step_dynamic())))
        if i >= warmup:
            times_dynamic.append(pair[0] * 1e3)
            times_packed.append(pair[1] * 1e3)
        position += 1
    ratios = [p / d for d, p in zip(times_dynamic, times_packed)]
    return {"row": row, "dynamic_ms": statistics.median(times_dynamic), "dynamic_max_ms": max(times_dynamic),
            "median_ms": statistics.median(times_packed), "max_ms": max(times_packed),
            "ratio_of_medians": statistics.median(times_packed) / statistics.median(times_dynamic),
            "median_ratio": statistics.median(ratios), "kv_ratio": packed.kv_bytes() / packed.dense_kv_bytes(),
            "same_first_token": same_first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens (a needle prompt)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps of each cache")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps of each cache first")
    parser.add_argument("--rows", default="full", help="comma-separated kvpack rows: METHOD[@BUDGET][+KEY=VALUE...]")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    text, _ = needle_prompt(tok, args.length, depth=0.5, seed=0)
    ids = tok(text, return_tensors="pt").input_ids
    print(f"# bench_decode_interleaved ({machine()}), SmolLM2 {args.dtype}, {ids.shape[1]} prompt tokens, "
          f"{args.steps} timed steps of each cache after {args.warmup} untimed, one step of each in turn (ABBA)")
    print(f"{'cache':<28} {'Dynamic ms':>10} {'slowest':>8} {'kvpack ms':>9} {'slowest':>8} "
          f"{'ratio of medians':>16} {'median ratio':>12} {'KV / bf16':>9}")
    dynamic = DynamicCache(config=model.config)
    prefilled = (dynamic, forward(model, ids, dynamic, 0))
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        res = run_row(model, ids, row, args.steps, args.warmup, prefilled)
        note = "" if res["same_first_token"] else "  (first token differs from DynamicCache's)"
        print(f"{res['row']:<28} {res['dynamic_ms']:>10.1f} {res['dynamic_max_ms']:>8.1f} {res['median_ms']:>9.1f} "
              f"{res['max_ms']:>8.1f} {res['ratio_of_medians']:>15.3f}x {res['median_ratio']:>11.3f}x "
              f"{res['kv_ratio']:>9.3f}{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
