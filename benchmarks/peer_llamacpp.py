"""llama.cpp's quantized K/V cache as the CPU peer, on kvpack's eval samples.

The same SmolLM2 GGUF kvpack loads (the packaged ``SmolLM2-135M-Instruct.Q4_1.gguf``), the same token
ids as kvpack's eval (``make_sample``: context + question, every task / length / needle depth), greedy
decoding, and the answers scored by kvpack's scorer. llama.cpp runs with flash attention and K/V in
``f16``, ``q8_0`` (34 bytes per 32 values: 8.5 bits) and ``q4_0`` (18 bytes per 32: 4.5 bits); its
KV bytes are measured (``llama_state_seq_get_size`` of the sequence after the prompt, less the same
figure for a one-token prompt, per cached value). Per-token quantization does not depend on the
query, so one run serves both of kvpack's settings (query-aware and query-agnostic coincide).

llama.cpp is not a kvpack dependency: it runs in its own virtual environment, built from source
(``bash scripts/install_llamacpp.sh``, about 25 minutes on 2 cores), as a worker process that this
script starts with that environment's Python (``--venv``). Its whole-model speed is not kvpack's to
match (quantized weights, its own kernels); the comparable speed figure is each KV type's decode
ms/token ÷ llama.cpp's own f16 decode in the same run.

Usage: python benchmarks/peer_llamacpp.py [--venv .llamacpp-venv] [--lengths 2048,4096]
    [--tasks niah_single_1,niah_single_2] [--samples 8] [--kv f16,q8_0,q4_0] [--out results/peer-llamacpp]
    [--kvpack-results kvpack-eval/]   (adds kvpack's rows from an eval directory beside llama.cpp's)
       python benchmarks/peer_llamacpp.py --frontier --model smollm2   (the frontier's samples and rows)
       ... --frontier --model smollm2 --collect   (no worker: the rows of the raw rows earlier runs finished)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _peers import GGML_TYPES, build_samples, cpu_name, finished_rows, run_worker, table, write_outputs

# ggml's block sizes: (bytes per block, values per block) — the nominal bits per value.


# -- the worker (runs in the llama.cpp environment: llama_cpp and the standard library only) ----------


def worker(samples_path: str, gguf: str, kv_types: list[str], threads: int, out_path: str) -> None:
    import llama_cpp

    samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines()]
    n_ctx = max(len(s["ids"]) + s["max_new_tokens"] for s in samples) + 8
    done = {(tuple(r["key"]), r["kv"]) for r in finished_rows(out_path)}  # resumable: not run again
    cpu = f"{cpu_name()} (llama.cpp, {threads} threads)"
    with open(out_path, "a") as out:
        for kv in kv_types:
            todo = [s for s in samples if (tuple(s["key"]), kv) not in done]
            if not todo:
                continue
            type_id = GGML_TYPES[kv][0]
            llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                  n_batch=512, flash_attn=True, type_k=type_id, type_v=type_id, verbose=False)
            eos = llm.token_eos()

            # reset() empties the cache (the next eval drops every cached position from n_tokens = 0 on),
            # so no prompt reuses another's prefix and every prefill is timed in full.
            llm.reset()
            llm.eval(samples[0]["ids"][:1])
            base = int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))  # the state of one cached token
            llm.reset()
            llm.eval(samples[0]["ids"][:256])  # one-time setup, not timed
            for s in todo:
                stamps, new = [], []
                llm.reset()
                start = time.perf_counter()
                for tok in llm.generate(s["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                        reset=False):
                    stamps.append(time.perf_counter())
                    if tok == eos:
                        break
                    new.append(int(tok))
                    if len(new) >= s["max_new_tokens"]:
                        break
                state = int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))  # n_tokens evaluated tokens
                steps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
                out.write(json.dumps({"key": s["key"], "kv": kv, "new_ids": new, "prefill_s": stamps[0] - start,
                                      "steps_ms": steps, "state_bytes": state, "base_state_bytes": base,
                                      "cached_tokens": llm.n_tokens, "cpu": cpu}) + "\n")
                out.flush()
                print(f"[llama.cpp {kv}] {s['key']}: {len(new)} tokens", file=sys.stderr, flush=True)
            del llm


# -- the driver (kvpack's environment) ---------------------------------------------------------------


def llamacpp_rows(samples: list[dict], raw: list[dict], model_cfg, model: str = "smollm2") -> list[dict]:
    """Scored rows in kvpack's result schema (method ``llamacpp``, label ``llama.cpp <kv>``)."""
    from kvpack.eval.scoring import score
    from kvpack.hf.models import load_tokenizer

    tok = load_tokenizer(model)
    by_key = {tuple(s["key"]): s for s in samples}
    values_per_token = 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * (
        model_cfg.hidden_size // model_cfg.num_attention_heads)
    rows = []
    for r in raw:
        s = by_key[tuple(r["key"])]
        prediction = tok.decode(r["new_ids"], skip_special_tokens=True)
        kv_bytes = r["state_bytes"] - r["base_state_bytes"]
        bits = 8 * kv_bytes / ((r["cached_tokens"] - 1) * values_per_token)
        task, length, index = s["key"]
        rows.append({"task": task, "length": length, "sample": index, "depth": s["depth"], "method": "llamacpp",
                     "label": f"llama.cpp {r['kv']}", "kv": r["kv"], "prediction": prediction,
                     "score": score(prediction, s["answers"], s["metric"]), "bits_per_value": bits,
                     "ratio": bits / 16, "nominal_ratio": 8 * GGML_TYPES[r["kv"]][1] / GGML_TYPES[r["kv"]][2] / 16,
                     "prefill_s": r["prefill_s"], "steps": len(r["steps_ms"]), "cpu": r.get("cpu"),
                     "decode_ms": statistics.median(r["steps_ms"]) if r["steps_ms"] else None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".llamacpp-venv", help="the llama.cpp virtual environment")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv", default="f16,q8_0,q4_0")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="results/peer-llamacpp")
    parser.add_argument("--kvpack-results", help="a kvpack eval directory whose rows to print beside")
    parser.add_argument("--model", default="smollm2", help="smollm2 or qwen2.5-0.5b (its GGUF)")
    parser.add_argument("--frontier", action="store_true",
                        help="the frontier's samples of --model (benchmarks/frontier.py: its tasks, lengths and "
                        "samples); rows to benchmarks/results/frontier/<model>/peer-llamacpp.jsonl, resumable")
    parser.add_argument("--collect", action="store_true",
                        help="run no worker: only score the raw rows earlier runs finished into the rows (after "
                        "an interrupted run, or to rebuild them)")
    parser.add_argument("--worker", nargs=3, metavar=("SAMPLES", "GGUF", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kv_types = [k for k in args.kv.split(",") if k]
    unknown = sorted(set(kv_types) - set(GGML_TYPES))
    if unknown:
        parser.error(f"unknown KV types {unknown}; known: {sorted(GGML_TYPES)}")
    if args.worker:
        worker(args.worker[0], args.worker[1], kv_types, args.threads, args.worker[2])
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    from kvpack.hf.models import model_directory, resolve_model_source

    python = Path(args.venv) / "bin" / "python"
    if not python.exists():
        print(f"no llama.cpp environment at {args.venv}: run `bash scripts/install_llamacpp.sh` first "
              f"(or pass --venv)", file=sys.stderr)
        return 2
    out = Path(args.out)
    tasks, lengths, per_task = args.tasks.split(","), [int(n) for n in args.lengths.split(",")], args.samples
    if args.frontier:
        import frontier

        out = frontier.rows_dir(args.model) / "peer-llamacpp"
        tasks, lengths = list(frontier.TASKS), list(frontier.LENGTHS[args.model])
        per_task = frontier.SAMPLES_PER_TASK_AND_LENGTH
    out.mkdir(parents=True, exist_ok=True)
    samples = build_samples(tasks, lengths, per_task, args.seed, out / "samples.jsonl", model=args.model)
    _, gguf = resolve_model_source(args.model)
    raw_path = out / "llamacpp_raw.jsonl"
    raw = run_worker([str(python), __file__, "--kv", args.kv, "--threads", str(args.threads), "--worker",
                      str(out / "samples.jsonl"), str(gguf), str(raw_path)],
                     raw_path, "llama.cpp", collect=args.collect)
    if not raw:
        return 1
    rows = llamacpp_rows(samples, raw, AutoConfig.from_pretrained(model_directory(args.model), local_files_only=True),
                         args.model)
    if args.frontier:
        from _peers import frontier_peer_rows

        version = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        fields = {**frontier.machine_fields("the GGUF's quantized weights"),
                  "peer_version": f"llama-cpp-python {version}"}
        peer_rows = frontier_peer_rows(rows, "llamacpp", both_settings=True, fields=fields)
        (out.parent / "peer-llamacpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in peer_rows))
        print(frontier.write_results(args.model, "python benchmarks/peer_llamacpp.py " + " ".join(sys.argv[1:])))
        return 0
    version = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    report = [f"# llama.cpp {version} (flash attention, {args.threads} threads) on kvpack's samples: "
              f"{args.tasks}, {args.samples} per task and length"]
    for n in lengths:
        report += [f"\n## {n} tokens\n", table([r for r in rows if r["length"] == n], "llama.cpp f16")]
    write_outputs(out, rows, report, args.kvpack_results, lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
