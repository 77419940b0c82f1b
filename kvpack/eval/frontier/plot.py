"""The frontier's plots: score and KL against measured bytes, one curve per method."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

_MARKERS = ("o", "^", "D", "v", "P")


def curve_label(name: str, counts: list[int], most: int) -> str:
    """A plot's legend entry: the method's name, and the sample counts of its cells (``counts``) where one has
    fewer than the most complete cell of the plot (a curve still filling in, or a peer cut short, says so)."""
    low, high = min(counts), max(counts)
    if low >= most:
        return name
    return f"{name} (n = {low})" if low == high else f"{name} (n = {low}–{high})"


def plot_frontier(cells: list[dict], path_prefix: str | Path) -> list[Path]:
    """One PNG per setting, ``<path_prefix>-<setting>.png``: score vs bytes and KL vs bytes (log axes),
    one curve per method over its budgets, peers dashed, a curve with fewer samples than the most complete
    labelled with its count (:func:`curve_label`); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for setting in sorted({c["setting"] for c in cells}):
        scells = [c for c in cells if c["setting"] == setting and c["n"] and c["bytes_ratio"] is not None]
        fig, (ax_s, ax_k) = plt.subplots(1, 2, figsize=(13, 5.2))
        curves: dict[str, list[dict]] = defaultdict(list)
        for c in scells:
            curves[c["method"]].append(c)
        most = max((c["n"] for c in scells), default=0)
        for i, (name, pts) in enumerate(sorted(curves.items())):
            pts.sort(key=lambda c: c["bytes_ratio"])
            # tab20's colours repeat after 20 curves: the marker tells those apart
            marker = "s" if pts[0]["peer"] else _MARKERS[(i // 20) % len(_MARKERS)]
            style = dict(linestyle="--" if pts[0]["peer"] else "-", marker=marker, color=plt.cm.tab20(i % 20),
                         label=curve_label(name, [c["n"] for c in pts], most))
            x = [c["bytes_ratio"] for c in pts]
            y = [c["score"] for c in pts]
            # clamped: Wilson's bounds at a score of 0 or 1 can sit a rounding error inside it
            err = [[max(0.0, c["score"] - c["score_ci"][0]) for c in pts],
                   [max(0.0, c["score_ci"][1] - c["score"]) for c in pts]]
            ax_s.errorbar(x, y, yerr=err, capsize=3, **style)
            kl = [(c["bytes_ratio"], c["kl"]) for c in pts if c["kl"] is not None and c["kl"] > 0]
            if kl:
                ax_k.plot([p[0] for p in kl], [p[1] for p in kl], **style)
        model = scells[0]["model"] if scells else ""
        ax_s.set(xscale="log", xlabel="measured KV bytes / dense bf16 bytes", ylabel="score (95% interval)",
                 title=f"{model}, {setting}: score", ylim=(-0.02, 1.02))
        ax_k.set(xscale="log", yscale="log", xlabel="measured KV bytes / dense bf16 bytes",
                 ylabel="mean KL(FullKV ‖ method), answer + continuation", title=f"{model}, {setting}: KL")
        for ax in (ax_s, ax_k):
            ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        # one legend for both panels, outside them (the score panel has every curve; llama.cpp has no KL)
        handles, labels = ax_s.get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
                   ncol=1 if len(labels) <= 24 else 2)
        path = Path(f"{path_prefix}-{setting}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
