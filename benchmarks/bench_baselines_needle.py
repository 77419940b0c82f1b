"""Every registered codec on a ~2K-token SmolLM2 needle prompt at budgets 0.25 and 0.1, through
``kvpack generate --json`` (one subprocess per run, as a user would call it).

Prints one row per (method, budget): retrieved or not, the measured ratio after generation, the
resolved config, or the error a codec gives for a budget it cannot reach.

Usage: python benchmarks/bench_baselines_needle.py [--tokens 2048] [--budgets 0.25,0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402

METHODS = ["full", "puzzle", "anchor", "svd", "kivi", "streaming", "h2o", "snapkv"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budgets", default="0.25,0.1")
    parser.add_argument("--depth", type=float, default=0.5)
    args = parser.parse_args()
    _, tok = load_model("smollm2")
    prompt, answer = needle_prompt(tok, args.tokens, args.depth, seed=14)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    print(f"# needle {answer} at depth {args.depth}, ~{args.tokens} tokens")
    print("method     budget  retrieved  ratio   text                resolved")
    for method in METHODS:
        for budget in ([None] if method == "full" else [float(b) for b in args.budgets.split(",")]):
            cmd = [sys.executable, "-m", "kvpack.cli", "generate", "--method", method, "--prompt-file", f.name,
                   "--max-new-tokens", "10", "--json", "--quiet"]
            if budget is not None:
                cmd += ["--budget", str(budget)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                err = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"
                print(f"{method:<10} {budget!s:<7} refused    {err}")
                continue
            row = json.loads(run.stdout)
            keys = ("rank_k", "rank_v", "rank", "kept_tokens", "bits", "group_size", "residual")
            resolved = {k: row["config"][k] for k in keys if k in row["config"]}
            print(f"{method:<10} {budget!s:<7} {'yes' if answer in row['text'] else 'no':<9}  {row['ratio']:.3f}  "
                  f"{row['text'].strip()[:18]!r:<20} {json.dumps(resolved)}", flush=True)
    os.unlink(f.name)


if __name__ == "__main__":
    main()
