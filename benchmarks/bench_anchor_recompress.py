"""Effect of AnchorKV's optional tail re-compression on a long generation (SmolLM2).

Generates --new-tokens tokens after a ~2K-token prompt at θ = --budget, with generated tokens
dense (the paper) and with ``recompress_every`` = 64, 128; prints the measured ratio after
generation, the decode time and whether both runs produced the same text.

Usage: python benchmarks/bench_anchor_recompress.py [--new-tokens 256] [--budget 0.1]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvpack.generate import generate  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.1)
    args = parser.parse_args()
    model, tok = load_model("smollm2")
    prompt, _ = needle_prompt(tok, 2048, 0.5, seed=0)
    prompt += " Now write a long story about the sea."
    print(f"# AnchorKV θ = {args.budget}, ~2K-token prompt, {args.new_tokens} generated tokens")
    print("recompress_every  new tokens  ratio after generation  total s  first 40 characters")
    for every in (None, 64, 128):
        cfg = {"budget": args.budget, "recompress_every": every}
        r = generate(model, tok, prompt, "anchor", cfg, max_new_tokens=args.new_tokens,
                     min_new_tokens=args.new_tokens)
        print(f"{every!s:<17} {r.new_tokens:>10}  {r.ratio:>22.4f}  {r.total_s:>7.1f}  {r.text[:40]!r}", flush=True)


if __name__ == "__main__":
    main()
