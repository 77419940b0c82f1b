"""Registers, spills and shared memory of kvpack's Triton kernels for CUDA GPUs, on any machine.

Compiles each kernel the way its launcher would launch it for the Llama-8B head shape (d = 128,
GQA group 4; page size and ranks as in ``gpu_check.py``) for each requested architecture, with a
stand-in CUDA driver (``kvpack.attention.triton.cross_compile``): no GPU is needed, and nothing runs.
Triton compiles one binary per specialization of the integer arguments (divisible by 16, equal to
1), so the segment length matters: ``--tokens`` takes several store lengths, by default 2040 (not a
multiple of 16, two 32-token blocks per program: what most real prompts compile to) and 1024 (a
multiple of 16, one block per program); they differ by up to 38 registers and in spills.
``--queries 1,64`` also compiles the launch of a 64-query chunk (a prefill over the stored history:
256 query rows, taken in blocks of 16 per program).

Usage: python benchmarks/kernel_resources.py [--arch 80,90] [--tokens 2040,1024] [--queries 1] [--json]
(without TRITON_INTERPRET; exits 1 if a kernel fails to compile)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from gpu_check import CONFIGS, build_store

from kvpack.attention.history_and_chunk import FUSED_CHUNK_MAX
from kvpack.attention.softmax_merge import PartialAttention, group_queries
from kvpack.attention.triton.anchor_op import anchor_partials
from kvpack.attention.triton.chunk_attend import fused_history_and_chunk
from kvpack.attention.triton.cross_compile import compile_only
from kvpack.attention.triton.puzzle_op import puzzle_partial
from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

VARIANTS = CONFIGS + [
    ("anchor", {"budget": 0.1, "residual_codec": "naive"}, "anchor naive 2-bit 0.1"),
    ("anchor_plus", {"budget": 0.1}, "anchor_plus 0.1 (uint8 index)"),
]


H, G, D = 2, 4, 128  # registers and shared memory depend on d, the group and the tiles, not on H


def store_rows(arches: list[int], queries: list[int], n_tokens: int) -> tuple[list[dict], bool]:
    """Compile facts of every configuration for stores of ``n_tokens`` tokens, per architecture and
    queries per launch, and whether any compile failed (each failure is reported on stderr; the
    rest still compile)."""
    rows, failed = [], False
    stores = [(label, method, build_store(method, {**cfg, "attention_backend": "torch"}, H, G, D, n_tokens,
                                          torch.device("cpu")))
              for method, cfg, label in VARIANTS]
    for n_q in queries:
        qg = group_queries(torch.randn(H * G, n_q, D), H)
        for arch in arches:
            for label, method, (store, _, _) in stores:
                try:
                    with compile_only(arch) as builds:
                        if method == "puzzle":
                            puzzle_partial(store.pages_view(), qg, D ** -0.5)
                        elif method == "puzzle_plus":
                            ragged_puzzle_partial(store.pages_view(), qg, D ** -0.5)
                        else:
                            anchor_partials(store.segment_views(), qg, D ** -0.5)
                except Exception as e:  # report every configuration, then fail
                    failed = True
                    print(f"sm_{arch} {label} ({n_tokens} tokens, {n_q} queries): compile FAILED: "
                          f"{type(e).__name__}: {e}", file=sys.stderr)
                    continue
                rows += [{"config": label, "tokens": n_tokens, "queries": n_q, **dataclasses.asdict(b)}
                         for b in builds]
    return rows, failed


def chunk_rows(arches: list[int], queries: list[int]) -> tuple[list[dict], bool]:
    """Compile facts of the end of a decode step (the chunk's attention merged with two stored states
    and a stored tail), for the longest chunk it takes; it does not depend on the stores."""
    rows, failed = [], False
    for n_q in queries:
        n_c = min(n_q, FUSED_CHUNK_MAX)
        for arch in arches:
            states = [PartialAttention(torch.zeros(H, G * n_c), torch.ones(H, G * n_c), torch.zeros(H, G * n_c, D))] * 2
            chunk = group_queries(torch.randn(H * G, n_c, D), H), torch.randn(H, n_c, D), torch.randn(H, n_c, D)
            try:
                with compile_only(arch) as builds:
                    fused_history_and_chunk(states, *chunk, D ** -0.5, H * G, tail=(torch.randn(H, 40, D),) * 2)
            except Exception as e:
                failed = True
                print(f"sm_{arch} chunk attend ({n_c} queries): compile FAILED: {type(e).__name__}: {e}",
                      file=sys.stderr)
                continue
            rows += [{"config": "chunk attend", "tokens": None, "queries": n_c, **dataclasses.asdict(b)}
                     for b in builds]
    return rows, failed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80 (A100), 90 (H100/H200)")
    parser.add_argument("--tokens", default="2040,1024", help="store lengths, comma-separated")
    parser.add_argument("--queries", default="1", help="queries per launch, comma-separated (1 = a decode step)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arches = [int(a) for a in args.arch.split(",")]
    queries = [int(n) for n in args.queries.split(",")]
    token_counts = [int(t) for t in args.tokens.split(",")]
    rows, failed = chunk_rows(arches, queries)
    for n_tokens in token_counts:
        more, bad = store_rows(arches, queries, n_tokens)
        rows, failed = rows + more, failed or bad
    if args.json:
        print(json.dumps(rows))
    else:
        print("| arch | config | tokens | queries | kernel | registers | spilled bytes | shared KiB | warps | stages |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| sm_{r['arch']} | {r['config']} | {r['tokens'] or '–'} | {r['queries']} | {r['name']} "
                  f"| {r['registers']} | {r['spill_bytes']} "
                  f"| {r['shared_bytes'] / 1024:.1f} | {r['num_warps']} | {r['num_stages']} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
