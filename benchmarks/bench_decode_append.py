"""What PuzzleKV's incremental compression costs per decode step: the recent-set fold vs one
concatenation of the layer's factors per page.

Llama-8B head shape (8 KV heads, d = 128), bf16 storage, P = 32 at budget 0.6 (the paper's ranks),
synthetic keys/values. For each context, a store is prefilled, then 8 pages' worth of decode tokens
(256) are appended one at a time and the appends are timed (factorization of each page included,
attention not). "one concatenation per page" forces a fold on every page — what the store did
before the recent set — in the same run, on the same data.

Usage: python benchmarks/bench_decode_append.py [--contexts 8192,32768]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
from _util import machine
from bench_decode_attention import synthetic_kv

from kvpack.resident import LayerLayout, get_resident_method
from kvpack.resident import puzzle as puzzle_module


def _append_seconds(seq: int, steps: int, fold_every_page: bool) -> tuple[float, int]:
    H, d = 8, 128
    layout = LayerLayout(layer_idx=0, kv_heads=H, q_heads=4 * H, head_dim=d, model_dtype=torch.bfloat16)
    store = get_resident_method("puzzle", budget=0.6, page_size=32).new_store(layout)
    k, v = synthetic_kv(H, seq + steps, d)
    k, v = k.bfloat16(), v.bfloat16()
    store.append(k[:, :seq], v[:, :seq])
    threshold = (lambda n: 1) if fold_every_page else puzzle_module.fold_threshold
    with mock.patch.object(puzzle_module, "fold_threshold", threshold):
        start = time.perf_counter()
        for t in range(seq, seq + steps):
            store.append(k[:, t:t + 1], v[:, t:t + 1])
        elapsed = time.perf_counter() - start
    return elapsed, store.nbytes()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    print(f"# bench_decode_append  ({machine()})")
    print("| context | steps | recent set: ms/step | one concatenation per page: ms/step | bytes held (both) |")
    print("|---|---|---|---|---|")
    for seq in (int(c) for c in args.contexts.split(",")):
        folded, bytes_a = _append_seconds(seq, args.steps, fold_every_page=False)
        concat, bytes_b = _append_seconds(seq, args.steps, fold_every_page=True)
        assert bytes_a == bytes_b  # the same pages, the same bytes
        print(f"| {seq} | {args.steps} | {folded / args.steps * 1e3:.3f} | {concat / args.steps * 1e3:.3f} "
              f"| {bytes_a} |")


if __name__ == "__main__":
    main()
