"""A quick fidelity probe for design choices: KL(FullKV ‖ method) of method variants on a few frontier
samples, paired, without the frontier's greedy decode (minutes, not hours).

Each sample is one of the frontier's RULER-style tasks (``kvpack.eval.tasks``) at one length, in one
setting — the frontier's own samples, one task after another; every variant is built from the same
exact prefill and scored by the frontier's own fidelity pass (the answer and a held-out continuation
teacher-forced, KL per position against the exact cache).
It prints and appends to ``--json`` the mean KL, the measured bytes and the geometric mean of each
variant's per-sample KL ratio to the first variant, with a 95% interval (t over the log-ratios).

It is a probe: a handful of samples to choose a default, not evidence for a claim about a method —
that is the frontier's (``benchmarks/frontier.py``).

Usage:
    python benchmarks/bench_kl_probe.py --variants 'pca_quant@0.15' 'pca_quant@0.15+balance=head' \\
        [--model smollm2] [--samples 8] [--length 4096] [--setting query-agnostic] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import SAMPLES_PER_TASK_AND_LENGTH, machine_fields  # noqa: E402

TASK_ORDER = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "cwe",
              "fwe")
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
         20: 2.09, 30: 2.04}


def parse_variant(text: str):
    """``METHOD[@BUDGET][+KEY=VALUE...]`` -> ``(label, method, config)`` (values typed by the method's config)."""
    from kvpack.methods import method_config_class

    head, *sets = text.split("+")
    method, _, budget = head.partition("@")
    config = method_config_class(method).parse_overrides(sets) if sets else {}
    if budget:
        config["budget"] = float(budget)
    return text, method, config


def _t(df: int) -> float:
    return T_975[max(k for k in T_975 if k <= df)] if df >= 1 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", required=True, help="METHOD[@BUDGET][+KEY=VALUE...]; the first is the base")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--samples", type=int, default=8, help="one per task in turn (8 tasks), then the next index")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--setting", default="query-agnostic", choices=("query-agnostic", "query-aware"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--json", default=None, help="append one record (every variant) to this JSON-lines file")
    args = p.parse_args()

    from kvpack.eval.runner import EvalPlan, MethodSpec, _fidelity, _prepare_unit
    from kvpack.hf.models import load_model
    from kvpack.methods import get_method

    variants = [parse_variant(v) for v in args.variants]
    for _, method, config in variants:  # refuse a bad variant before the model loads
        get_method(method, **config)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    # the frontier's own samples (a task's samples depend on how many the plan holds: their depths spread)
    per_sample = max(SAMPLES_PER_TASK_AND_LENGTH, -(-args.samples // len(TASK_ORDER)))
    plan = EvalPlan(tasks=list(TASK_ORDER), lengths=[args.length], samples=per_sample, specs=[MethodSpec("full")],
                    settings=[args.setting])
    kl = {label: [] for label, _, _ in variants}
    ratio = {label: [] for label, _, _ in variants}
    for i in range(args.samples):
        task, index = TASK_ORDER[i % len(TASK_ORDER)], i // len(TASK_ORDER)
        unit = _prepare_unit(model, tokenizer, plan, args.setting, task, args.length, index, None)
        for label, method, config in variants:
            built = get_method(method, **config).from_prefill(model, unit.prefill)
            kl[label].append(_fidelity(model, unit, built)["kl"])
            ratio[label].append(built.kv_bytes / built.dense_kv_bytes)
        print(f"{task} #{index}: " + ", ".join(f"{label} {kl[label][-1]:.4g}" for label, _, _ in variants), flush=True)
    base = variants[0][0]
    results = []
    for label, _, _ in variants:
        logs = [math.log(max(a, 1e-12) / max(b, 1e-12)) for a, b in zip(kl[label], kl[base])]
        mean = statistics.fmean(logs)
        half = _t(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
        results.append({"variant": label, "kl": statistics.fmean(kl[label]),
                        "bytes_ratio": statistics.fmean(ratio[label]), "kl_ratio_to_base": math.exp(mean),
                        "kl_ratio_ci": [math.exp(mean - half), math.exp(mean + half)], "per_sample_kl": kl[label]})
        r = results[-1]
        print(f"{label:48s} KL {r['kl']:.4g}  bytes {r['bytes_ratio']:.4f}  ÷ {base}: {r['kl_ratio_to_base']:.3f} "
              f"({r['kl_ratio_ci'][0]:.3f}–{r['kl_ratio_ci'][1]:.3f})")
    if args.json:
        record = {"command": "python benchmarks/bench_kl_probe.py " + " ".join(sys.argv[1:]), "model": args.model,
                  "setting": args.setting, "length": args.length, "samples": args.samples,
                  "base": base, "results": results, **machine_fields(args.dtype)}
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
