"""Prefill time of every codec's cache (selection / compression included) vs the dense prefill.

SmolLM2, a ~4K-token needle prompt, fp32 model on CPU. Each method's prefill goes through
kvpack's cache and attention path, which computes the method's statistics (H2O's accumulated
attention, SnapKV's observation votes) in query chunks and compresses each layer right after
its attention. The baseline is transformers' own prefill into a DynamicCache, in the same run.

Usage: python benchmarks/bench_prefill_overhead.py [--tokens 4096] [--budget 0.25]
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _util import machine, median_seconds  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpack import attach  # noqa: E402
from kvpack.hf.cache import KVPackCache, cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402

METHODS = [("full", {}), ("puzzle", {}), ("anchor", {"budget": None}), ("svd", {"budget": None}),
           ("kivi", {"budget": None}),
           ("streaming", {"budget": None}), ("h2o", {"budget": None}), ("snapkv", {"budget": None})]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tok = load_model("smollm2")
    prompt, _ = needle_prompt(tok, args.tokens, 0.5, seed=0)
    ids = tok(prompt, return_tensors="pt").input_ids

    def prefill(make_cache):
        def run():
            cache = make_cache()
            with attach(model, cache=cache) if isinstance(cache, KVPackCache) else contextlib.nullcontext():
                model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
        return run

    dense = median_seconds(prefill(lambda: DynamicCache(config=model.config)), args.repeats)
    print(f"# bench_prefill_overhead  ({machine()}), {ids.shape[1]} tokens, budget {args.budget}")
    print(f"dense prefill (DynamicCache)   {dense * 1e3:9.1f} ms")
    for method, cfg in METHODS:
        cfg = {k: (args.budget if k == "budget" else v) for k, v in cfg.items()}
        t = median_seconds(prefill(lambda: KVPackCache(model, method, **cfg)), args.repeats)
        print(f"{method:<10} {str(cfg):<20} {t * 1e3:9.1f} ms   overhead {t / dense - 1:+6.1%}", flush=True)


if __name__ == "__main__":
    main()
