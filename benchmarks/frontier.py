"""The frontier: every kvpack method and the peers inside kvpack's harness, at five byte budgets, on
RULER-style tasks at 4K and 8K tokens, both settings, ≥ 48 samples per (model, setting, method, budget)
cell, on the same samples and token ids.

Rows go to ``benchmarks/results/frontier/<model>/rows/<name>.jsonl`` as they finish (one file per
method name, variants included, so each stays small; the runner resumes from them: commit them as they
come, and a later run on any machine goes on where this one stopped; each row names the CPU and kvpack
commit that made it). The cells (:mod:`kvpack.eval.frontier`) go to
``benchmarks/results/frontier-<model>.json`` with the command, kvpack commit, versions and CPUs, one
plot per setting to ``docs/img/frontier-<model>-<setting>.png``, and the tables in the README and docs/ are
rendered from every ``frontier-*.json`` by ``benchmarks/render.py`` (``--render`` alone does only that).

Methods (:func:`frontier_specs`): FullKV; at every budget PuzzleKV, ``puzzle_plus``, AnchorKV,
``anchor_plus``, KIVI, ``pca_quant`` (also with its budget spread over the layers by the model's layer
profile, ``pca_quant-layers``, made once into ``benchmarks/results/frontier/<model>/pca_quant-layer-profile``,
and its previous default as ``pca_quant-head``), SnapKV, StreamingLLM, H2O, global SVD; the faithful PuzzleKV with INT4
factors at the paper's page and ranks (P = 32, ranks 16 / 14: its 18.7%-of-bytes setting); kvtc at 4x / 8x / 16x and
``kvtc_resident`` (kvtc's codes held resident) at 8x / 16x / 32x, and at 8x / 16x with a key basis per layer
(``-keys-per-layer``), when a calibration is given (``--kvtc``, or
``--calibration`` from ``kvpack calibrate --model M``); transformers'
``QuantizedCache`` (quanto 4- and 2-bit, HQQ 4-bit), whose bytes follow its bits. The peers outside
kvpack's environment run from their own scripts on the same token ids, in their own virtual
environments, and their rows (``peer-<tool>.jsonl`` beside kvpack's) are pooled here too:
``python benchmarks/peer_llamacpp.py --frontier --model M`` (f16 / q8_0 / q4_0 K/V) and
``python benchmarks/peer_kvpress.py --frontier --model M`` (SnapKV, StreamingLLM, expected attention,
KVzip at the kept shares of the budgets, with KL against their own press-free pass); llama.cpp's have scores,
not KL.

Usage:
    python benchmarks/frontier.py --model smollm2 [--samples 3] [--budgets 0.5,0.28,0.15,0.1,0.0625]
    python benchmarks/frontier.py --model qwen2.5-0.5b --budgets 0.28,0.15,0.0625   # after install_models.sh
    python benchmarks/frontier.py --model smollm2 --only pca_quant   # one method's rows first (the plan's own)
    python benchmarks/frontier.py --render      # the cells, plots and docs table from the committed rows
    python benchmarks/frontier.py --model qwen2.5-0.5b --budgets 0.28,0.15,0.0625 --kvtc --status   # how far
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from kvpack.presets import KVTC_RATIOS, KVTC_RESIDENT_KEYS_PER_LAYER_RATIOS, KVTC_RESIDENT_RATIOS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "docs" / "img"  # the plots are renders of the results, shown by the docs

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe")
BUDGETS = (0.5, 0.28, 0.15, 0.1, 0.0625)
# 4K and 8K; SmolLM2's context is 8,192 tokens, which must also hold the answer and the scored
# continuation, so its long length is the longest that fits (the runner refuses a longer one by name).
LENGTHS = {"smollm2": (4096, 7936), "qwen2.5-0.5b": (4096, 8192)}
SAMPLES_PER_TASK_AND_LENGTH = 3  # 8 tasks x 2 lengths x 3 = 48 samples a cell
BUDGETED = ("puzzle", "puzzle_plus", "anchor", "anchor_plus", "kivi", "pca_quant", "snapkv", "streaming", "h2o", "svd")
# kvtc's and kvtc_resident's ratios and pca_quant-salient's share are the presets' (kvpack.presets: one table for the
# CLI, Python, the docs and this runner). A ratio the frontier's kvtc calibration lacks comes from a twin calibration
# of the same basis, ``<calibration>-<ratio>`` (kvpack calibrate's defaults at ratios 16 and that one), so kvtc's own
# rows keep their calibration; a key basis per layer (values cross-layer) from the twin ``<calibration>-k<g>``.


def resident_calibration(calibration: str, ratio: int, key_layer_group: int | None = None) -> tuple[str, dict | None]:
    """The calibration ``kvtc_resident`` at ``ratio`` uses — the frontier's kvtc calibration, or a twin of it — and
    the ``kvpack calibrate`` settings that make the twin (None for the frontier's own). Twins: ``-<ratio>``
    (the frontier's ratio 16 and this one) and ``-k<g>`` (keys in blocks of ``g`` layers, values cross-layer)."""
    if key_layer_group is not None:
        return f"{calibration}-k{key_layer_group}", {
            "ratios": tuple(float(r) for r in KVTC_RESIDENT_KEYS_PER_LAYER_RATIOS), "key_layer_group": key_layer_group}
    if ratio in KVTC_RATIOS:
        return calibration, None
    return f"{calibration}-{ratio}", {"ratios": tuple(sorted({16.0, float(ratio)}))}


def resident_calibrations(calibration: str) -> dict[str, dict | None]:
    """Every calibration the frontier's ``kvtc_resident`` rows use, with its settings (:func:`resident_calibration`)."""
    made = [resident_calibration(calibration, r) for r in KVTC_RESIDENT_RATIOS]
    made += [resident_calibration(calibration, r, 1) for r in KVTC_RESIDENT_KEYS_PER_LAYER_RATIOS]
    return dict(made)


def frontier_calibration(preset, calibration: str | None, layer_profile: str | None) -> str | None:
    """The frontier's own calibration directory for a preset whose calibration is ``auto`` (its rows name it, so
    they stay comparable across machines): the committed layer profile for pca_quant, the frontier's kvtc
    calibration or a twin of it for kvtc / kvtc_resident; None when this run has none (no ``--kvtc``)."""
    from kvpack.presets import auto_calibration_settings

    if preset.method == "pca_quant":
        return layer_profile
    if calibration is None:
        return None
    if preset.method == "kvtc":
        return calibration
    settings = auto_calibration_settings(preset.config["calibration"])
    return resident_calibration(calibration, int(preset.config["ratio"]), settings.get("key_layer_group"))[0]


def frontier_specs(budgets: list[float], calibration: str | None, layer_profile: str | None = None):
    """The frontier's method specs: FullKV, every method of :data:`BUDGETED` at every budget, then every preset of
    :data:`kvpack.presets.PRESETS` not retired (a budgeted one at every budget), with the frontier's own
    calibrations (:func:`frontier_calibration`; a preset whose calibration this run lacks is left out)."""
    from kvpack.eval.runner import MethodSpec
    from kvpack.presets import PRESETS

    specs = [MethodSpec("full")]
    specs += [MethodSpec(m, b) for b in budgets for m in BUDGETED]
    for p in PRESETS:
        if p.retired:
            continue
        config = p.config_dict()
        if p.needs_calibration:
            directory = frontier_calibration(p, calibration, layer_profile)
            if directory is None:
                continue
            config["calibration"] = directory
        if p.budgeted:
            specs += [MethodSpec(p.method, b, dict(config), name=p.name) for b in budgets]
        else:
            specs.append(MethodSpec(p.method, None, config, name=p.name))
    return specs


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "kvpack"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "optimum-quanto", "hqq"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine_fields(dtype: str) -> dict:
    """What each new row records of the run that made it (rows from several runs share one file)."""
    from _peers import cpu_name

    return {"cpu": f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)",
            "commit": commit(), "dtype": dtype, "versions": versions()}


def rows_dir(model: str) -> Path:
    return RESULTS / "frontier" / model


def calibration_dir(model: str) -> Path:
    return rows_dir(model) / "kvtc-calibration"


def ensure_calibration(model, tokenizer, relative: str, **settings) -> None:
    """kvtc's calibration of ``model`` at ``ROOT/relative``, made once with ``kvpack calibrate``'s defaults
    but for ``settings`` (by default the frontier's ratios: 4x is not among the defaults)."""
    from kvpack.storage.kvtc.calibration import TENSORS_FILE, CalibrationSettings, calibrate

    target = ROOT / relative
    if (target / TENSORS_FILE).is_file():
        return
    settings.setdefault("ratios", tuple(float(r) for r in KVTC_RATIOS))
    calibrate(model, tokenizer, CalibrationSettings(**settings)).save(target)


def layer_profile_dir(model: str) -> Path:
    """pca_quant's layer profile of ``model`` (``kvpack calibrate --method pca_quant``'s defaults; committed: a
    few kB, and the frontier's pca_quant-layers rows are only reproducible with it)."""
    return rows_dir(model) / "pca_quant-layer-profile"


def ensure_layer_profile(model, tokenizer, relative: str) -> None:
    from kvpack.methods.layer_profile import profile_layers
    from kvpack.resident.pca_quant.layer_budgets import PROFILE_FILE

    target = ROOT / relative
    if not (target / PROFILE_FILE).is_file():
        profile_layers(model, tokenizer).save(target)


def write_results(model: str, command: str | None = None) -> Path | None:
    """The cells of ``model``'s committed rows to ``frontier-<model>.json`` and its plots."""
    from kvpack.eval.frontier import frontier_cells, plot_frontier
    from kvpack.eval.runner import load_results, load_rows

    rows = load_results(rows_dir(model))
    for peer in sorted(rows_dir(model).glob("peer-*.jsonl")):  # llama.cpp's and kvpress's rows (their scripts)
        rows += load_rows(peer)
    if not rows:
        return None
    plan = json.loads((rows_dir(model) / "frontier-plan.json").read_text())
    cells = frontier_cells(rows, model)
    path = RESULTS / f"frontier-{model}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    # the commands that wrote rows: the plan's (written when a run starts, so a run cut short is named too)
    commands = list(dict.fromkeys([*old.get("commands", []), *([plan["command"]] if plan.get("command") else []),
                                   *([command] if command else [])]))
    data = {"model": model, "commands": commands, "plan": plan, "budgets": plan["budgets"],
            "rows": len(rows), "machines": sorted({r.get("cpu", "unknown") for r in rows}),
            "commits": sorted({r.get("commit", "unknown") for r in rows}),
            "versions": [json.loads(v) for v in sorted({json.dumps(r["versions"], sort_keys=True)
                                                        for r in rows if r.get("versions")})],
            "dtypes": sorted({r.get("dtype", "unknown") for r in rows}),
            "planned": planned_cells(plan), "cells": cells}
    path.write_text(json.dumps(data, indent=1) + "\n")
    PLOTS.mkdir(parents=True, exist_ok=True)
    plot_frontier(cells, PLOTS / f"frontier-{model}")
    return path


def planned_cells(plan: dict) -> dict:
    """The cells the frontier plans for a model (its plan file's budgets, tasks, lengths, samples and settings):
    kvpack's method specs as labels (the kvtc rows included: both models' frontiers run with ``--kvtc``), the
    peers' configurations (llama.cpp's K/V types; kvpress's presses at each budget), the settings and the samples
    a cell — against which the docs list the cells not yet complete (``frontier-coverage``)."""
    from _peers import GGML_TYPES, PRESSES

    specs = frontier_specs(plan["budgets"], calibration="kvtc", layer_profile="profile")  # only the labels matter
    return {"target": plan["samples_per_task_and_length"] * len(plan["tasks"]) * len(plan["lengths"]),
            "settings": plan["settings"], "cells": [s.label for s in specs],
            "peers": [f"llamacpp-{kv}" for kv in GGML_TYPES] + [f"kvpress-{p}@{b:g}" for p in PRESSES
                                                                 for b in plan["budgets"]]}


def status_report(model: str, plan) -> str:
    """What the committed rows of ``model`` hold of ``plan`` (an ``EvalPlan``): per method spec and setting,
    the samples answered and refused of the cell's target, then the runs still to do and how many samples
    (each a prefill) they need; peer cells (``peer-*.jsonl``) with their sample counts. Reads rows only."""
    from collections import Counter

    from kvpack.eval.runner import load_results, load_rows, row_key, rows_in_plan

    done = {row_key(r): r.get("error") is None for r in rows_in_plan(load_results(rows_dir(model)), plan)}
    units = plan.units()
    answered, refused, pending_units, pending = Counter(), Counter(), set(), 0
    for spec in plan.specs:
        for unit in units:
            ok = done.get((*unit, *spec.key))
            if ok is None:
                pending += 1
                pending_units.add(unit)
            else:
                (answered if ok else refused)[(spec.label, unit[0])] += 1
    settings = sorted(plan.settings)
    target = len(units) // len(settings)
    lines = [f"{model}: {len(plan.specs)} method specs x {len(settings)} settings, {target} samples a cell", "",
             f"{'cell':36} " + " ".join(f"{s:>22}" for s in settings)]
    for spec in plan.specs:
        counts = [f"{answered[(spec.label, s)]:>3}/{target}" + (f" ({refused[(spec.label, s)]} refused)"
                                                                  if refused[(spec.label, s)] else "")
                  for s in settings]
        lines.append(f"{spec.label:36} " + " ".join(f"{c:>22}" for c in counts))
    lines += ["", f"to do: {pending} runs over {len(pending_units)} of {len(units)} (setting, sample) units "
              "(each unit pays one exact prefill, shared by its runs)"]
    peers = Counter()
    for path in sorted(rows_dir(model).glob("peer-*.jsonl")):
        for r in load_rows(path):
            if r.get("error") is None:
                peers[(r["label"], r["setting"])] += 1
    if peers:
        lines += ["", "peers (their own scripts):"]
        lines += [f"{label:36} {setting:>15} {n:>3}/{target}" for (label, setting), n in sorted(peers.items())]
    return "\n".join(lines)


def render_docs() -> None:
    """Every generated block of the README and docs/ (the frontier tables among them), from the results."""
    from render import render_all

    for path in render_all():
        print(f"rendered {path.relative_to(ROOT)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(LENGTHS))
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--samples", type=int, default=SAMPLES_PER_TASK_AND_LENGTH, help="per task and length")
    p.add_argument("--lengths", default=None, help="override the model's two lengths (comma-separated)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--settings", default="query-aware,query-agnostic")
    p.add_argument("--calibration", default=None, help="a kvtc calibration of this model: adds kvtc 4x/8x/16x")
    p.add_argument("--kvtc", action="store_true",
                   help="adds kvtc 4x/8x/16x with the frontier's own calibration of the model (made once, "
                   "kvpack calibrate's defaults at those ratios, into "
                   "benchmarks/results/frontier/<model>/kvtc-calibration, not committed)")
    p.add_argument("--only", default=None,
                   help="run only these method names (comma-separated, e.g. pca_quant,full) of the plan first; the "
                   "rows are the plan's own, so a later full run resumes past them")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--out", default=None, help="rows directory for a trial run (default: the committed one; "
                   "a trial directory writes no results file, plot or docs table)")
    p.add_argument("--render", action="store_true", help="only write the cells, plots and docs table")
    p.add_argument("--status", action="store_true",
                   help="only print how far the committed rows are: samples per cell of this plan (the same "
                   "--budgets, --kvtc, ... as the run), runs still to do, peers' samples; loads no model")
    args = p.parse_args()
    command = "python benchmarks/frontier.py " + " ".join(sys.argv[1:])
    os.chdir(ROOT)  # the kvtc calibration is named relative to the repository root
    if args.render:
        from kvpack.eval.runner import has_results

        for model in LENGTHS:
            if has_results(rows_dir(model)):
                print(write_results(model))
        render_docs()
        return 0

    from kvpack.eval.runner import EvalPlan, run_eval
    from kvpack.hf.models import load_model

    budgets = [float(b) for b in args.budgets.split(",")]
    if args.kvtc and args.calibration:
        p.error("give --kvtc (the frontier's own calibration) or --calibration DIR, not both")
    # relative to the repository root, so the rows' overrides (part of their identity) match on every machine
    calibration = (str(calibration_dir(args.model).relative_to(ROOT)) if args.kvtc else args.calibration)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else list(LENGTHS[args.model])
    layer_profile = str(layer_profile_dir(args.model).relative_to(ROOT))
    specs = frontier_specs(budgets, calibration, layer_profile)
    run_specs = specs
    if args.only:
        names = args.only.split(",")
        run_specs = [s for s in specs if (s.name or s.method) in names]
        missing = sorted(set(names) - {s.name or s.method for s in specs})
        if missing:
            p.error(f"--only: {missing} not in the plan; its names: {sorted({s.name or s.method for s in specs})}")
    plan = EvalPlan(tasks=args.tasks.split(","), lengths=lengths, samples=args.samples, specs=run_specs,
                    settings=args.settings.split(","), reference_timing=True)
    if args.status:
        print(status_report(args.model, plan))
        return 0
    out = Path(args.out) if args.out else rows_dir(args.model)
    out.mkdir(parents=True, exist_ok=True)
    # the plan the cells are rendered against: a run of some methods (--only) at some budgets adds to it, never
    # narrows it (a run at 0.28 alone would otherwise drop every other budget's cells from the results)
    planned = out / "frontier-plan.json"
    plan_budgets = budgets
    if args.only and planned.is_file():
        plan_budgets = sorted(set(budgets) | set(json.loads(planned.read_text())["budgets"]), reverse=True)
    planned.write_text(json.dumps(
        {"tasks": plan.tasks, "lengths": lengths, "samples_per_task_and_length": args.samples,
         "budgets": plan_budgets,
         "settings": plan.settings, "dtype": args.dtype,
         "specs": [s.label for s in frontier_specs(plan_budgets, calibration, layer_profile)], "command": command,
         "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}, indent=1) + "\n")
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    if args.kvtc:
        ensure_calibration(model, tokenizer, calibration)
        twins = resident_calibrations(calibration)
        for relative in dict.fromkeys(s.config["calibration"] for s in run_specs if s.method == "kvtc_resident"):
            if twins[relative] is not None:  # the twins of the rows to run (made once, like kvtc's own)
                ensure_calibration(model, tokenizer, relative, **twins[relative])
    if any(s.config.get("calibration") == layer_profile for s in run_specs):
        ensure_layer_profile(model, tokenizer, layer_profile)
    run_eval(model, tokenizer, plan, out, row_fields=machine_fields(args.dtype), rows_by_method=True)
    if args.out:
        return 0
    print(write_results(args.model, command))
    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
