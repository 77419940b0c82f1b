"""How a cross-layer kvtc code's components spread their energy over the layers: for each layer, how many of the
coded components carry 99% / 99.9% / 99.99% of that layer's coded energy.

``kvtc_resident`` rebuilds each layer from every coded component (``2 · n · r · kv_heads · d`` multiply-adds a
layer). If each layer drew nearly all of its energy from a few of the ``r`` components, a layer could be rebuilt
from those alone at a small, bounded error; this measures whether it does. A component ``c``'s energy in layer
``l`` is the coefficient's mean square over a prompt's coded tokens times the squared norm of the basis vector's
rows of that layer (``E[D_c²] · ‖B_{l,c}‖²``).

Usage:
    python benchmarks/kvtc_layer_energy.py --calibration DIR --ratio 16 --json OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _util import machine  # noqa: E402

SHARES = (0.99, 0.999, 0.9999)


def components_for_share(energy: torch.Tensor, share: float) -> int:
    """The fewest components whose energies ``[r]`` sum to ``share`` of the total."""
    ranked = energy.sort(descending=True).values
    cumulative = ranked.cumsum(0) / ranked.sum()
    return int((cumulative < share).sum()) + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calibration", required=True, help="a kvtc calibration directory of the model")
    p.add_argument("--ratio", type=float, default=16.0)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length (a needle prompt)")
    p.add_argument("--json", required=True, help="append the result here (JSON lines)")
    args = p.parse_args()

    from kvpack.hf.models import load_model
    from kvpack.hf.prefill import exact_prefill
    from kvpack.methods import get_method
    from kvpack.prompts import needle_prompt

    model, tok = load_model(args.model, dtype=torch.bfloat16)
    text, _ = needle_prompt(tok, args.tokens)
    ids = tok(text)["input_ids"]
    method = get_method("kvtc_resident", calibration=args.calibration, ratio=args.ratio, decode_precision="float32")
    group = method.from_prefill(model, exact_prefill(model, ids)).cache.kvpack_layers[0].rows[0].group
    result = {"command": "python benchmarks/kvtc_layer_energy.py " + " ".join(sys.argv[1:]), "model": args.model,
              "ratio": args.ratio, "prompt_tokens": len(ids), "coded_tokens": group.n_coded, "machine": machine(),
              "kvpack_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True).stdout.strip()}
    for kind in ("keys", "values"):
        coefficients = group.coefficients(kind, 0).double()  # [n, r]
        mean_square = (coefficients ** 2).mean(0)
        r = coefficients.shape[1]
        counts = {share: [] for share in SHARES}
        for position in range(len(group.layer_order)):
            rows = group.calibration.inverse_basis(kind, position, r, torch.float64)  # [r, kv_heads·d]
            energy = mean_square * (rows ** 2).sum(1)
            for share in SHARES:
                counts[share].append(components_for_share(energy, share))
        result[kind] = {"coded_components": r, **{
            f"components_for_{share:g}": {"min": min(c), "mean": sum(c) / len(c), "max": max(c)}
            for share, c in counts.items()}}
        print(kind, result[kind], flush=True)
    with open(args.json, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
