"""kvtc calibrations whose PCA basis is block-diagonal over groups of layers (or per KV head) instead of kvtc's one
cross-layer basis: the same features, the same DP bit allocation and the same coder, so a probe of them
(``benchmarks/bench_kl_probe.py --variants kvtc+ratio=16+calibration=DIR+level=0 ...``) measures what the
cross-layer transform itself is worth — and what a resident code restricted to one layer (which attention could
read layer by layer) or a few layers would give up.

Each group's basis is :func:`kvpack.storage.kvtc.calibration.block_pca` (the exact eigendecomposition of its
features' covariance over the calibration positions, kvtc's settings and corpus; the components of all groups
ordered by variance and cut at kvtc's ``pca_dim``), as ``kvpack calibrate --layer-group`` makes it; this script
adds one basis per KV head, and writes every group size from one pass over the corpus.

Usage:
    python benchmarks/kvtc_layer_groups.py --model smollm2 --out DIR_PREFIX head 1 5   # writes DIR_PREFIX-head, -1, -5
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True, help="prefix of the calibration directories (one per group size)")
    p.add_argument("groups", nargs="+", help="layers per group (an integer), or 'head' (one basis per KV head)")
    args = p.parse_args()

    from kvpack.hf.fingerprint import attention_shape, full_attention_layers, model_fingerprint
    from kvpack.hf.models import load_model
    from kvpack.ops.bitalloc import aligned_group_errors, allocate_bits
    from kvpack.storage.kvtc.calibration import (
        BF16_BITS,
        Calibration,
        CalibrationSettings,
        _calibration_chunks,
        _truncate,
        block_pca,
        collect_features,
        ratio_key,
    )

    model, tok = load_model(args.model, dtype=torch.bfloat16)
    settings = CalibrationSettings(ratios=(8.0, 16.0))
    shape = attention_shape(model)
    layers = full_attention_layers(model)
    start = time.perf_counter()
    keys, values = collect_features(model, _calibration_chunks(tok, settings, None), layers, shape["head_dim"],
                                    settings.sinks, settings.window, True)
    print(f"features {list(keys.shape)} in {time.perf_counter() - start:.0f} s", flush=True)
    n, p_features = keys.shape
    width = shape["kv_heads"] * shape["head_dim"]
    dp_pick = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed))[:settings.dp_samples]
    for group in args.groups:
        size = shape["head_dim"] if group == "head" else int(group) * width
        means, bases, allocations = {}, {}, {}
        for kind, data in (("keys", keys), ("values", values)):
            mean, basis, sv = block_pca(data, size, settings.pca_dim)
            errors = aligned_group_errors((data - mean)[dp_pick] @ basis)
            for ratio in settings.ratios:
                allocations.setdefault(ratio_key(ratio), {})[kind] = allocate_bits(
                    errors, basis.shape[1], int(BF16_BITS * p_features // ratio))
            means[kind], bases[kind] = mean, basis
            total = float((data - mean).pow(2).sum())
            leading = float(sv[:256].double().pow(2).sum() / total)
            print(f"{group}: {kind} variance in the leading 256 components {leading:.3f}", flush=True)
        for kind in ("keys", "values"):
            used = max(a[kind].coded_extent for a in allocations.values())
            bases[kind] = bases[kind][:, :used].contiguous()
            for a in allocations.values():
                a[kind] = _truncate(a[kind], used)
        calibration = Calibration(
            fingerprint=model_fingerprint(model), layers=layers, kv_heads=shape["kv_heads"],
            head_dim=shape["head_dim"], key_mean=means["keys"], key_basis=bases["keys"], value_mean=means["values"],
            value_basis=bases["values"], allocations=allocations, settings=settings.to_dict(),
            stats={"basis": f"block-diagonal: {group} {'' if group == 'head' else 'layers '}per block"})
        calibration.save(f"{args.out}-{group}")
        print(f"wrote {args.out}-{group}", flush=True)


if __name__ == "__main__":
    main()
