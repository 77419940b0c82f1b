"""Summaries and plots of an evaluation run: ``summary.json``, ``summary.md``, PNG plots.

Per setting and method × budget, every score with its 95% interval (``kvpack.eval.stats``):

* per task: the mean score — Wilson interval when every score is 0 or 1, else a bootstrap over the
  samples;
* average: the mean of the per-task means — Wilson on the pooled count when the scores are 0/1 and
  the tasks have equal samples (the average is then one proportion), else a bootstrap over the
  samples;
* retention, paired: on the samples FullKV answers (score > 0), the method's total score ÷ FullKV's
  — Wilson when FullKV scores 1 on each of them and the method 0 or 1, else a bootstrap;
* the exact McNemar test against FullKV on "fully correct" (score = 1) over every sample both
  ran: ``p`` and whether the method is *distinguishable* from FullKV (p < 0.05) — with few samples
  "not distinguishable" means "no evidence of a difference", not "equal";
* the mean measured KV ratio (bytes held ÷ dense bf16 bytes), mean KL and continuation perplexity,
  and the number of samples and refusals;
* speed: the median decode ms/token (each row's median step after the first new token) and, paired,
  the median over samples of the row's ms/token ÷ FullKV's on the same sample (measured in the same
  run, one after the other), with the slowest of those ratios beside it.

Plots: average score (with its interval as an error bar) and decode ms/token against the measured
ratio per method (``score_vs_ratio.png``, two rows of panels) and a per-task heat map
(``heatmap_<setting>.png``).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .stats import bootstrap_interval, mcnemar_exact, wilson_interval
from .tasks import RULER_TASKS

SIGNIFICANCE = 0.05


def _binary(values: list[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def score_interval(scores: list[float]) -> tuple[float, float]:
    """95% interval of a mean score: Wilson for 0/1 scores, else a bootstrap over the samples."""
    if _binary(scores):
        return wilson_interval(sum(scores), len(scores))
    return bootstrap_interval(scores, statistics.fmean)


def average_interval(rows: list[dict]) -> tuple[float, float]:
    """95% interval of the mean over tasks of each task's mean score: Wilson on the pooled count when
    every score is 0 or 1 and every task has as many samples (the average is then one proportion;
    a bootstrap would give a zero-width interval when each task's scores are all equal), else a
    bootstrap over the samples."""
    counts = defaultdict(int)
    for r in rows:
        counts[r["task"]] += 1
    scores = [r["score"] for r in rows]
    if _binary(scores) and len(set(counts.values())) == 1:
        return wilson_interval(sum(scores), len(scores))
    return bootstrap_interval(rows, _task_average)


def _task_average(rows: list[dict]) -> float | None:
    """Mean over tasks of each task's mean score (None if a resample lost every row of a task)."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r["score"])
    return statistics.fmean(statistics.fmean(v) for v in by_task.values()) if by_task else None


def paired_retention(pairs: list[tuple[float, float]]) -> tuple[float | None, tuple[float, float]]:
    """Retention on the samples FullKV answers: ``(Σ method ÷ Σ FullKV, 95% interval)`` over
    ``pairs`` of (FullKV score, method score) with FullKV score > 0."""
    pairs = [(f, m) for f, m in pairs if f > 0]
    if not pairs:
        return None, (float("nan"), float("nan"))
    value = sum(m for _, m in pairs) / sum(f for f, _ in pairs)
    if all(f == 1.0 for f, _ in pairs) and _binary([m for _, m in pairs]):
        return value, wilson_interval(sum(m for _, m in pairs), len(pairs))
    return value, bootstrap_interval(pairs, lambda ps: sum(m for _, m in ps) / sum(f for f, _ in ps))


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _task_order(tasks: set[str]) -> list[str]:
    return sorted(tasks, key=lambda t: (RULER_TASKS.index(t) if t in RULER_TASKS else len(RULER_TASKS), t))


def _sample_key(row: dict) -> tuple:
    return row["task"], row["length"], row["sample"]


def summarize(rows: list[dict]) -> dict:
    """``{setting: {"tasks": [...], "methods": {label: {...}}}}`` (see the module doc)."""
    out: dict = {}
    by_setting: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_setting[r["setting"]].append(r)
    for setting, srows in by_setting.items():
        tasks = _task_order({r["task"] for r in srows})
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in srows:
            groups[r["label"]].append(r)
        full = {t: _mean(r["score"] for r in groups.get("full", []) if r["task"] == t) for t in tasks}
        full_by_sample = {_sample_key(r): r["score"] for r in groups.get("full", []) if r.get("error") is None}
        full_ms = {_sample_key(r): r["decode_ms"] for r in groups.get("full", [])
                   if r.get("error") is None and r.get("decode_ms")}
        methods = {}
        for label, grows in groups.items():
            ok = [r for r in grows if r.get("error") is None]
            scores = {t: [r["score"] for r in ok if r["task"] == t] for t in tasks}
            per_task = {t: statistics.fmean(v) if v else None for t, v in scores.items()}
            present = [v for v in per_task.values() if v is not None]
            pairs = [(full_by_sample[_sample_key(r)], r["score"]) for r in ok if _sample_key(r) in full_by_sample]
            retention, retention_ci = paired_retention(pairs)
            speed = [r["decode_ms"] / full_ms[_sample_key(r)] for r in ok
                     if r.get("decode_ms") and _sample_key(r) in full_ms]
            test = mcnemar_exact([f == 1.0 for f, _ in pairs], [m == 1.0 for _, m in pairs]) if pairs else None
            methods[label] = {
                "method": grows[0]["method"], "budget": grows[0]["budget"], "per_task": per_task,
                "per_task_ci": {t: score_interval(v) if v else None for t, v in scores.items()},
                "samples_per_task": {t: len(v) for t, v in scores.items()},
                "average": statistics.fmean(present) if present else None,
                "average_ci": average_interval(ok) if ok else None,
                "retention": retention, "retention_ci": retention_ci,
                "retention_per_task": {t: per_task[t] / full[t] for t in tasks
                                       if per_task.get(t) is not None and full.get(t)},
                "paired_samples": len(pairs), "mcnemar": test,
                "distinguishable": None if test is None else test["p_value"] < SIGNIFICANCE,
                "ratio": _mean(r.get("ratio") for r in ok), "kl_answer": _mean(r.get("kl_answer") for r in ok),
                "ppl_continuation": _mean(r.get("ppl_continuation") for r in ok),
                "compress_s": _mean(r.get("compress_s") for r in ok), "decode_s": _mean(r.get("decode_s") for r in ok),
                "decode_ms": _median(r.get("decode_ms") for r in ok),
                "speed_vs_full": statistics.median(speed) if speed else None,
                "speed_vs_full_max": max(speed) if speed else None,
                "runs": len(ok), "refused": len(grows) - len(ok),
                "errors": sorted({r["error"] for r in grows if r.get("error")}),
            }
        out[setting] = {"tasks": tasks, "lengths": sorted({r["length"] for r in srows}),
                        "samples_per_task": max(r["sample"] for r in srows) + 1, "methods": methods}
    return out


def _fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def _order(methods: dict) -> list[str]:
    return sorted(methods, key=lambda k: (k != "full", methods[k]["method"], -(methods[k]["budget"] or 1.0)))


def _with_ci(value, ci, spec=".2f") -> str:
    if value is None:
        return "–"
    if ci is None or ci[0] != ci[0]:  # no interval (nan)
        return format(value, spec)
    return f"{value:{spec}} ({ci[0]:{spec}}–{ci[1]:{spec}})"


def _test_cell(m: dict) -> str:
    if m["mcnemar"] is None or m["method"] == "full":
        return "–"
    t = m["mcnemar"]
    verdict = "**yes**" if m["distinguishable"] else "no"
    return f"{verdict} (p = {t['p_value']:.2g}; {t['only_reference']} vs {t['only_method']})"


def _speed_cell(m: dict) -> str:
    if m["speed_vs_full"] is None:
        return "–"
    return f"{m['speed_vs_full']:.2f}x ({m['speed_vs_full_max']:.2f}x)"


def summary_markdown(summary: dict) -> str:
    lines = []
    for setting, s in summary.items():
        tasks = s["tasks"]
        lines.append(f"### {setting} — lengths {', '.join(map(str, s['lengths']))}, "
                     f"{s['samples_per_task']} sample(s) per task and length\n")
        lines.append("Scores with 95% intervals; retention on the samples FullKV answers; *differs from FullKV*: "
                     "exact McNemar test on fully correct answers, p < 0.05 (samples only FullKV vs only the "
                     "method answers). Decode: median ms/token; *vs FullKV*: median over samples of ms/token ÷ "
                     "FullKV's on the same sample, same run (the slowest sample's ratio in brackets).\n")
        lines.append("| method | " + " | ".join(tasks) + " | average | retention | differs from FullKV | KV ratio | "
                     "KL (answer) | PPL (cont.) | decode ms/token | vs FullKV |")
        lines.append("|" + "---|" * (len(tasks) + 9))
        for label in _order(s["methods"]):
            m = s["methods"][label]
            if m["runs"] == 0:
                lines.append(f"| {label} | refused: {m['errors'][0] if m['errors'] else ''} |")
                continue
            cells = [_with_ci(m["per_task"][t], m["per_task_ci"][t]) for t in tasks]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_with_ci(m['average'], m['average_ci'])} | "
                         f"{_with_ci(m['retention'], m['retention_ci'])} | {_test_cell(m)} | "
                         f"{_fmt(m['ratio'], '.3f')} | {_fmt(m['kl_answer'], '.4f')} | "
                         f"{_fmt(m['ppl_continuation'], '.2f')} | {_fmt(m['decode_ms'], '.1f')} | "
                         f"{_speed_cell(m)} |")
        lines.append("")
    return "\n".join(lines)


def write_report(rows: list[dict], out_dir: str | Path) -> dict:
    """Write ``summary.json``, ``summary.md`` and the plots into ``out_dir``; returns the summary."""
    out_dir = Path(out_dir)
    summary = summarize(rows)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.md").write_text(summary_markdown(summary))
    _plots(summary, out_dir)
    return summary


def _plots(summary: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(summary)
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 8.5), squeeze=False)
    for ax, speed_ax, setting in zip(axes[0], axes[1], settings):
        by_method: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
        for m in summary[setting]["methods"].values():
            if m["ratio"] is not None and m["average"] is not None:
                lo, hi = m["average_ci"] if m["average_ci"] else (m["average"], m["average"])
                by_method[m["method"]].append((m["ratio"], m["average"], m["average"] - lo, hi - m["average"]))
        for method, pts in sorted(by_method.items()):
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[p[2] for p in pts], [p[3] for p in pts]],
                        marker="o", capsize=3, label=method)
        ax.set_xlabel("measured KV bytes / dense bf16 bytes")
        ax.set_ylabel("average score (95% interval)")
        ax.set_title(setting)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        speeds: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for m in summary[setting]["methods"].values():
            if m["ratio"] is not None and m.get("decode_ms") is not None:
                speeds[m["method"]].append((m["ratio"], m["decode_ms"]))
        for method, pts in sorted(speeds.items()):
            pts.sort()
            speed_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        speed_ax.set_xlabel("measured KV bytes / dense bf16 bytes")
        speed_ax.set_ylabel("decode ms/token (median)")
        speed_ax.set_xscale("log")
        speed_ax.grid(alpha=0.3)
        speed_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "score_vs_ratio.png", dpi=120)
    plt.close(fig)
    for setting in settings:
        s = summary[setting]
        labels = [lb for lb in _order(s["methods"]) if s["methods"][lb]["runs"]]
        tasks = s["tasks"]
        grid = [[s["methods"][lb]["per_task"][t] if s["methods"][lb]["per_task"][t] is not None else float("nan")
                 for t in tasks] for lb in labels]
        fig, ax = plt.subplots(figsize=(max(6.0, 3.0 + 0.8 * len(tasks)), 2.0 + 0.4 * len(labels)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.5 else "black")
        fig.colorbar(im, ax=ax)
        ax.set_title(f"score per task ({setting})")
        fig.tight_layout()
        fig.savefig(out_dir / f"heatmap_{setting}.png", dpi=120)
        plt.close(fig)
