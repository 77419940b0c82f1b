"""Needle retrieval of PuzzleKV and AnchorKV configurations on SmolLM2 (greedy), with measured byte ratios.

Ten 7-digit needles at depths 0.1..0.9 in RULER-style noise of about --tokens tokens. Prints, per
configuration, how many needles were retrieved exactly and the mean measured ratio.

Usage: python benchmarks/bench_needle.py [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _util import machine  # noqa: E402

from kvpack.generate import generate  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402

CONFIGS = [
    ("full", {}),
    ("puzzle", {}),  # faithful default: P = 32, ranks (13, 12)
    ("puzzle", {"key_rope": "pre"}),
    ("puzzle", {"page_size": 16}),
    ("puzzle", {"page_size": 48, "budget": 0.6}),
    ("puzzle", {"page_size": 64, "budget": 0.6}),
    ("puzzle", {"page_size": 64, "budget": 0.6, "int4": True}),
    ("puzzle", {"budget": 0.4}),  # the faithful method at puzzle_plus's 0.4 (below)
    ("puzzle", {"page_size": 64, "budget": 0.4, "int4": True, "key_rope": "pre"}),  # one rank, same options
    ("puzzle", {"page_size": 64, "budget": 0.3, "int4": True, "key_rope": "pre"}),
    ("puzzle", {"page_size": 64, "budget": 0.2, "int4": True, "key_rope": "pre"}),
    # Beyond the paper: ranks water-filled per (layer, head, page, side) under one whole-cache budget.
    ("puzzle_plus", {"budget": 0.4}),  # defaults: P = 64, INT4, pre-RoPE keys, rank_step 4
    ("puzzle_plus", {"budget": 0.4, "page_size": 32}),
    ("puzzle_plus", {"budget": 0.4, "int4": False}),  # bf16 factors, pre-RoPE
    ("puzzle_plus", {"budget": 0.4, "key_rope": "post"}),  # INT4, post-RoPE
    ("puzzle_plus", {"budget": 0.4, "int4": False, "key_rope": "post"}),
    ("puzzle_plus", {"budget": 0.4, "attention_weight": 0.5}),
    ("puzzle_plus", {"budget": 0.3}),
    ("puzzle_plus", {"budget": 0.2}),
    ("anchor", {"budget": 0.1}),  # faithful defaults: W = 32, k = max(S/128, W), rho = 0.7, kernel 7
    ("anchor", {"budget": 0.05}),
    ("anchor", {"budget": 0.2}),
    ("anchor", {"budget": 0.1, "anchors": 128}),
    ("anchor", {"budget": 0.1, "window": 64}),
    # Beyond the paper (options, off by default): neighbourhood max-pool of the ranking, uint8 indices.
    ("anchor", {"budget": 0.1, "residual_pooling": 15}),
    ("anchor", {"budget": 0.05, "residual_pooling": 15}),
    ("anchor", {"budget": 0.1, "narrow_index": True}),
    ("anchor", {"budget": 0.05, "narrow_index": True}),
    ("anchor", {"budget": 0.1, "residual_pooling": 15, "narrow_index": True}),
    ("anchor", {"budget": 0.05, "residual_pooling": 15, "narrow_index": True}),
]
CASES = [(10, 0.1), (11, 0.2), (12, 0.3), (13, 0.4), (14, 0.5), (15, 0.6), (16, 0.7), (17, 0.9), (7, 0.4), (3, 0.8)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--methods", default=None, help="comma-separated methods to run (default: all)")
    parser.add_argument("--only", default=None, help="substring a configuration's JSON must contain")
    args = parser.parse_args()
    wanted = set(args.methods.split(",")) if args.methods else None
    model, tok = load_model("smollm2")
    prompts = [needle_prompt(tok, args.tokens, depth, seed) for seed, depth in CASES]
    print(f"# bench_needle  ({machine()}), {len(CASES)} needles, ~{args.tokens} tokens")
    print("method  config                                          retrieved  mean ratio  resolved")
    for method, cfg in CONFIGS:
        if wanted is not None and method not in wanted:
            continue
        if args.only and args.only not in json.dumps(cfg):
            continue
        hits, ratios, ranks = 0, [], None
        for prompt, answer in prompts:
            r = generate(model, tok, prompt, method, cfg, max_new_tokens=10)
            hits += answer in r.text
            ratios.append(r.ratio)
            keys = ("rank_k", "rank_v", "anchors", "residuals_k", "residuals_v", "rank_k_mean", "rank_v_mean")
            ranks = {k: r.config[k] for k in keys if k in r.config}
        print(f"{method:<7} {json.dumps(cfg):<47} {hits:>4}/{len(CASES)}  {sum(ratios) / len(ratios):>10.3f}  {ranks}",
              flush=True)


if __name__ == "__main__":
    main()
