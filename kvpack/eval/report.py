"""Summaries and plots of an evaluation run: ``summary.json``, ``summary.md``, PNG plots.

Per setting and method × budget: the mean score per task and on average, the retention (score ÷
FullKV's score on the same task and setting, averaged over the tasks where FullKV scores above 0),
the mean measured KV ratio (bytes held ÷ dense bf16 bytes), mean KL and continuation perplexity,
and the number of runs and refusals. Plots: average score against the measured ratio per method
(``score_vs_ratio.png``) and a per-task heat map (``heatmap_<setting>.png``).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .tasks import RULER_TASKS


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _task_order(tasks: set[str]) -> list[str]:
    return sorted(tasks, key=lambda t: (RULER_TASKS.index(t) if t in RULER_TASKS else len(RULER_TASKS), t))


def summarize(rows: list[dict]) -> dict:
    """``{setting: {"tasks": [...], "methods": {label: {...}}}}``."""
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
        methods = {}
        for label, grows in groups.items():
            ok = [r for r in grows if r.get("error") is None]
            per_task = {t: _mean(r["score"] for r in ok if r["task"] == t) for t in tasks}
            present = [v for v in per_task.values() if v is not None]
            retention = {t: per_task[t] / full[t] for t in tasks
                         if per_task.get(t) is not None and full.get(t)}
            methods[label] = {
                "method": grows[0]["method"], "budget": grows[0]["budget"], "per_task": per_task,
                "average": statistics.fmean(present) if present else None,
                "retention": statistics.fmean(retention.values()) if retention else None,
                "retention_per_task": retention,
                "ratio": _mean(r.get("ratio") for r in ok), "kl_answer": _mean(r.get("kl_answer") for r in ok),
                "ppl_continuation": _mean(r.get("ppl_continuation") for r in ok),
                "compress_s": _mean(r.get("compress_s") for r in ok), "decode_s": _mean(r.get("decode_s") for r in ok),
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


def summary_markdown(summary: dict) -> str:
    lines = []
    for setting, s in summary.items():
        tasks = s["tasks"]
        lines.append(f"### {setting} — lengths {', '.join(map(str, s['lengths']))}, "
                     f"{s['samples_per_task']} sample(s) per task and length\n")
        lines.append("| method | " + " | ".join(tasks) + " | average | retention | KV ratio | KL (answer) | "
                     "PPL (cont.) |")
        lines.append("|" + "---|" * (len(tasks) + 6))
        for label in _order(s["methods"]):
            m = s["methods"][label]
            if m["runs"] == 0:
                lines.append(f"| {label} | refused: {m['errors'][0] if m['errors'] else ''} |")
                continue
            cells = [_fmt(m["per_task"][t]) for t in tasks]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt(m['average'])} | {_fmt(m['retention'])} | "
                         f"{_fmt(m['ratio'], '.3f')} | {_fmt(m['kl_answer'], '.4f')} | "
                         f"{_fmt(m['ppl_continuation'], '.2f')} |")
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
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        by_method: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for m in summary[setting]["methods"].values():
            if m["ratio"] is not None and m["average"] is not None:
                by_method[m["method"]].append((m["ratio"], m["average"]))
        for method, pts in sorted(by_method.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("measured KV bytes / dense bf16 bytes")
        ax.set_ylabel("average score")
        ax.set_title(setting)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
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
