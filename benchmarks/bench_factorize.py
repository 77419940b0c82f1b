"""Page factorization throughput and its cost relative to SmolLM2's prefill.

Measures, on the real keys/values of a SmolLM2 prefill (needle-in-filler prompt):
  * pages/s of the batched Gram-eigen factorization (all pages of all heads of a layer at once),
  * factorization time of all 30 layers as a fraction of the dense 4K-token prefill,
  * end-to-end prefill with the PuzzleKV cache vs the full cache (same run).

Usage: python benchmarks/bench_factorize.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _util import machine, median_seconds  # noqa: E402

from kvpack import attach  # noqa: E402
from kvpack.hf.cache import cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.ops.lowrank import gram_eigh_factors  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402
from kvpack.resident.puzzle import PuzzleConfig, default_ranks  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tok = load_model("smollm2")
    prompt, _ = needle_prompt(tok, n_tokens=args.tokens, depth=0.5, seed=0)
    ids = tok(prompt, return_tensors="pt").input_ids
    S = ids.shape[1]

    from transformers import DynamicCache

    def dense_prefill():
        model(ids, logits_to_keep=1, **cache_kwargs(model, DynamicCache(config=model.config)))

    def cache_prefill(method, **cfg):
        def run():
            with attach(model, method, **cfg) as cache:
                model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
        return run

    t_dense = median_seconds(dense_prefill, args.repeats)
    cache = DynamicCache(config=model.config)
    model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
    cfg = PuzzleConfig()
    P, d = cfg.page_size, 64
    rk, rv = default_ranks(P, d)
    layers = [(layer.keys[0].float(), layer.values[0].float()) for layer in cache.layers]
    n_pages = (S - P) // P - 1  # sink page and window excluded, as the store does
    pages = [(k[:, P:P + n_pages * P].reshape(k.shape[0], n_pages, P, d),
              v[:, P:P + n_pages * P].reshape(v.shape[0], n_pages, P, d)) for k, v in layers]

    def factorize_all():
        for k, v in pages:
            gram_eigh_factors(k, rk)
            gram_eigh_factors(v, rv)

    t_fact = median_seconds(factorize_all, args.repeats)
    total_pages = sum(k.shape[0] * k.shape[1] * 2 for k, _ in pages)
    t_full = median_seconds(cache_prefill("full"), args.repeats)
    t_puzzle = median_seconds(cache_prefill("puzzle"), args.repeats)
    print(f"# bench_factorize  ({machine()})")
    print(f"prompt tokens                          {S}")
    print(f"pages factorized (K and V, all layers) {total_pages}  (P={P}, ranks {rk}/{rv})")
    print(f"factorization time, all layers         {t_fact * 1e3:.1f} ms  ({total_pages / t_fact:,.0f} pages/s)")
    print(f"dense prefill (DynamicCache, sdpa)     {t_dense * 1e3:.1f} ms")
    print(f"factorization / dense prefill          {t_fact / t_dense:.1%}")
    print(f"prefill with full cache (kvpack)       {t_full * 1e3:.1f} ms")
    print(f"prefill with puzzle cache (kvpack)     {t_puzzle * 1e3:.1f} ms  "
          f"(overhead vs dense prefill {t_puzzle / t_dense - 1:+.1%})")


if __name__ == "__main__":
    main()
