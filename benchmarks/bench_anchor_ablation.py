"""AnchorKV's ablations (paper Fig. 5) and its beyond-the-paper options, side by side on SmolLM2.

One exact prefill of ``--tokens`` tokens of real text (the pydoc pages kvtc calibrates on,
from ``--offset`` tokens in), then, per configuration and θ, the cache is compressed from that
prefill and the next ``--continuation`` tokens are teacher-forced through it. Reported against
FullKV on the same tokens: mean next-token KL(FullKV ‖ config), top-1 agreement, the continuation's
perplexity, and the measured byte ratio.

Usage: python benchmarks/bench_anchor_ablation.py [--tokens 4096] [--budgets 0.2,0.1,0.05]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _util import machine  # noqa: E402

from kvpack.divergence import kl_per_position  # noqa: E402
from kvpack.eval.runner import teacher_forced_logprobs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.hf.prefill import exact_prefill  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.storage.kvtc.corpus import calibration_documents  # noqa: E402

CONFIGS = [
    ("faithful (paper)", {}),
    ("rank: attention", {"ranking": "attention"}),
    ("rank: residual_norm", {"ranking": "residual_norm"}),
    ("rank: cosine", {"ranking": "cosine"}),
    ("rank: random", {"ranking": "random"}),
    ("no random anchors", {"random_anchors": False}),
    ("per-head residuals", {"residual_split": "per_head"}),
    ("no residuals", {"residuals": False}),
    ("naive 2-bit", {"residual_codec": "naive"}),
    ("+ residual_pooling 15", {"residual_pooling": 15}),
    ("+ narrow_index", {"narrow_index": True}),
    ("+ both", {"residual_pooling": 15, "narrow_index": True}),
    # Past the 2-bit saturation point (anchor_plus's options; below it both build "+ both"'s cache).
    ("+ both, past: anchors", {"residual_pooling": 15, "narrow_index": True, "above_saturation": "anchors"}),
    ("+ both, past: residual4", {"residual_pooling": 15, "narrow_index": True, "above_saturation": "residual4"}),
]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--offset", type=int, default=20_000, help="tokens of the corpus skipped first")
    parser.add_argument("--budgets", default="0.2,0.1,0.05")
    parser.add_argument("--only", default=None, help="substring a configuration's label must contain")
    args = parser.parse_args()
    model, tok = load_model("smollm2")
    text = "\n\n".join(calibration_documents()[:200])
    ids = tok(text).input_ids[args.offset: args.offset + args.tokens + args.continuation]
    prompt, cont = ids[: args.tokens], ids[args.tokens:]
    total = len(ids)
    prefill = exact_prefill(model, prompt)
    ref = teacher_forced_logprobs(model, get_method("full").from_prefill(model, prefill), cont, total)
    targets = torch.tensor(cont[1:])
    print(f"# bench_anchor_ablation  ({machine()}), SmolLM2, {args.tokens}-token prompt, "
          f"{len(cont)} teacher-forced tokens; FullKV continuation ppl "
          f"{math.exp(-ref[:-1].gather(1, targets[:, None]).mean()):.2f}")
    print("θ      config                    ratio    KL     top-1   ppl    anchors  residuals(k,v)  4-bit(k,v)      s")
    for budget in (float(b) for b in args.budgets.split(",")):
        for label, cfg in CONFIGS:
            if args.only and args.only not in label:
                continue
            start = time.perf_counter()
            try:
                built = get_method("anchor", budget=budget, **cfg).from_prefill(model, prefill)
            except ValueError as exc:
                print(f"{budget:<6} {label:<24} refused: {exc}")
                continue
            logp = teacher_forced_logprobs(model, built, cont, total)
            kl = kl_per_position(ref, logp).mean().item()
            top1 = (ref.argmax(-1) == logp.argmax(-1)).float().mean().item()
            ppl = math.exp(-logp[:-1].gather(1, targets[:, None]).mean().item())
            store = built.cache.kvpack_layers[0].rows[0]
            print(f"{budget:<6} {label:<24} {built.kv_bytes / built.dense_kv_bytes:.4f}  {kl:.4f}  {top1:.3f}  "
                  f"{ppl:6.2f}  {store.n_anchors:>6}   {json.dumps(list(store.n_residuals)):<14}  "
                  f"{json.dumps(list(store.n_fine)):<14}  {time.perf_counter() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
