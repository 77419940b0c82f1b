"""What the peer benchmarks share (kvpack's environment only): kvpack's eval samples as token ids, and
the tables that put a peer's rows beside each other and beside kvpack's own eval rows."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# The settings as kvpack's runner spells them (kvpack.eval.runner.SETTINGS; the peers' workers run outside kvpack's
# environment, so they cannot import it: tests/test_presets.py checks the two agree).
SETTINGS = ("query-aware", "query-agnostic")
# The peers' configurations, here so that the frontier's plan (benchmarks/frontier.py) and each peer's script read
# one spelling without importing each other: kvpress's presses, llama.cpp's K/V types.
PRESSES = ("snapkv", "streaming_llm", "expected_attention", "kvzip")  # KVzip, the slowest (2-3 prefills), last
GGML_TYPES = {"f16": (1, 2, 1), "q8_0": (8, 34, 32), "q4_0": (2, 18, 32)}  # name: (ggml type id, bytes, values)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says). Standard library only: the peer
    workers stamp it on every raw row they write, so a row keeps the machine it ran on."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def finished_rows(path: str | Path) -> list[dict]:
    """The rows a peer worker already wrote to ``path`` (a JSON line each; a torn last line of an
    interrupted run is skipped), so a rerun resumes. Standard library only: the workers import it in
    their own environments."""
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def run_worker(command: list[str], raw_path: Path, tool: str, collect: bool = False,
               env: dict | None = None) -> list[dict]:
    """Run a peer's worker (``command``, in its own environment; not with ``collect``) and return every raw row in
    ``raw_path``, this run's and earlier runs'. A worker that stops part way (a failure, a signal) still leaves its
    finished rows, which are returned and said so on stderr; a torn last line is skipped."""
    import subprocess
    import sys

    from kvpack.eval.runner import load_rows

    returncode = 0 if collect else subprocess.run(command, env=env).returncode
    raw = load_rows(raw_path)
    if returncode != 0:
        print(f"the {tool} worker exited with {returncode}: reporting its {len(raw)} finished rows", file=sys.stderr)
    return raw


def build_samples(tasks: list[str], lengths: list[int], samples: int, seed: int, path: Path,
                  model: str = "smollm2") -> list[dict]:
    """kvpack's eval samples as token ids (exactly the ids kvpack's eval feeds ``model``), in the order kvpack's
    runner takes them (``EvalPlan.units``: sample index outermost), which the workers follow: a peer's run cut
    short has every task and length at fewer samples, as kvpack's own cells, rather than some tasks not at all."""
    from kvpack.eval.runner import _scored_ids
    from kvpack.eval.tasks import make_sample
    from kvpack.hf.models import load_tokenizer

    tok = load_tokenizer(model)
    rows = []
    for index in range(samples):
        for task in tasks:
            for length in lengths:
                s = make_sample(tok, task, length, index, samples, seed)
                context = tok(s.context).input_ids
                ids = context + tok(s.question, add_special_tokens=False).input_ids
                answer_ids, continuation_ids = _scored_ids(tok, s)  # what kvpack's fidelity pass teacher-forces
                rows.append({"key": [task, length, index], "ids": ids, "context_tokens": len(context),
                             "answer_ids": answer_ids, "continuation_ids": continuation_ids,
                             "answers": s.answers, "metric": s.metric,
                             "max_new_tokens": s.max_new_tokens, "depth": s.depth})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def table(rows: list[dict], reference: str) -> str:
    """One line per label: average with its 95% interval, McNemar against ``reference`` on the same
    samples, the measured KV bytes ÷ bf16 (``ratio``), prefill, decode ms/token and its ratio to the
    reference's (every row has ``label``, ``score``, ``ratio``, ``prefill_s``, ``decode_ms``)."""
    from kvpack.eval.report import average_interval
    from kvpack.eval.stats import mcnemar_exact

    labels = list(dict.fromkeys(r["label"] for r in rows))
    ref = {(r["task"], r["length"], r["sample"]): r for r in rows if r["label"] == reference}
    ref_ms = statistics.median(r["decode_ms"] for r in ref.values() if r.get("decode_ms"))
    lines = [f"| KV | average (95%) | differs from {reference} | KV / bf16 | prefill s | decode ms/token | "
             f"vs {reference} |", "|---|---|---|---|---|---|---|"]
    for label in labels:
        grp = [r for r in rows if r["label"] == label]
        avg = statistics.fmean(r["score"] for r in grp)
        lo, hi = average_interval(grp)
        pairs = [(ref[k]["score"] == 1.0, r["score"] == 1.0) for r in grp
                 if (k := (r["task"], r["length"], r["sample"])) in ref]
        test = mcnemar_exact([a for a, _ in pairs], [b for _, b in pairs])
        differs = "–" if label == reference else (
            f"{'**yes**' if test['p_value'] < 0.05 else 'no'} (p = {test['p_value']:.2g})")
        ms = statistics.median(r["decode_ms"] for r in grp if r.get("decode_ms"))
        lines.append(f"| {label} | {avg:.2f} ({lo:.2f}–{hi:.2f}) | {differs} | "
                     f"{statistics.fmean(r['ratio'] for r in grp):.3f} | "
                     f"{statistics.median(r['prefill_s'] for r in grp):.2f} | {ms:.2f} | {ms / ref_ms:.2f}x |")
    return "\n".join(lines)


def kvpack_table(results_dir: Path, lengths: list[int]) -> str:
    """kvpack's rows (every label and setting) from an eval directory, on the lengths measured here."""
    from kvpack.eval.report import summarize, summary_markdown
    from kvpack.eval.runner import load_results

    rows = [r for r in load_results(results_dir) if r["length"] in lengths]
    return summary_markdown(summarize(rows)) if rows else f"(no kvpack rows at {lengths} in {results_dir})"


def write_outputs(out: Path, rows: list[dict], report: list[str], kvpack_results: str | None,
                  lengths: list[int]) -> None:
    """``out/results.jsonl`` (the peer's scored rows) and ``out/summary.md`` (``report``, then kvpack's
    rows of ``kvpack_results`` at ``lengths`` when given), also printed."""
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if kvpack_results:
        report = [*report, "\n## kvpack on the same samples\n", kvpack_table(Path(kvpack_results), lengths)]
    text = "\n".join(report) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


def frontier_peer_rows(rows: list[dict], family: str, both_settings: bool, fields: dict) -> list[dict]:
    """A peer's scored rows as frontier rows (``benchmarks/frontier.py`` pools them with kvpack's):
    ``method`` the peer's family (``llamacpp``, ``kvpress``), ``label`` its configuration (``llamacpp-q4_0``,
    ``kvpress-snapkv@0.28``), ``budget`` the kept share where the peer has one. A peer whose cache does not
    depend on the question (llama.cpp's per-token quantization) gets one row per setting from one run
    (``same_run_both_settings``). The peer's decode ms/token is its own runtime's, not comparable with
    kvpack's FullKV step, so it is kept as ``decode_ms_own_runtime`` and the frontier's speed ratio skips it.
    KL and top-1 come where the peer's script measures them (kvpress: against its own press-free pass over
    the same answer and continuation, in its environment); llama.cpp's rows have scores only.

    ``fields`` (the driver's commit, dtype, versions) go on every row, except ``cpu``: a row names the CPU its
    worker ran on (``cpu`` of its raw row), or ``unknown`` for a raw row written before workers named it — a
    resumed run's rows come from several machines."""
    out = []
    for r in rows:
        settings = SETTINGS if both_settings else (r["setting"],)
        name = r["label"].replace("llama.cpp ", "llamacpp-").replace("kvpress ", "kvpress-").replace(" (masks)", "")
        for setting in settings:
            row = {k: v for k, v in r.items() if k not in ("decode_ms", "label", "method", "setting")}
            row.update(setting=setting, method=family, label=name, budget=r.get("budget"),
                       decode_ms_own_runtime=r.get("decode_ms"), same_run_both_settings=both_settings,
                       **{**fields, "cpu": r.get("cpu") or "unknown"})
            out.append(row)
    return out
