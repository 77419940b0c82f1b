"""``kvpack eval``, kvpack's main job: a RULER-style evaluation of methods at matched bytes, with
intervals and paired tests, results resumable in an output directory."""

from __future__ import annotations

from pathlib import Path

from ..eval.report import summary_markdown, write_report
from ..eval.runner import SETTINGS, EvalPlan, method_specs, rows_in_plan, run_eval
from ..eval.tasks import NIAH_TASKS, RULER_TASKS
from ..methods import available_methods, available_presets, method_config_class
from ..methods.recommend import AUTO, SETTING, load_choices, recommend
from .common import add_command, add_model_args, load

# The main job's defaults, the quick look (the full frontier is benchmarks/frontier.py), sized to finish in
# under ten minutes on two cores from a fresh install (the model's conversion and the native build included):
# the two tasks the 135M default model answers reliably with the exact cache at 2K tokens, 8 needle depths each
# (16 paired samples per method: enough for the McNemar test to tell a method that loses the needles from
# FullKV), the setting kvpack's default is chosen for (a cache reused for questions it was not built for:
# query-agnostic), at 0.28 of the bf16 bytes (where transformers' own 4-bit QuantizedCache sits). Methods:
# FullKV, kvpack's default (auto: the frontier's pick for the model at that budget), the KIVI and SnapKV
# baselines and the QuantizedCache peer; every other method, preset, budget and the query-aware setting are a
# flag away, and on the frontier.
DEFAULT_EVAL_TASKS = "niah_single_1,niah_single_2"
DEFAULT_EVAL_METHODS = "full,auto,kivi,snapkv,hf_quantized"
DEFAULT_EVAL_BUDGETS = "0.28"
DEFAULT_EVAL_SETTING = "query-agnostic"
FRONTIER_HINT = ("the full frontier (8 tasks at 4K and 8K, 48 samples a cell, five budgets, every method and peer, "
                 "two models): docs/eval.md, benchmarks/results/frontier-*.json, python benchmarks/frontier.py")


def _task_list(text: str) -> list[str]:
    out: list[str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        out.extend(RULER_TASKS if item == "ruler" else NIAH_TASKS if item == "niah" else [item])
    return out


def default_picks(model, budgets: list[float]) -> str:
    """What kvpack's default (``method="auto"``, no method named) picks for this model at each of ``budgets`` and
    at each budget the frontier measured, and why."""
    measured = {b["budget"] for d in load_choices()["models"].values() for b in d["settings"].get(SETTING, [])}
    lines = []
    for b in sorted({*budgets, *measured}, reverse=True):
        try:
            rec = recommend(model, b)
            lines.append(f"  at {b:g}: {rec.method} — {rec.reason}")
        except ValueError as exc:
            lines.append(f"  at {b:g}: none ({exc})")
    return "kvpack's default cache for this model (method auto, or no method named):\n" + "\n".join(lines)


def _eval_overrides(items: list[str], calibration: str | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        if not dot or name not in available_methods() + available_presets():
            raise ValueError(f"--set expects METHOD.KEY=VALUE with a known method, got {item!r}")
        out.setdefault(name, {}).update(method_config_class(name).parse_overrides([rest]))
    if calibration is not None:
        out.setdefault("kvtc", {})["calibration"] = calibration
    return out


def cmd_eval(args) -> int:
    """RULER-style evaluation of methods x budgets; writes results, summaries and plots to --out."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    settings = list(SETTINGS) if args.setting == "both" else [args.setting]
    overrides = _eval_overrides(args.set, args.calibration)
    method_specs([m for m in methods if m != AUTO], budgets, overrides)  # refuse a bad name before loading
    model, tokenizer = load(args)
    picks = default_picks(model, budgets)
    print(picks)
    plan = EvalPlan(tasks=_task_list(args.tasks), lengths=[int(n) for n in args.lengths.split(",")],
                    samples=args.samples, specs=method_specs(methods, budgets, overrides, model=model),
                    settings=settings, seed=args.seed, fidelity=not args.no_fidelity)
    rows = rows_in_plan(run_eval(model, tokenizer, plan, args.out, progress=not args.quiet), plan)
    summary = write_report(rows, args.out)
    print(summary_markdown(summary))
    print(picks)
    print(f"results: {Path(args.out) / 'results.jsonl'}; summary: {Path(args.out) / 'summary.md'}; "
          f"plots: {Path(args.out) / 'score_vs_ratio.png'}, heatmap_<setting>.png")
    print(FRONTIER_HINT)
    return 0


def add_parsers(sub) -> None:
    e = add_command(sub, "eval", "kvpack's main job: RULER-style long-context evaluation at matched bytes",
                    "HF_HUB_OFFLINE=1 kvpack eval",
                    "kvpack eval --methods full,anchor_plus,hf_quantized --budgets 0.28,0.15 --tasks niah_single_2 "
                    "--lengths 4096 --samples 4 --out ev/")
    add_model_args(e, "bfloat16")
    e.add_argument("--methods", default=DEFAULT_EVAL_METHODS, help="comma-separated methods")
    e.add_argument("--budgets", default=DEFAULT_EVAL_BUDGETS,
                   help="comma-separated budgets (fractions of dense bf16 bytes)")
    e.add_argument("--tasks", default=DEFAULT_EVAL_TASKS,
                   help="comma-separated tasks, or 'ruler' (all 12) / 'niah' (the 8 NIAH tasks)")
    e.add_argument("--lengths", default="2048", help="comma-separated prompt lengths in tokens")
    e.add_argument("--samples", type=int, default=8, help="samples per task and length (needle depth swept)")
    e.add_argument("--setting", default=DEFAULT_EVAL_SETTING, choices=(*SETTINGS, "both"),
                   help=f"which prefill the methods compress (default {DEFAULT_EVAL_SETTING}: the context alone, a "
                   "cache reused for questions it was not built for; query-aware: the question too)")
    e.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="a config field of one method, e.g. puzzle.page_size=64")
    e.add_argument("--calibration", default=None, help="kvtc calibration directory (for --methods kvtc)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-fidelity", action="store_true", help="skip the KL / perplexity passes")
    e.add_argument("--out", default="kvpack-eval", help="output directory (resumed if it has results)")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)
