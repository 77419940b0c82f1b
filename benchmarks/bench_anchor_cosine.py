"""Median |cos| between each token and its nearest anchor, pre-RoPE vs post-RoPE keys (AnchorKV Fig. 7).

SmolLM2 on ~2K tokens of Python's pydoc topics (or the repetitive needle noise, --text noise); per layer and KV
head the anchors are AnchorKV's default
selection for this length (the last W positions plus seeded random positions; the same positions
for both key forms), and every non-anchor key's largest |cos| to an anchor is taken. Prints the
median per band of layers and overall, and the pre − post difference (the paper reports ≈ 0.27).

Usage: python benchmarks/bench_anchor_cosine.py [--tokens 2048]
"""

from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DynamicCache  # noqa: E402

from kvpack.hf.cache import cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.hf.rotary import find_rotary  # noqa: E402
from kvpack.ops.rope import RotaryTable, invert_rope  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402


def nearest_anchor_cos(x: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """``x [S, D]`` -> max |cos| of every non-anchor row to the anchor rows."""
    a = x[anchor_pos]
    cos = (x @ a.T) / (x.norm(dim=-1)[:, None] * a.norm(dim=-1)[None, :]).clamp_min(1e-30)
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[anchor_pos] = False
    return cos.abs().amax(dim=-1)[keep]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--text", choices=["pydoc", "noise"], default="pydoc",
                        help="pydoc: Python's own documentation; noise: the needle prompt's repeated sentences")
    args = parser.parse_args()
    model, tok = load_model("smollm2")
    if args.text == "pydoc":  # real English prose and code that every Python install has
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    else:
        ids = tok(needle_prompt(tok, args.tokens, 0.5, seed=0)[0], return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
    S, W = ids.shape[1], 32
    rope = RotaryTable(find_rotary(model), model.config.head_dim)
    cos, sin = rope.cos_sin(torch.arange(S))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layer_idx, layer in enumerate(cache.layers):
        post = layer.keys[0].float()
        pre = invert_rope(post, cos, sin)
        for h in range(post.shape[0]):
            rand = torch.randperm(S - W, generator=gen)[: args.anchors - W]
            anchor_pos = torch.cat([rand, torch.arange(S - W, S)])
            rows.append((layer_idx, nearest_anchor_cos(pre[h], anchor_pos).median().item(),
                         nearest_anchor_cos(post[h], anchor_pos).median().item()))
    print(f"# median |cos| to the nearest of {args.anchors} anchors, SmolLM2, {S} tokens of {args.text}")
    print("layers   pre-RoPE  post-RoPE  difference")
    n_layers = len(cache.layers)
    for lo in range(0, n_layers, 6):
        band = [r for r in rows if lo <= r[0] < lo + 6]
        pre = sum(r[1] for r in band) / len(band)
        post = sum(r[2] for r in band) / len(band)
        print(f"{lo:>2}-{min(lo + 5, n_layers - 1):<2}    {pre:8.3f}  {post:9.3f}  {pre - post:+10.3f}")
    pre = sum(r[1] for r in rows) / len(rows)
    post = sum(r[2] for r in rows) / len(rows)
    print(f"all      {pre:8.3f}  {post:9.3f}  {pre - post:+10.3f}")


if __name__ == "__main__":
    main()
