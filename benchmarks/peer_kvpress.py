"""NVIDIA kvpress's presses as peers, on kvpack's eval samples, in both of kvpack's settings.

kvpress 0.5.5 pins transformers < 5.3 while kvpack needs >= 5.20, so kvpress runs in its own virtual
environment (``bash scripts/install_kvpress.sh``) as a worker process started with that environment's
Python (``--venv``). The worker loads the same weights kvpack uses (``--model``: kvpack's converted model
directory, bf16, SDPA) and gets the exact token ids of kvpack's eval (``make_sample``); the answers
are scored here by kvpack's scorer. Settings as kvpack's eval: *query-aware* prefills context +
question but the last token under the press, *query-agnostic* prefills the context alone under the
press and then reads the question through the compressed cache. ``compression_ratio`` in kvpress is
the share removed: ``--kept 0.25,0.5`` runs 0.75 and 0.5.

Fidelity as kvpack's eval measures it: for each sample and setting one press-free prefill in the same
environment is the reference, and after each press the rest of the prompt, the gold answer and the
held-out continuation are teacher-forced over a copy of the compressed cache (KVzip's masks in place):
KL(exact ‖ press) per token over the answer and the continuation, and top-1 agreement.

One prefill serves every press and share of a sample and setting. A press rewrites an attention layer's
cache in a forward hook after that layer's attention, so a prefill's hidden states, and every layer's
inputs, are the same with or without it: the press-free prefill records each layer's hook arguments, and
each press's own hook is then called on them over a copy of the press-free cache (rows flagged
``replayed``). KVzip runs live (its prefill and context-reconstruction scoring) once per sample and setting;
its other shares take that run's scores, which do not depend on the share, through its own
``compress_post``. ``--check-replay`` runs every press and share both ways on one sample and compares the
caches and KVzip's masks tensor for tensor. A replayed row's ``prefill_s`` is the press-free prefill's
seconds plus the press's own (KVzip: its live run's, less that run's masking, plus this share's masking).

Bytes are measured from the cache's tensors after the prefill. SnapKV, StreamingLLM and expected
attention gather the kept tokens into smaller tensors: they free memory. KVzip scores by context
reconstruction and then *masks* the evicted keys at attention time (kvpress's attention patch): its
tensors hold every token, so its bytes are the dense bytes (ratio 1.0), whatever its nominal ratio.

Usage: python benchmarks/peer_kvpress.py [--venv .kvpress-venv]
    [--presses snapkv,streaming_llm,expected_attention,kvzip] [--kept 0.25,0.5] [--lengths 2048]
    [--tasks niah_single_1,niah_single_2] [--samples 8]
    [--out results/peer-kvpress] [--kvpack-results kvpack-eval/]
       python benchmarks/peer_kvpress.py --frontier --model smollm2   (the frontier's samples and rows)
       ... --frontier --model smollm2 --collect   (no worker: the rows of the raw rows earlier runs finished)
       ... --check-replay --lengths 1024 --tasks niah_single_1 --samples 1   (replayed caches equal live ones)
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _peers import PRESSES, SETTINGS

KEPT_DEFAULT = "0.25,0.5"


# -- the worker (runs in the kvpress environment) ---------------------------------------------------


def make_press(name: str, kept: float):
    import kvpress

    cls = {"snapkv": kvpress.SnapKVPress, "streaming_llm": kvpress.StreamingLLMPress,
           "kvzip": kvpress.KVzipPress, "expected_attention": kvpress.ExpectedAttentionPress}[name]
    return cls(compression_ratio=1.0 - kept)


def recorded_prefill(model, ids: list[int]):
    """An exact (press-free) prefill of ``ids``: its ``DynamicCache``, its seconds, and each attention layer's
    inputs and output as a press's forward hook receives them ({layer index: (kwargs, output)})."""
    import torch
    from transformers import DynamicCache

    records = {}

    def record(module, args, kwargs, output):
        records[module.layer_idx] = (dict(kwargs), output)

    cache = DynamicCache()
    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        seconds = time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
    return cache, seconds, records


def replayed(model, press, exact, records: dict):
    """The cache ``press`` (a kvpress press) leaves after a prefill, from the exact prefill's recorded layer inputs
    (:func:`recorded_prefill`): a copy of the exact cache, and the press's own forward hook called on each layer in
    order with the arguments a live prefill hands it (``press(model)`` registers that hook and sets each layer's
    rotary embedding). Equal to the live run's cache because a press only rewrites the layer's cache after the
    layer's attention: the prefill's hidden states, and so every later layer's inputs, do not depend on it
    (``--check-replay`` compares the two tensor for tensor). Returns the cache and the press's seconds."""
    import torch

    cache = copy.deepcopy(exact)
    start = time.perf_counter()
    press.post_init_from_model(model)
    with torch.no_grad():
        for layer in model.model.layers:
            module = layer.self_attn
            module.rotary_emb = model.model.rotary_emb
            kwargs, output = records[module.layer_idx]
            # the recorded cache argument (``past_key_values`` in kvpress's transformers) becomes the copy
            press.forward_hook(module, [], {name: cache if value is exact else value for name, value in kwargs.items()},
                               output)
    return cache, time.perf_counter() - start


def worker(samples_path: str, model_dir: str, presses: list[str], kept: list[float], out_path: str,
           check_replay: bool = False) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_grad_enabled(False)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines()]
    cfg = model.config
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    from _peers import cpu_name

    cpu = f"{cpu_name()} ({torch.get_num_threads()} threads)"
    versions = {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                "torch": torch.__version__}

    def greedy(cache, pending: list[int], position: int, max_new: int) -> tuple[list[int], list[float]]:
        """Feed `pending` (the tokens after the prefilled ones), then decode greedily."""
        new, stamps = [], [time.perf_counter()]
        ids = torch.tensor([pending])
        for _ in range(max_new):
            # RoPE at the logical positions; the mask follows the cache's physical length (an evicting press
            # holds fewer tokens than were prefilled), so no cache_position is passed (as kvpress's pipeline)
            pos = torch.arange(position, position + ids.shape[1])[None]
            out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
            position += ids.shape[1]
            tok = int(out.logits[0, -1].argmax())
            stamps.append(time.perf_counter())
            if tok in eos:
                break
            new.append(tok)
            ids = torch.tensor([[tok]])
        return new, [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]

    def clear_masks():
        for layer in model.model.layers:  # KVzip leaves its masked indices on the modules
            layer.self_attn.masked_key_indices = None

    def scored_logprobs(cache, s: dict, n_pre: int) -> torch.Tensor | None:
        """Log-probabilities [answer + continuation tokens, vocab] (fp32) with the rest of the prompt, the gold
        answer and the held-out continuation teacher-forced after ``cache`` (kvpack's fidelity pass)."""
        if not s.get("answer_ids"):
            return None
        chunk = s["ids"][n_pre:] + s["answer_ids"] + s["continuation_ids"]
        pos = torch.arange(n_pre, n_pre + len(chunk))[None]
        logits = model(input_ids=torch.tensor([chunk]), past_key_values=cache, position_ids=pos,
                       use_cache=True).logits[0].float()
        a = len(s["ids"]) - n_pre  # logits at a-1+j predict answer token j, then the continuation's
        return torch.log_softmax(logits[a - 1: a - 1 + len(s["answer_ids"]) + len(s["continuation_ids"])], dim=-1)

    def fidelity(ref: torch.Tensor | None, logp: torch.Tensor | None, n_answer: int) -> dict:
        if ref is None or logp is None:
            return {}
        # kvpack.divergence.kl_per_position's KL, clamped at 0 per position as it is; kvpack itself is not
        # importable in kvpress's environment (transformers < 5.3)
        kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0)
        return {"kl": float(kl.mean()), "kl_answer": float(kl[:n_answer].mean()),
                "kl_continuation": float(kl[n_answer:].mean()),
                "top1": float((ref.argmax(-1) == logp.argmax(-1)).float().mean())}

    def kvzip_live(kept_share: float, ids: list[int]) -> tuple[DynamicCache, float, dict]:
        """KVzip run as kvpress runs it (its prefill, its context-reconstruction scoring, its masks): the cache,
        the seconds, and what a replay at another share needs — the scores (they do not depend on the share:
        the share only picks how many of the lowest to mask, in ``compress_post``), the cache before decoding,
        and the seconds of this run less its own masking."""
        press, cache, saved = make_press("kvzip", kept_share), DynamicCache(), {}
        compress_post = press.compress_post

        def keep_scores(model_):
            saved["scores"] = press.score_val.clone()
            start = time.perf_counter()
            compress_post(model_)
            saved["post_s"] = time.perf_counter() - start

        press.compress_post = keep_scores
        start = time.perf_counter()
        with press(model):
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        seconds = time.perf_counter() - start
        saved.update(cache=copy.deepcopy(cache), shared_s=seconds - saved.get("post_s", 0.0))
        return cache, seconds, saved

    def kvzip_replayed(kept_share: float, saved: dict) -> tuple[DynamicCache, float]:
        """KVzip at ``kept_share`` from another share's live run (:func:`kvzip_live`): its masks from the same
        scores by KVzip's own ``compress_post``, over a copy of the same cache."""
        press = make_press("kvzip", kept_share)
        press.score_val = saved["scores"].clone()
        start = time.perf_counter()
        press.compress_post(model)
        return copy.deepcopy(saved["cache"]), saved["shared_s"] + time.perf_counter() - start

    def masks() -> list:
        return [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]

    if check_replay:
        s = samples[0]
        mismatches = 0
        for setting in SETTINGS:
            n_pre = len(s["ids"]) - 1 if setting == "query-aware" else s["context_tokens"]
            clear_masks()
            exact, _, records = recorded_prefill(model, s["ids"][:n_pre])
            saved = None
            for name in presses:
                for k in kept:
                    clear_masks()
                    live = DynamicCache()
                    if name == "kvzip":
                        live, _, first = kvzip_live(k, s["ids"][:n_pre])
                        live_masks = masks()
                        saved = saved or first
                        clear_masks()
                        again, _ = kvzip_replayed(k, saved)
                    else:
                        with make_press(name, k)(model):
                            model(input_ids=torch.tensor([s["ids"][:n_pre]]), past_key_values=live, use_cache=True)
                        live_masks = masks()
                        again, _ = replayed(model, make_press(name, k), exact, records)
                    same = all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                               for a, b in zip(live.layers, again.layers))
                    same = same and all((x is None and y is None) or (x is not None and y is not None and all(
                        torch.equal(u, v) for u, v in zip(x, y))) for x, y in zip(live_masks, masks()))
                    mismatches += not same
                    print(f"[kvpress replay check] {s['key']} {setting} {name}@{k:g}: "
                          f"{'equal' if same else 'DIFFERENT'}", flush=True)
            clear_masks()
        if mismatches:
            raise SystemExit(f"{mismatches} replayed caches differ from their live runs")
        return

    from _peers import finished_rows

    # resumable: rows already in out_path are kept and not run again
    done = {(tuple(r["key"]), r["setting"], r["press"], r["kept"]) for r in finished_rows(out_path)}

    # One exact (press-free) prefill per sample and setting: the reference of the fidelity pass, and the recorded
    # layer inputs every press but KVzip is replayed on (:func:`replayed`). KVzip runs live once per sample and
    # setting; its other shares reuse that run's scores (:func:`kvzip_replayed`). The fidelity pass runs on a
    # copy of each compressed cache taken before decoding (decoding mutates it), with KVzip's masks in place.
    with open(out_path, "a") as out:
        for s in samples:
            for setting in SETTINGS:
                todo = [(name, k) for name in presses for k in kept if (tuple(s["key"]), setting, name, k) not in done]
                if not todo:
                    continue
                ids = s["ids"]
                n_pre = len(ids) - 1 if setting == "query-aware" else s["context_tokens"]
                clear_masks()
                exact, exact_s, records = recorded_prefill(model, ids[:n_pre])
                ref = scored_logprobs(copy.deepcopy(exact), s, n_pre)
                kvzip_saved = None
                for name, k in todo:
                    clear_masks()
                    if name == "kvzip" and kvzip_saved is None:
                        cache, prefill_s, kvzip_saved = kvzip_live(k, ids[:n_pre])
                        how = {"replayed": False}
                    elif name == "kvzip":
                        cache, prefill_s = kvzip_replayed(k, kvzip_saved)
                        how = {"replayed": True}
                    else:
                        cache, press_s = replayed(model, make_press(name, k), exact, records)
                        prefill_s, how = exact_s + press_s, {"replayed": True, "press_s": press_s}
                    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
                    masked = any(m is not None for m in masks())
                    fid = fidelity(ref, scored_logprobs(copy.deepcopy(cache), s, n_pre), len(s.get("answer_ids", [])))
                    new, steps = greedy(cache, ids[n_pre:], n_pre, s["max_new_tokens"])
                    clear_masks()
                    out.write(json.dumps({"key": s["key"], "setting": setting, "press": name, "kept": k,
                                          "new_ids": new, "prefill_s": prefill_s, "steps_ms": steps,
                                          "ratio": held / (n_pre * per_token), "masked": masked,
                                          "versions": versions, "cpu": cpu, **how, **fid}) + "\n")
                    out.flush()
                del exact, records
            print(f"[kvpress] {s['key']}: done", file=sys.stderr, flush=True)


# -- the driver (kvpack's environment) ---------------------------------------------------------------


def kvpress_rows(samples: list[dict], raw: list[dict], model: str = "smollm2") -> list[dict]:
    """Scored rows in kvpack's result schema (method ``kvpress-<press>``, budget = the share kept)."""
    from kvpack.eval.scoring import score
    from kvpack.hf.models import load_tokenizer

    tok = load_tokenizer(model)
    by_key = {tuple(s["key"]): s for s in samples}
    rows = []
    for r in raw:
        s = by_key[tuple(r["key"])]
        prediction = tok.decode(r["new_ids"], skip_special_tokens=True)
        task, length, index = s["key"]
        rows.append({"setting": r["setting"], "task": task, "length": length, "sample": index, "depth": s["depth"],
                     "method": f"kvpress-{r['press']}", "budget": r["kept"],
                     "label": f"kvpress {r['press']}@{r['kept']:g}" + (" (masks)" if r["masked"] else ""),
                     "prediction": prediction, "score": score(prediction, s["answers"], s["metric"]),
                     "ratio": r["ratio"], "masked": r["masked"], "prefill_s": r["prefill_s"], "cpu": r.get("cpu"),
                     **{f: r[f] for f in ("kl", "kl_answer", "kl_continuation", "top1") if f in r},
                     "decode_ms": statistics.median(r["steps_ms"]) if r["steps_ms"] else None})
    return rows


def main() -> int:
    from _peers import build_samples, run_worker, table, write_outputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".kvpress-venv", help="the kvpress virtual environment")
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--kept", default=KEPT_DEFAULT, help="shares of the prefilled tokens kept")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/peer-kvpress")
    parser.add_argument("--kvpack-results", help="a kvpack eval directory whose rows to print beside")
    parser.add_argument("--model", default="smollm2", help="smollm2 or qwen2.5-0.5b (kvpack's converted copy)")
    parser.add_argument("--frontier", action="store_true",
                        help="the frontier's samples of --model (benchmarks/frontier.py: its tasks, lengths and "
                        "samples; --kept defaults to its budgets); rows to "
                        "benchmarks/results/frontier/<model>/peer-kvpress.jsonl, resumable")
    parser.add_argument("--collect", action="store_true",
                        help="run no worker: only score the raw rows earlier runs finished into the rows (after "
                        "an interrupted run, or to rebuild them)")
    parser.add_argument("--check-replay", action="store_true",
                        help="write no rows: on the first sample, in both settings, run every press and share live "
                        "and replayed (one exact prefill's recorded layer inputs; KVzip from another share's scores) "
                        "and compare the caches and masks tensor for tensor; exits 1 where any differ")
    parser.add_argument("--worker", nargs=3, metavar=("SAMPLES", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.frontier and args.kept == KEPT_DEFAULT:
        import frontier

        args.kept = ",".join(map(str, frontier.BUDGETS))
    presses, kept = [p for p in args.presses.split(",") if p], [float(k) for k in args.kept.split(",")]
    if unknown := sorted(set(presses) - set(PRESSES)):
        parser.error(f"unknown presses {unknown}; known: {', '.join(PRESSES)}")
    if any(not 0 < k <= 1 for k in kept):
        parser.error(f"--kept must be shares in (0, 1], got {kept}")
    if args.worker:
        worker(args.worker[0], args.worker[1], presses, kept, args.worker[2], check_replay=args.check_replay)
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvpack.hf.models import model_directory

    python = Path(args.venv) / "bin" / "python"
    if not python.exists() and not args.collect:  # --collect: the raw rows name kvpress's versions themselves
        print(f"no kvpress environment at {args.venv}: run `bash scripts/install_kvpress.sh` first (or pass --venv)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    tasks, lengths, per_task = args.tasks.split(","), [int(n) for n in args.lengths.split(",")], args.samples
    if args.frontier:
        import frontier

        out = frontier.rows_dir(args.model) / "peer-kvpress"
        tasks, lengths = list(frontier.TASKS), list(frontier.LENGTHS[args.model])
        per_task = frontier.SAMPLES_PER_TASK_AND_LENGTH
    out.mkdir(parents=True, exist_ok=True)
    samples = build_samples(tasks, lengths, per_task, args.seed, out / "samples.jsonl", model=args.model)
    raw_path = out / "kvpress_raw.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [str(python), __file__, "--presses", args.presses, "--kept", args.kept, "--worker",
               str(out / "samples.jsonl"), str(model_directory(args.model)), str(raw_path)]
    if args.check_replay:
        import subprocess

        return subprocess.run([*command, "--check-replay"], env=env).returncode
    raw = run_worker(command, raw_path, "kvpress", collect=args.collect, env=env)
    if not raw:
        return 1
    rows = kvpress_rows(samples, raw, args.model)
    v = raw[0]["versions"]
    if args.frontier:
        from _peers import frontier_peer_rows

        fields = {**frontier.machine_fields("bfloat16"),
                  "peer_version": f"kvpress {v['kvpress']}, transformers {v['transformers']}"}
        peer_rows = frontier_peer_rows(rows, "kvpress", both_settings=False, fields=fields)
        (out.parent / "peer-kvpress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in peer_rows))
        print(frontier.write_results(args.model, "python benchmarks/peer_kvpress.py " + " ".join(sys.argv[1:])))
        return 0
    report = [f"# kvpress {v['kvpress']} (transformers {v['transformers']}, torch {v['torch']}, SmolLM2 bf16) on "
              f"kvpack's samples: {args.tasks}, {args.samples} per task and length"]
    for setting in SETTINGS:
        for n in lengths:
            grp = [r for r in rows if r["setting"] == setting and r["length"] == n]
            best = max({r["label"] for r in grp}, key=lambda lab: statistics.fmean(
                r["score"] for r in grp if r["label"] == lab))
            report += [f"\n## {setting}, {n} tokens (speed and McNemar against the best press, {best})\n",
                       table(grp, best)]
    write_outputs(out, rows, report, args.kvpack_results, lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
