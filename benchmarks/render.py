"""Render every generated block of the README and docs/ from the committed results and the method registry.

Also written: ``kvpack/data/frontier_choices.json``, the frontier's ranking that ``method="auto"`` reads
(:func:`kvpack.eval.frontier.frontier_choices`; its models recognised by the fingerprints in their committed
layer profiles).

A generated block is the text between ``<!-- render: NAME -->`` and ``<!-- /render -->`` in README.md or
a page of docs/; nothing between the markers is typed by hand. Blocks:

* ``frontier-summary`` — per model, setting and budget: the best resident kvpack method, kvtc and the best
  peer at equal or fewer bytes (:func:`kvpack.eval.frontier.frontier_table_markdown`), from every
  ``benchmarks/results/frontier-<model>.json``;
* ``frontier-rows:FAMILY[,FAMILY...]`` — every frontier cell of those registry methods (a method page's
  own rows);
* ``peers-vs-kvpack`` — every peer cell against the best resident kvpack cell at no more bytes, paired
  (:func:`kvpack.eval.frontier.peers_vs_kvpack_markdown`);
* ``frontier-coverage`` — per model, the planned cells that hold fewer samples than the plan's target
  (:func:`kvpack.eval.frontier.coverage_markdown`);
* ``frontier-guidance`` — which method when: per model, setting and budget, the method to use, its KL and score,
  the runner-up and the best peer (:func:`kvpack.eval.frontier.guidance_markdown`), from the same ranking the
  default method reads;
* ``presets`` — the preset table (:mod:`kvpack.presets`): each name, its method, its fixed fields;
* ``supported-models`` — the decoder families of the architecture matrix (:mod:`kvpack.hf.families`): what each
  exercises, whether kvpack serves it, which methods refuse which feature;
* ``decode-long-context`` — the long-context decode rows (``benchmarks/results/decode-long-context.jsonl``,
  from ``bench_decode_e2e.py --json``): per model, dtype and prompt length, each cache's ms/token against
  ``DynamicCache``, kvpack's dense kernel and the memory floor;
* ``options:METHOD`` — the method's config fields: default, allowed values, what each does;
* ``sources`` — each results file with the commands, kvpack commits, package versions and CPUs of its rows.

Usage:
    python benchmarks/render.py           # rewrite the blocks in place
    python benchmarks/render.py --check   # exit 1, naming the stale blocks, when any differs (CI)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CHOICES = ROOT / "kvpack" / "data" / "frontier_choices.json"  # the packaged ranking method="auto" reads
BLOCK = re.compile(r"(<!-- render: (?P<name>[^ ]+) -->\n)(?P<body>.*?)(<!-- /render -->)", re.DOTALL)


def pages() -> list[Path]:
    """The files that may hold generated blocks."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def frontier_records() -> dict[str, dict]:
    """``{model: contents}`` of every committed ``benchmarks/results/frontier-<model>.json``."""
    records = {}
    for path in sorted(RESULTS.glob("frontier-*.json")):
        data = json.loads(path.read_text())
        records[data["model"]] = data
    return records


def _machines(records: dict[str, dict]) -> str:
    return "; ".join(sorted({m for d in records.values() for m in d["machines"]}))


def fingerprints() -> dict[str, str | None]:
    """Each frontier model's fingerprint hash, from its committed layer profile (made on that model)."""
    out = {}
    for model_dir in sorted((RESULTS / "frontier").iterdir()):
        profile = model_dir / "pca_quant-layer-profile" / "layer_profile.json"
        out[model_dir.name] = json.loads(profile.read_text())["fingerprint"]["hash"] if profile.is_file() else None
    return out


def choices_text(records: dict[str, dict]) -> str:
    """The packaged ranking's file content (:func:`kvpack.eval.frontier.frontier_choices`)."""
    from kvpack.eval.frontier import frontier_choices

    return json.dumps(frontier_choices(records, fingerprints()), indent=1) + "\n"


def frontier_guidance(records: dict[str, dict]) -> str:
    from kvpack.eval.frontier import frontier_choices, guidance_markdown

    if not records:
        return "(no frontier results yet)\n"
    return (guidance_markdown(frontier_choices(records, fingerprints())) +
            "\n\nPer model, setting and budget: the resident method with the lowest mean KL to FullKV (among the "
            "methods with the most samples there), the runner-up, and the peer with the lowest KL at no more bytes. "
            "*Query-agnostic* is a cache reused for questions it was not built for (prefix caching, multi-turn, "
            "RAG): what `method=\"auto\"` (and no method at all) picks from, for these models by their fingerprint "
            "and for any other by the rule in *The default method* on the evaluation page. *Query-aware* "
            "is the question inside the compressed prompt. Storing or moving caches between turns: `kvtc` (the "
            "*storage* column of the frontier table).\n")


def presets_table() -> str:
    from kvpack.presets import PRESETS

    lines = ["| preset | method | fixed fields | takes a budget | what it is |", "|---|---|---|---|---|"]
    for p in PRESETS:
        fields = ", ".join(f"`{k}={v}`" for k, v in p.config.items())
        lines.append(f"| `{p.name}` | `{p.method}` | {fields} | {'yes' if p.budgeted else 'no'} | {p.summary}"
                     f"{' (retired: no longer in the frontier plan)' if p.retired else ''} |")
    return "\n".join(lines) + ("\n\n`calibration=auto`: the model's own calibration, made on first use and kept in "
                               "kvpack's cache directory (shipped for the measured models' layer profiles).\n")


def supported_models() -> str:
    from kvpack.hf.families import FAMILIES

    lines = ["| family | `model_type` | what its attention does | kvpack's cache | refusals by method | budget |",
             "|---|---|---|---|---|---|"]
    for f in FAMILIES:
        served = f"refused: {f.refused}" if f.refused else "served (FullKV equal to transformers' generation)"
        refusals = "; ".join(f"`{m}`: {why}" for m, why in f.method_refusals.items()) or "–"
        budget = ("–" if f.refused else "the whole cache: the sliding-window layers kept dense, their bytes charged "
                  "to the full-attention layers" if f.sliding_layers else "the whole cache")
        lines.append(f"| {f.name} | `{f.model_type}` | {f.features} | {served} | {refusals} | {budget} |")
    return "\n".join(lines) + ("\n\nFrom `kvpack/hf/families.py`, the table `tests/test_architectures.py` holds kvpack "
                               "to "
                               "on a tiny random-weight model of each family (built from transformers' own config "
                               "class): FullKV's generation token for token, every compressing resident method "
                               "but `kvtc_resident` within its budget over the whole cache after the prefill and "
                               "every decode step (SnapKV and H2O: after the prefill), a left-padded batch equal "
                               "to each prompt alone, "
                               "attention equal in fp64 to attention over the stored form's reconstruction, each "
                               "refusal by its message. "
                               "`load_model` refuses a family not listed, naming it (`allow_untested=True`, "
                               "`--allow-untested`: load it anyway).\n")


def decode_long_context() -> str:
    path = RESULTS / "decode-long-context.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if not rows:
        return "(no long-context decode rows yet)\n"
    runs: dict[tuple, int] = {}  # (command, commit, CPU, bandwidth) -> run number, in the file's order
    for r in rows:
        runs.setdefault((r["command"], r.get("commit"), r["cpu"], r["read_bandwidth_gbs"]), len(runs) + 1)
    lines = ["| run | model | dtype | prompt tokens | cache | ms/token (median) | slowest ÷ median | ÷ DynamicCache | "
             "÷ kvpack `full` | × the memory floor | KV ÷ dense bf16 | prefill s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = runs[(r["command"], r.get("commit"), r["cpu"], r["read_bandwidth_gbs"])]
        full = "–" if r.get("ratio_full") is None else f"{r['ratio_full']:.2f}x"
        kv = "–" if r.get("kv_ratio") is None else f"{r['kv_ratio']:.3f}"
        lines.append(f"| {run} | {r['model']} | {r['dtype']} | {r['prompt_tokens']} | `{r['row']}` | "
                     f"{r['median_ms']:.1f} | {r['slowest_vs_median']:.2f} | {r['ratio']:.2f}x | {full} | "
                     f"{r['x_floor']:.2f}x | {kv} | {r['prefill_s']:.1f} |")
    described = [f"run {n}: {cpu}, kvpack {commit}, streaming read {bw} GB/s, `{command}`"
                 for (command, commit, cpu, bw), n in runs.items()]
    return ("\n".join(lines) + "\n\nRatios within one run (one CPU): each row's median decode step ÷ the same run's "
            "`DynamicCache` row and `full` row; the floor is (weights + the cache's held bytes) ÷ the streaming-read "
            "bandwidth measured in that run. " + "; ".join(described) + ".\n")


def frontier_summary(records: dict[str, dict]) -> str:
    from kvpack.eval.frontier import frontier_table_markdown

    if not records:
        return "(no frontier results yet)\n"
    return (frontier_table_markdown(records) +
            f"\n\nFrom `benchmarks/results/frontier-*.json` (rows from: {_machines(records)}). Per budget: the "
            "resident kvpack method with the lowest mean KL at that target (or, for one set by its own parameters, "
            "holding at most the target's bytes; among the methods with the most samples there), then kvtc "
            "(storage: decoded before attention) and the peer with the lowest KL holding at most the larger of its "
            "measured bytes and the budget (2% tolerance). "
            "Each entry: mean KL(FullKV ‖ method) per token over the answer and a held-out continuation, "
            "score pooled over the tasks and lengths with its 95% interval, measured bytes ÷ dense bf16.\n")


def frontier_rows(records: dict[str, dict], families: list[str]) -> str:
    from kvpack.eval.frontier import method_table_markdown

    table = method_table_markdown(records, families)
    if not records:
        return table + "\n"
    return (table + f"\n\nFrom `benchmarks/results/frontier-*.json` (rows from: {_machines(records)}). "
            "*Differs from FullKV*: exact McNemar test on fully correct answers over the same samples, "
            "p < 0.05; *decode ÷ FullKV*: the median over samples of decode ms/token ÷ FullKV's on the "
            "same sample, timed in the row's own run (rows made before the frontier timed FullKV in every run: "
            "FullKV's row of the sample, where it ran on the same CPU); not shown for a cell whose rows ran on "
            "several CPUs.\n")


def peers_vs_kvpack(records: dict[str, dict]) -> str:
    from kvpack.eval.frontier import peers_vs_kvpack_markdown

    table = peers_vs_kvpack_markdown(records)
    if not records:
        return table + "\n"
    return (table + f"\n\nFrom `benchmarks/results/frontier-*.json` (rows from: {_machines(records)}). Each peer "
            "cell against the resident kvpack method with the lowest mean KL holding at most the peer's measured "
            "bytes (2% tolerance; among the methods with the most samples there), paired on the samples both ran. "
            "*Who wins*: more fully correct answers where the exact McNemar test gives p < 0.05, lower KL where the "
            "95% interval of the paired KL difference excludes zero; llama.cpp's rows have no KL (its worker "
            "returns text only).\n")


def frontier_coverage(records: dict[str, dict]) -> str:
    from kvpack.eval.frontier import coverage_markdown

    return coverage_markdown(records) + "\n"


def options(method: str) -> str:
    import dataclasses

    from kvpack.methods import method_config_class

    cls = method_config_class(method)
    lines = ["| option | default | allowed | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "–"
        allowed = rule.allowed().replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{default!r}` | {allowed} | {f.metadata.get('help', '')} |")
    return "\n".join(lines) + (f"\n\nSet with `--set KEY=VALUE` (`kvpack generate --method {method}`) or "
                               f"`--set {method}.KEY=VALUE` (`kvpack eval`); `kvpack methods` prints the same.\n")


def sources(records: dict[str, dict]) -> str:
    if not records:
        return "(no results yet)\n"
    lines = ["| results file | rows | commands | kvpack commits | CPUs | dtypes |", "|---|---|---|---|---|---|"]
    for model, data in records.items():
        commands = "<br>".join(f"`{c}`" for c in data["commands"])
        commits = ", ".join(f"`{c[:10]}`" for c in data["commits"])
        lines.append(f"| `benchmarks/results/frontier-{model}.json` | {data['rows']} | {commands} | {commits} | "
                     f"{'; '.join(data['machines'])} | {', '.join(data['dtypes'])} |")
    versions = sorted({f"{k} {v}" for d in records.values() for vs in d["versions"] for k, v in vs.items()})
    return "\n".join(lines) + f"\n\nPackage versions in these rows: {', '.join(versions)}.\n"


def render_block(name: str, records: dict[str, dict]) -> str:
    """The text that belongs between a block's markers."""
    kind, _, arg = name.partition(":")
    if kind == "frontier-summary":
        return frontier_summary(records)
    if kind == "frontier-rows":
        return frontier_rows(records, arg.split(","))
    if kind == "peers-vs-kvpack":
        return peers_vs_kvpack(records)
    if kind == "frontier-coverage":
        return frontier_coverage(records)
    if kind == "frontier-guidance":
        return frontier_guidance(records)
    if kind == "presets":
        return presets_table()
    if kind == "supported-models":
        return supported_models()
    if kind == "decode-long-context":
        return decode_long_context()
    if kind == "options":
        return options(arg)
    if kind == "sources":
        return sources(records)
    raise ValueError(f"unknown generated block {name!r} (known: frontier-summary, frontier-rows:F, "
                     "peers-vs-kvpack, frontier-coverage, frontier-guidance, presets, supported-models, "
                     "decode-long-context, options:M, "
                     "sources)")


def render_text(text: str, records: dict[str, dict]) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("name"), records) + m.group(4), text)


def stale_blocks() -> list[str]:
    """``path: block`` for every generated block whose text is not what the committed results render."""
    records = frontier_records()
    stale = []
    if not CHOICES.is_file() or CHOICES.read_text() != choices_text(records):
        stale.append(f"{CHOICES.relative_to(ROOT)}: the frontier's ranking")
    for path in pages():
        text = path.read_text()
        for m in BLOCK.finditer(text):
            if m.group("body") != render_block(m.group("name"), records):
                stale.append(f"{path.relative_to(ROOT)}: {m.group('name')}")
    return stale


def render_all() -> list[Path]:
    """Rewrite every generated block in place; returns the files that changed."""
    records = frontier_records()
    changed = []
    if records and (not CHOICES.is_file() or CHOICES.read_text() != choices_text(records)):
        CHOICES.write_text(choices_text(records))
        changed.append(CHOICES)
    for path in pages():
        text = path.read_text()
        new = render_text(text, records)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python benchmarks/render.py --check")
    p.add_argument("--check", action="store_true", help="only report stale blocks (exit 1 if any)")
    args = p.parse_args()
    if args.check:
        stale = stale_blocks()
        for s in stale:
            print(f"stale: {s}")
        if stale:
            print("run `python benchmarks/render.py` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in render_all():
        print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
