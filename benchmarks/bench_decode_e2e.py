"""End-to-end decode speed of every resident method beside transformers' own caches, in one run, against the
memory floor.

SmolLM2 (or ``--model qwen2.5-0.5b``) on CPU, a needle prompt of each length, greedy decoding of
``--new-tokens`` tokens through ``model.generate`` (``min_new_tokens`` = ``max_new_tokens``, so every row decodes
the same number of steps). Each row times every step (a streamer's timestamps): the prefill (prompt -> first token, the
method's compression included) and each later decode step; it prints the median and the mean
ms/token, the slowest step, and the median's ratio to transformers' ``DynamicCache`` measured in the
same run (the baseline row, first at each length). Peers: ``DynamicCache`` (SDPA) and transformers'
``QuantizedCache`` with the quanto backend at 4 and 2 bits (``pip install -e ".[peers]"``; skipped,
with a line saying so, where optimum-quanto is missing). KV bytes are the bytes the cache's tensors
hold ÷ the same tokens in bf16 (kvpack's rows; the peers' dense bytes are the model dtype's).

``--torch-path`` adds, for each kvpack row whose method has an ``attention_backend``, the same row
with ``attention_backend=torch`` (the PyTorch reference path), so the native kernels' gain is measured
in the same run.

**The floor.** A decode step reads at least the model's weights and the cache: each row records those bytes
(``weights_bytes``: every parameter's tensor, counted once; ``cache_bytes``: the tensors the cache holds after the
run) and the floor ``(weights + cache) / bandwidth``, with the bandwidth measured in the same run by a streaming
read of a buffer far larger than the last-level cache (``--probe-mb``; the median of a few passes of ``sum``, one
read of every byte, on torch's threads), so each median reads as ``x the floor``. Beside ``DynamicCache``, each row
is also rated against kvpack's own dense kernel (the ``full`` row, where it runs).

Rows may be presets (``pca_quant-salient@0.28``, ``kvtc_resident-8x``): a calibration a preset needs is made
on first use (``kvpack.attach``), before its row is timed (the warm-up run).

``--rebase N`` measures the ``DynamicCache`` row again after every N rows and at the end, and gives
each row its ratio to the mean of the two baseline runs around it (both printed as ``base ms``): on a
machine whose speed drifts during a run (a shared VM measured 232 then 302 ms/token for the same
baseline 25 minutes apart), a single baseline at the start skews every later ratio.

Usage: python benchmarks/bench_decode_e2e.py [--model smollm2] [--lengths 2048,4096,8192]
    [--dtypes float32,bfloat16] [--new-tokens 40] [--rows full,kivi@0.25,...] [--torch-path] [--rebase N]
    [--json out.jsonl]
A row may set config fields: ``puzzle_plus@0.25+dot_precision=float32``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _util import machine  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from kvpack import attach  # noqa: E402
from kvpack.hf.cache import cache_kwargs  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.prompts import needle_prompt  # noqa: E402

# Every resident method at its default budget and at 0.25 (anchor's default θ is 0.1; puzzle also at
# 0.6, the row). "name" = default config; "name@b" = budget b.
DEFAULT_ROWS = ("full", "puzzle", "puzzle@0.6", "puzzle@0.25", "puzzle_plus", "puzzle_plus@0.25", "anchor",
                "anchor@0.25", "anchor_plus", "anchor_plus@0.25", "svd", "svd@0.25", "kivi", "kivi@0.25",
                "streaming", "h2o", "snapkv")
PEERS = ("dynamic", "quanto4", "quanto2")


class StepTimes(BaseStreamer):
    """Timestamps of generate's puts: the first is the prompt, the second the first new token (the
    prefill ends there), each later one a decode step."""

    def __init__(self):
        self.stamps: list[float] = []
        self.start = time.perf_counter()

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def prefill_s(self) -> float:
        return self.stamps[1] - self.start

    def steps_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.stamps[1:], self.stamps[2:])]


def parse_row(row: str) -> tuple[str, dict]:
    """``METHOD[@BUDGET][+KEY=VALUE...]`` -> (method, config fields), typed by the method's config class
    (``puzzle_plus@0.25+dot_precision=float32``)."""
    from kvpack.methods import method_config_class

    head, *sets = row.split("+")
    name, _, budget = head.partition("@")
    cfg = method_config_class(name).parse_overrides(sets) if sets else {}
    return name, ({**cfg, "budget": float(budget)} if budget else cfg)


def weights_bytes(model) -> int:
    """Bytes of every parameter tensor, a tied one counted once: what a decode step reads of the weights."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def cache_bytes(cache) -> int:
    """Bytes of the tensors a cache holds: kvpack's measured bytes, or a transformers cache's keys and values."""
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def read_bandwidth(mb: int = 1024, passes: int = 5) -> float:
    """Bytes per second of a streaming read on torch's threads: the median of ``passes`` sums over an fp32 buffer
    of ``mb`` MB (each byte read once a pass; the buffer far larger than the last-level cache)."""
    buf = torch.ones(mb * 2 ** 20 // 4, dtype=torch.float32)
    buf.sum()  # touched once before timing (pages mapped)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times)


def quanto_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


@torch.no_grad()
def run_row(model, tok, ids, new_tokens: int, row: str, torch_path: bool) -> dict:
    """Generate with the row's cache; returns the timings and bytes."""
    from transformers import DynamicCache, QuantizedCache

    times = StepTimes()
    kv_ratio = None
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=times,
               attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
    if row in PEERS:
        if row == "dynamic":
            cache = DynamicCache(config=model.config)
        else:
            cache = QuantizedCache(backend="quanto", config=model.config, nbits=int(row[-1]))
        times.start = time.perf_counter()
        out = model.generate(ids, **gen, **cache_kwargs(model, cache))
        held = cache_bytes(cache)
        if row == "dynamic":
            kv_ratio = model.dtype.itemsize / 2
    else:
        name, cfg = parse_row(row)
        if torch_path:
            cfg["attention_backend"] = "torch"
        times.start = time.perf_counter()
        with attach(model, name, tokenizer=tok, **cfg) as cache:
            out = model.generate(ids, **gen, **cache_kwargs(model, cache))
        held = cache.kv_bytes()
        kv_ratio = held / cache.dense_kv_bytes()
    steps = times.steps_ms()
    return {"row": row + (" [torch path]" if torch_path else ""), "prefill_s": times.prefill_s(), "cache_bytes": held,
            "median_ms": statistics.median(steps), "mean_ms": statistics.fmean(steps), "max_ms": max(steps),
            "kv_ratio": kv_ratio, "new_tokens": out.shape[1] - ids.shape[1], "text_ids": out[0, ids.shape[1]:].tolist()}


def print_row(res: dict, base_ms: float | None = None) -> None:
    kv = "—" if res["kv_ratio"] is None else f"{res['kv_ratio']:.3f}"
    extra = "" if base_ms is None else f"{base_ms:>10.1f}"
    vs_full = "—" if res.get("ratio_full") is None else f"{res['ratio_full']:.2f}x"
    floor = "—" if res.get("x_floor") is None else f"{res['x_floor']:.2f}x"
    print(f"{res['row']:<32}{res['prefill_s']:>10.2f}{res['median_ms']:>10.1f}{res['mean_ms']:>8.1f}"
          f"{res['max_ms']:>9.1f}{res['ratio']:>11.2f}x{vs_full:>9}{floor:>9}{kv:>11}{extra}", flush=True)


def bracketed(done: list[dict]) -> None:
    """Re-rate every row against the mean of the baseline runs just before and after it (``--rebase``),
    and print the table again with that baseline beside each row."""
    base_at = [i for i, r in enumerate(done) if r["row"] == "dynamic"]
    print(f"\n# ratios to the mean of the DynamicCache runs around each row ({len(base_at)} baseline runs)")
    print(f"{'cache':<32}{'prefill s':>10}{'ms/token':>10}{'mean':>8}{'slowest':>9}{'vs Dynamic':>12}"
          f"{'vs full':>9}{'x floor':>9}{'KV / bf16':>11}{'base ms':>10}")
    for i, res in enumerate(done):
        if res["row"] == "dynamic":
            continue
        before = [j for j in base_at if j < i][-1:]
        after = [j for j in base_at if j > i][:1]
        base_ms = statistics.fmean(done[j]["median_ms"] for j in before + after)
        res.update(ratio=res["median_ms"] / base_ms, base_ms=base_ms)
        print_row(res, base_ms)


def write_json(path: str, rows: list[dict], fields: dict) -> None:
    """Append each row with the run's fields (command, commit, versions, CPU, bandwidth)."""
    with open(path, "a") as f:
        for res in rows:
            f.write(json.dumps({**fields, **{k: v for k, v in res.items() if k != "text_ids"}}) + "\n")


def has_backend(row: str) -> bool:
    name, _ = parse_row(row)
    return name not in PEERS and hasattr(get_method(name).config, "attention_backend")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or qwen2.5-0.5b (install_models.sh)")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--probe-mb", type=int, default=1024, help="the bandwidth probe's buffer (MB)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--rows", default=",".join(PEERS + DEFAULT_ROWS),
                        help="comma-separated rows: dynamic, quanto4, quanto2, METHOD[@BUDGET][+KEY=VALUE...]")
    parser.add_argument("--torch-path", action="store_true", help="also each kvpack row on the PyTorch path")
    parser.add_argument("--rebase", type=int, default=0,
                        help="re-measure the DynamicCache baseline after every N rows (0: once, first)")
    parser.add_argument("--json", help="append every row as a JSON line to this file")
    args = parser.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    if "dynamic" in rows:  # the baseline runs first at each length
        rows.remove("dynamic")
    rows.insert(0, "dynamic")
    if not quanto_available() and any(r.startswith("quanto") for r in rows):
        print("# optimum-quanto is not installed (pip install -e '.[peers]'): QuantizedCache rows skipped")
        rows = [r for r in rows if not r.startswith("quanto")]
    from frontier import machine_fields

    from kvpack.attention.cpu import native

    lib = native()  # built before any row is timed (a first build takes about a minute)
    bandwidth = read_bandwidth(args.probe_mb)
    print(f"# bench_decode_e2e ({machine()}), {args.model}, {args.new_tokens} new tokens per row; native CPU kernels: "
          f"{'built' if lib is not None else 'unavailable (PyTorch path)'}; streaming read {bandwidth / 1e9:.1f} GB/s")
    argv = sys.argv[1:]
    if args.json:  # the command as run from the repository root, wherever it ran from
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = [os.path.relpath(os.path.abspath(a), root) if a == args.json else a for a in argv]
    fields = {"command": "python benchmarks/bench_decode_e2e.py " + " ".join(argv), "model": args.model,
              **{k: v for k, v in machine_fields("").items() if k != "dtype"}, "machine": machine(),
              "read_bandwidth_gbs": round(bandwidth / 1e9, 2)}
    for dtype_name in args.dtypes.split(","):
        model, tok = load_model(args.model, dtype=getattr(torch, dtype_name))
        weights = weights_bytes(model)
        for n in map(int, args.lengths.split(",")):
            prompt, _ = needle_prompt(tok, n, 0.5, seed=0)
            ids = tok(prompt, return_tensors="pt").input_ids
            # The prompt and the new tokens stay within the model's positions (SmolLM2: 8,192): past
            # them the text is not meant to be read, and transformers warns.
            over = ids.shape[1] + args.new_tokens - model.config.max_position_embeddings
            if over > 0:
                prompt, _ = needle_prompt(tok, n - over, 0.5, seed=0)
                ids = tok(prompt, return_tensors="pt").input_ids
            print(f"\n## {dtype_name}, {ids.shape[1]} prompt tokens")
            print(f"{'cache':<32}{'prefill s':>10}{'ms/token':>10}{'mean':>8}{'slowest':>9}{'vs Dynamic':>12}"
                  f"{'vs full':>9}{'x floor':>9}{'KV / bf16':>11}")
            # every row once on a shorter prompt first: one-time builds and caches not timed (2K: long enough for
            # every budget a row can name; a 1K prompt cannot hold the dense tail of some at 0.15)
            warm_ids = ids[:, :2048]
            plan = [(r, False) for r in rows] + [(r, True) for r in rows if args.torch_path and has_backend(r)]
            if args.rebase > 0:  # the baseline again after every N rows and at the end
                body = plan[1:]
                plan = plan[:1]
                for i in range(0, len(body), args.rebase):
                    plan += body[i:i + args.rebase] + [("dynamic", False)]
            done: list[dict] = []  # in run order, baselines included
            for row, torch_path in plan:
                try:
                    run_row(model, tok, warm_ids, 2, row, torch_path)
                    res = run_row(model, tok, ids, args.new_tokens, row, torch_path)
                except Exception as exc:  # a row that cannot run says why; the others go on
                    print(f"{row:<32} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                base = next((r for r in reversed(done) if r["row"] == "dynamic"), res)
                full = next((r for r in done if r["row"] == "full"), res if row == "full" else None)
                floor_ms = (weights + res["cache_bytes"]) / bandwidth * 1e3
                res.update(dtype=dtype_name, prompt_tokens=ids.shape[1], weights_bytes=weights, floor_ms=floor_ms,
                           x_floor=res["median_ms"] / floor_ms, slowest_vs_median=res["max_ms"] / res["median_ms"],
                           same_tokens=res["text_ids"] == base["text_ids"], ratio=res["median_ms"] / base["median_ms"],
                           ratio_full=None if full is None else res["median_ms"] / full["median_ms"])
                done.append(res)
                print_row(res)
                if args.json and not args.rebase:  # each row as it completes (a killed run keeps them)
                    write_json(args.json, [res], fields)
            if args.rebase > 0:  # the ratios are known once the baseline after the last row is
                bracketed(done)
                if args.json:
                    write_json(args.json, done, fields)
        del model
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
