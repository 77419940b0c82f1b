"""The frontier's cells: an evaluation's rows pooled per (setting, method, budget), compared with FullKV
and with the best peer at equal or fewer bytes, as records a results file holds and a plot draws.

A *cell* pools every sample of one method at one budget in one setting, over all tasks and lengths
(the samples are the same for every method: one prefill per sample is shared by all of them). Per cell:

* ``score`` — the mean per-sample score with its 95% interval (Wilson when every score is 0 or 1,
  else a bootstrap over the samples);
* ``kl`` — the mean KL(FullKV ‖ method) per sample over the answer and a held-out continuation
  (teacher-forced), with a bootstrap interval; ``kl_answer`` / ``kl_continuation`` its two parts;
  ``top1`` the share of those positions where the method's most likely token is FullKV's;
* ``bytes_ratio`` — the measured bytes held ÷ dense bf16 bytes, mean over the samples;
* ``vs_full`` — the exact McNemar test on fully correct answers against FullKV on the same samples;
* ``vs_best_peer`` — against the best *peer* (transformers' ``QuantizedCache``, llama.cpp, kvpress: the
  methods users already run; :data:`PEER_FAMILIES`) whose cell holds at most as many bytes as the cell holds
  or its budget allows (within :data:`BYTES_TOLERANCE`; :func:`bytes_limit`): the highest-scoring such
  cell, ties broken by the lower KL, among those with the most samples (a peer run cut short does not rank
  on a few samples); McNemar on the shared samples and the paired mean KL difference (method − peer) with a
  bootstrap interval;
* ``best_kvpack`` / ``vs_best_kvpack`` (peer cells only) — the other way round: the resident kvpack cell
  with the lowest KL holding at most the peer's measured bytes (within :data:`BYTES_TOLERANCE`; among the
  most complete), and the same paired comparison (peer − kvpack);
* ``decode_vs_full`` — the median over samples of the row's decode ms/token ÷ FullKV's on the same
  sample, and the slowest sample's ratio: FullKV's decode timed in the row's own run (the frontier times it
  for every sample), or for rows made before that, FullKV's row of the sample where it ran on the same CPU
  (``same_run`` counts the former); ``cpus`` names the CPUs the cell's rows ran on (a table shows the ratio
  only for a cell whose rows all ran on one).

Settings are written ``query_aware`` / ``query_agnostic`` in the records (the runner's rows say
``query-aware`` / ``query-agnostic``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ..methods.recommend import BYTES_TOLERANCE, CHOICES_FORMAT
from .report import score_interval
from .stats import bootstrap_interval, mcnemar_exact

REFERENCE = "full"
# Method families that are peers (what users run today), not kvpack's own methods or its baselines.
PEER_FAMILIES = ("hf_quantized", "llamacpp", "kvpress")
# Storage codecs: the cache is a blob between turns and is decoded before attention reads it.
STORAGE_FAMILIES = ("kvtc",)
# A peer counts as "at equal or fewer bytes" up to BYTES_TOLERANCE, a relative excess over the bytes a cell holds
# or was asked to hold (budgets are targets; measured ratios of two methods at one target differ in the third
# decimal); the default method's choice of a measured budget uses the same tolerance (kvpack.methods.recommend).
SIGNIFICANCE = 0.05


def setting_name(setting: str) -> str:
    """``query-aware`` -> ``query_aware`` (the records' spelling)."""
    return setting.replace("-", "_")


def _sample(row: dict) -> tuple:
    return row["task"], row["length"], row["sample"]


def _name(row: dict) -> str:
    """The method's display name: the row's label without its ``@budget``."""
    label = row.get("label", row["method"])
    return label.rsplit("@", 1)[0] if row.get("budget") is not None else label


def _mean(values: Iterable) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _mean_interval(values: list[float]) -> tuple[float, float] | None:
    return bootstrap_interval(values, statistics.fmean) if len(values) > 1 else None


def is_peer(family: str) -> bool:
    return family in PEER_FAMILIES


def frontier_cells(rows: list[dict], model: str) -> list[dict]:
    """One record per (setting, method name, budget) of ``rows`` (the runner's rows of one model),
    with the comparisons of the module doc. Refused rows (an ``error``) are counted, not pooled."""
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_cell[(r["setting"], _name(r), r.get("budget"))].append(r)
    cells = []
    for (setting, name, budget), crows in by_cell.items():
        ok = [r for r in crows if r.get("error") is None and r.get("score") is not None]
        scores = [r["score"] for r in ok]
        kls = [r["kl"] for r in ok if r.get("kl") is not None]
        top1 = [r["top1"] for r in ok if r.get("top1") is not None]
        cells.append({
            "model": model, "setting": setting_name(setting), "method": name, "family": crows[0]["method"],
            "peer": is_peer(crows[0]["method"]), "budget": budget, "overrides": crows[0].get("overrides", {}),
            "config": next((r["config"] for r in ok if r.get("config")), None),
            "bytes_ratio": _mean(r.get("ratio") for r in ok),
            "bytes_ratio_range": [min(r["ratio"] for r in ok), max(r["ratio"] for r in ok)] if ok else None,
            "n": len(ok), "refused": len(crows) - len(ok),
            "errors": sorted({r["error"] for r in crows if r.get("error")}),
            "score": statistics.fmean(scores) if scores else None,
            "score_ci": list(score_interval(scores)) if scores else None,
            "kl": statistics.fmean(kls) if kls else None, "kl_ci": _ci(kls),
            "kl_answer": _mean(r.get("kl_answer") for r in ok),
            "kl_continuation": _mean(r.get("kl_continuation") for r in ok),
            "top1": statistics.fmean(top1) if top1 else None, "top1_ci": _ci(top1),
            "per_task": {t: statistics.fmean(v) for t, v in _by_task(ok).items()},
            "lengths": sorted({r["length"] for r in ok}),
            "cpus": sorted({r["cpu"] for r in ok if r.get("cpu")}),
            "_rows": {_sample(r): r for r in ok},
        })
    by_setting: dict[str, list[dict]] = defaultdict(list)
    for c in cells:
        by_setting[c["setting"]].append(c)
    for scells in by_setting.values():
        full = next((c for c in scells if c["family"] == REFERENCE and c["budget"] is None), None)
        peers = [c for c in scells if c["peer"] and c["n"]]
        for c in scells:
            c["vs_full"] = _paired_test(c, full) if full is not None and c is not full else None
            c["decode_vs_full"] = _decode_ratio(c, full) if full is not None else None
            best = _best_peer(c, peers)
            c["best_peer"] = best["method"] if best is not None else None
            c["best_peer_bytes_ratio"] = best["bytes_ratio"] if best is not None else None
            c["vs_best_peer"] = _paired_test(c, best) if best is not None else None
        own = [c for c in scells if _is_resident_kvpack(c) and c["n"] and c["bytes_ratio"] is not None]
        for c in scells:
            if not c["peer"]:
                continue
            mine = _best_kvpack(c, own)
            c["best_kvpack"] = mine["method"] if mine is not None else None
            c["best_kvpack_budget"] = mine["budget"] if mine is not None else None
            c["vs_best_kvpack"] = _paired_test(c, mine) if mine is not None else None
    for c in cells:
        del c["_rows"]
    return sorted(cells, key=lambda c: (c["setting"], c["family"] != REFERENCE, c["peer"], c["method"],
                                        -(c["budget"] or 1.0)))


def _ci(values: list[float]) -> list[float] | None:
    ci = _mean_interval(values)
    return list(ci) if ci is not None else None


def _by_task(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        out[r["task"]].append(r["score"])
    return out


def _most_complete(cells: list[dict]) -> list[dict]:
    """The cells with as many samples as the most complete of them: a cell whose rows are still coming in (a
    peer run cut short after a few samples) does not rank against complete ones on a handful of samples."""
    most = max((c["n"] for c in cells), default=0)
    return [c for c in cells if c["n"] == most]


def bytes_limit(measured: float, target: float | None) -> float:
    """The most bytes (÷ dense bf16) a cell compared with "at equal or fewer bytes" may hold: the larger of the
    ``measured`` bytes and the ``target`` budget (None: a method set by its own parameters), plus
    :data:`BYTES_TOLERANCE`.

    The target counts so that a method coming in under the bytes it was asked for still meets the peers at
    those bytes, and so that one method at one target meets the same peers in both settings: its measured
    bytes differ between them in the fourth decimal (0.2756 and 0.2758 at a 0.28 target put a 0.2812 peer on
    either side of a limit taken from the measured bytes alone)."""
    return max(measured, target if target is not None else 0.0) * (1 + BYTES_TOLERANCE)


def _best_peer(cell: dict, peers: list[dict]) -> dict | None:
    """The highest-scoring peer cell (then the lower KL) within the cell's :func:`bytes_limit`, among the most
    complete such cells (:func:`_most_complete`)."""
    if cell["bytes_ratio"] is None or cell["peer"]:
        return None
    limit = bytes_limit(cell["bytes_ratio"], cell["budget"])
    fits = _most_complete([p for p in peers if p["bytes_ratio"] is not None and p["bytes_ratio"] <= limit])
    if not fits:
        return None
    return max(fits, key=lambda p: (p["score"], -(p["kl"] if p["kl"] is not None else float("inf"))))


def _is_resident_kvpack(cell: dict) -> bool:
    """One of kvpack's resident methods (or baselines): not FullKV, not a peer, not a storage codec."""
    return not cell["peer"] and cell["family"] != REFERENCE and cell["family"] not in STORAGE_FAMILIES


def _best_kvpack(peer: dict, own: list[dict]) -> dict | None:
    """The resident kvpack cell with the lowest KL (then the higher score) holding at most the peer cell's
    measured bytes (+ :data:`BYTES_TOLERANCE`), among the most complete such cells: what kvpack offers a user
    of that peer at no more memory. A peer has no budget target here (kvpress's kept share is not a byte
    target), so only its measured bytes count."""
    if peer["bytes_ratio"] is None:
        return None
    return _lowest_kl_within(own, bytes_limit(peer["bytes_ratio"], None))


def _lowest_kl_within(cells: list[dict], limit: float) -> dict | None:
    """The cell with the lowest KL (then the higher score, :func:`_kl_first`) among the most complete of
    ``cells`` holding at most ``limit`` of the bytes (:func:`_most_complete`); None when none does."""
    fits = _most_complete([c for c in cells if c["bytes_ratio"] is not None and c["bytes_ratio"] <= limit])
    return min(fits, key=_kl_first) if fits else None


def _paired_test(cell: dict, other: dict) -> dict | None:
    """McNemar on fully correct answers and the mean KL difference (cell − other), over the samples
    both ran."""
    shared = sorted(set(cell["_rows"]) & set(other["_rows"]))
    if not shared:
        return None
    mine = [cell["_rows"][k] for k in shared]
    theirs = [other["_rows"][k] for k in shared]
    test = mcnemar_exact([r["score"] == 1.0 for r in theirs], [r["score"] == 1.0 for r in mine])
    diffs = [a["kl"] - b["kl"] for a, b in zip(mine, theirs) if a.get("kl") is not None and b.get("kl") is not None]
    return {"against": _label(other),
            "n": len(shared), "score_diff": statistics.fmean(a["score"] - b["score"] for a, b in zip(mine, theirs)),
            "only_other": test["only_reference"], "only_method": test["only_method"], "p_value": test["p_value"],
            "distinguishable": test["p_value"] < SIGNIFICANCE,
            "kl_diff": statistics.fmean(diffs) if diffs else None, "kl_diff_ci": _ci(diffs)}


def _decode_ratio(cell: dict, full: dict) -> dict | None:
    """Median and slowest per-sample decode ms/token ÷ FullKV's: FullKV's decode of the same sample timed in the
    row's own run (``reference_decode_ms``) where the row has it, else FullKV's row of the sample when that ran on
    the same CPU (a ratio across machines would measure the machines; a row without a CPU pairs with none).
    ``same_run``: how many of the ratios have their reference from the row's own run."""
    ratios, same_run = [], 0
    for k, r in cell["_rows"].items():
        if not r.get("decode_ms"):
            continue
        if r.get("reference_decode_ms"):
            ratios.append(r["decode_ms"] / r["reference_decode_ms"])
            same_run += 1
            continue
        ref = full["_rows"].get(k)
        if ref is not None and ref.get("decode_ms") and r.get("cpu") and r.get("cpu") == ref.get("cpu"):
            ratios.append(r["decode_ms"] / ref["decode_ms"])
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "max": max(ratios), "n": len(ratios), "same_run": same_run}


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


def _fmt_ci(value, ci, spec=".2f") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}} ({ci[0]:{spec}}–{ci[1]:{spec}})" if ci else format(value, spec)


def _kl_first(c: dict) -> tuple:
    """Ranking key: the lower mean KL first (the finer measure: a cell's score interval is wide), then the
    higher score; a cell without KL (llama.cpp's) ranks after every cell with one."""
    return (c["kl"] is None, c["kl"] if c["kl"] is not None else 0.0, -(c["score"] or 0.0))


def is_storage(cell: dict) -> bool:
    """A storage codec's cell (the cache is a blob between turns, decoded before attention), not resident."""
    return cell["family"] in STORAGE_FAMILIES


def ranked_per_budget(cells: list[dict], setting: str, budget: float) -> list[dict]:
    """The resident kvpack cells (not FullKV, not a peer, not a storage codec) at a budget, best first: those at
    that target — or, for a method set by its own parameters rather than a target (``kvtc_resident``'s ratio,
    PuzzleKV's INT4 paper setting), holding at most the target's bytes — among the cells with as many samples as
    the most complete one (:func:`_most_complete`), by the lower mean KL, then the higher score (:func:`_kl_first`)."""

    def at_target(c: dict) -> bool:
        if c["budget"] is None:
            return c["bytes_ratio"] is not None and c["bytes_ratio"] <= budget
        return c["budget"] == budget

    own = [c for c in cells if c["setting"] == setting and at_target(c) and not c["peer"]
           and c["family"] != REFERENCE and not is_storage(c) and c["n"]]
    return sorted(_most_complete(own), key=_kl_first)


def best_per_budget(cells: list[dict], setting: str, budget: float) -> tuple[dict | None, dict | None, dict | None]:
    """``(best resident kvpack cell, best storage cell, best peer cell)`` at a budget: the resident kvpack
    method (not FullKV, not a peer) at that target — or, for one set by its own parameters rather than a
    target (``kvtc_resident``'s ratio, PuzzleKV's INT4 paper setting), holding at most the target's bytes —
    with the lowest mean KL (then the higher score), among the cells with as many samples as the most
    complete one (a method whose rows are still coming in does not rank on fewer samples); the storage codec
    and the peer with the lowest KL within :func:`bytes_limit` of that cell's measured bytes and the budget,
    each by the same rule (:func:`_most_complete`)."""
    ranked = ranked_per_budget(cells, setting, budget)
    if not ranked:
        return None, None, None
    best = ranked[0]
    limit = bytes_limit(best["bytes_ratio"], budget)

    def fitting(pred):
        return _lowest_kl_within([c for c in cells if c["setting"] == setting and c["n"] and pred(c)], limit)

    return best, fitting(is_storage), fitting(lambda c: c["peer"])


def _cell_text(c: dict | None, empty: str = "none at ≤ bytes", samples: int | None = None) -> str:
    """A cell's method, KL, score (interval) and bytes; its sample count too where it has fewer than
    ``samples`` (the row's own method's: a cell whose rows are still coming in says so)."""
    if c is None:
        return empty
    fewer = f", {c['n']} samples" if samples is not None and c["n"] < samples else ""
    return f"`{c['method']}` {_figures_text(c)}{fewer}"


def _figures_text(c: dict) -> str:
    """A cell's mean KL, score (interval) and measured bytes."""
    kl = "–" if c["kl"] is None else f"{c['kl']:.3g}"
    return f"{kl}, {_fmt_ci(c['score'], c['score_ci'])}, {c['bytes_ratio']:.3f}"


def _budget_text(c: dict) -> str:
    return "–" if c["budget"] is None else f"{c['budget']:g}"


def _label(c: dict) -> str:
    """``method@budget`` (or the method alone where its bytes follow its own settings)."""
    return c["method"] if c["budget"] is None else f"{c['method']}@{c['budget']:g}"


def frontier_table_markdown(records: dict[str, dict]) -> str:
    """A short table from frontier results files (``{model: file contents}``): per model, setting and
    budget, the best resident kvpack method, the best storage codec and the best peer at equal or fewer
    bytes (:func:`best_per_budget`), each with its mean KL, score (95% interval) and measured bytes (and its
    samples, where fewer than the kvpack method's)."""
    lines = ["| model | setting | budget | best resident kvpack method: KL, score, bytes | storage (kvtc) at ≤ "
             "bytes | best peer at ≤ bytes | FullKV score | samples |", "|---|---|---|---|---|---|---|---|"]
    for model, data in records.items():
        cells = data["cells"]
        for setting in ("query_aware", "query_agnostic"):
            full = next((c for c in cells if c["setting"] == setting and c["family"] == REFERENCE), None)
            for budget in data["budgets"]:
                best, storage, peer = best_per_budget(cells, setting, budget)
                if best is None:
                    continue
                lines.append(f"| {model} | {setting.replace('_', '-')} | {budget:g} | {_cell_text(best)} | "
                             f"{_cell_text(storage, samples=best['n'])} | {_cell_text(peer, samples=best['n'])} | "
                             f"{_fmt_ci(full['score'], full['score_ci']) if full else '–'} | {best['n']} |")
    return "\n".join(lines)


def _verdict(vs: dict) -> str:
    """Who wins a paired comparison of a peer with kvpack (``vs``: :func:`_paired_test` of the peer against the
    kvpack cell): more fully correct answers where McNemar's p < 0.05, lower mean KL where the paired interval
    of the difference excludes zero; "not distinguishable" where neither is."""
    parts = []
    if vs["distinguishable"]:
        # McNemar's discordant pairs: answers only the peer got (only_method) against only kvpack's
        parts.append(f"more answers: {'peer' if vs['only_method'] > vs['only_other'] else 'kvpack'}")
    ci = vs.get("kl_diff_ci")
    if ci is not None and (ci[0] > 0 or ci[1] < 0):
        parts.append(f"lower KL: {'kvpack' if ci[0] > 0 else 'peer'}")
    return "; ".join(parts) or "not distinguishable"


def peers_vs_kvpack_markdown(records: dict[str, dict]) -> str:
    """Every peer cell of frontier results files against the best resident kvpack cell holding at most its
    bytes (``best_kvpack``), paired on their shared samples: one line per (model, setting, peer cell)."""
    lines = ["| model | setting | peer | its KL, score, bytes | best kvpack at ≤ bytes | score: peer − kvpack "
             "(McNemar p) | KL: peer − kvpack (95% interval) | shared samples | who wins |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, data in records.items():
        by_key = {(c["setting"], c["method"], c["budget"]): c for c in data["cells"]}
        for c in data["cells"]:
            if not c["peer"] or not c["n"]:
                continue
            vs, mine = c.get("vs_best_kvpack"), by_key.get((c["setting"], c.get("best_kvpack"),
                                                            c.get("best_kvpack_budget")))
            head = f"| {model} | {c['setting'].replace('_', '-')} | `{_label(c)}` | {_figures_text(c)} | "
            if mine is None or vs is None:
                lines.append(head + "none at ≤ bytes | – | – | – | – |")
                continue
            kl = "–" if vs["kl_diff"] is None else _fmt_ci(vs["kl_diff"], vs["kl_diff_ci"], ".3g")
            lines.append(head + f"`{_label(mine)}` {_figures_text(mine)} | {vs['score_diff']:+.2f} "
                         f"(p = {vs['p_value']:.2g}) | {kl} | {vs['n']} | {_verdict(vs)} |")
    return "\n".join(lines) if len(lines) > 2 else "(no peer cells yet)"


def method_table_markdown(records: dict[str, dict], families: Iterable[str]) -> str:
    """Every cell of the given method families (registry names, e.g. ``("anchor", "anchor_plus")``) in
    frontier results files, with FullKV's score beside: one line per (model, setting, method, budget)."""
    families = set(families)
    lines = ["| model | setting | method | budget | bytes | KL (95% interval) | top-1 | score (95% interval) | "
             "differs from FullKV | decode ÷ FullKV | samples |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, data in records.items():
        for c in data["cells"]:
            if c["family"] not in families:
                continue
            if not c["n"]:  # refused on every sample so far: say so, with the method's reason
                if c["refused"]:
                    reason = "; ".join(c["errors"][:1]).replace("|", "\\|")
                    lines.append(f"| {model} | {c['setting'].replace('_', '-')} | `{c['method']}` | "
                                 f"{_budget_text(c)} | – | – | – | refused on every sample ({c['refused']}), e.g. "
                                 f"{reason} | – | – | 0 |")
                continue
            vs = c.get("vs_full")
            differs = "–" if vs is None else (f"{'**yes**' if vs['distinguishable'] else 'no'} "
                                              f"(p = {vs['p_value']:.2g})")
            dec = c.get("decode_vs_full")
            # a speed ratio is shown only where every row ran on one CPU (figures of two CPUs never mix)
            speed = "–" if dec is None else (f"{dec['median']:.2f}x" if len(c.get("cpus", [])) <= 1
                                             else "several CPUs")
            lines.append(f"| {model} | {c['setting'].replace('_', '-')} | `{c['method']}` | {_budget_text(c)} | "
                         f"{c['bytes_ratio']:.3f} | {_fmt_ci(c['kl'], c['kl_ci'], '.3g')} | "
                         f"{'–' if c['top1'] is None else format(c['top1'], '.3f')} | "
                         f"{_fmt_ci(c['score'], c['score_ci'])} | {differs} | {speed} | {c['n']} |")
    return "\n".join(lines) if len(lines) > 2 else "(no frontier cells of this method yet)"


def coverage_markdown(records: dict[str, dict]) -> str:
    """How far each model's frontier is from its plan: the planned cells (a results file's ``planned``:
    ``cells`` — kvpack's method specs as labels, ``peers`` — the peers' configurations, ``settings`` and the
    ``target`` samples a cell) that hold fewer samples than the target in either setting, one line per method
    with each short budget's samples in each setting (answered, and refused: a refusal is a result, so it counts
    towards the target). A planned cell with no rows at all is listed with 0."""
    lines = []
    for model, data in records.items():
        plan = data.get("planned")
        if not plan:
            lines.append(f"{model}: no plan recorded in its results file.")
            continue
        target, settings = plan["target"], [setting_name(s) for s in plan["settings"]]
        have = {(_label(c), c["setting"]): (c["n"], c["refused"]) for c in data["cells"]}
        short: dict[tuple[str, str], list[str]] = {}  # (kind, method) -> its short budgets' text, in plan order
        for kind, labels in (("kvpack", plan["cells"]), ("peer", plan["peers"])):
            for label in labels:
                counts = [have.get((label, s), (0, 0)) for s in settings]
                if all(n + refused >= target for n, refused in counts):
                    continue
                name, _, budget = label.partition("@")
                text = " / ".join(f"{n}" + (f" (+{refused} refused)" if refused else "") for n, refused in counts)
                short.setdefault((kind, name), []).append(f"{budget}: {text}" if budget else text)
        n_short, total = sum(len(v) for v in short.values()), len(plan["cells"]) + len(plan["peers"])
        lines.append(f"{model}: {total - n_short} of {total} planned cells hold all {target} samples in both "
                     f"settings; {n_short} hold fewer.")
        if short:
            lines += ["", f"| model | kind | method | samples ({' / '.join(s.replace('_', '-') for s in settings)})"
                      " where fewer than the target, by budget |", "|---|---|---|---|"]
            lines += [f"| {model} | {kind} | `{name}` | {'; '.join(parts)} |" for (kind, name), parts in short.items()]
        lines.append("")
    return "\n".join(lines).rstrip() if lines else "(no frontier results yet)"


def _choice(c: dict | None) -> dict | None:
    """What a choice records of a cell: its name (a method or preset), budget target, KL, score, bytes, samples."""
    if c is None:
        return None
    return {"method": c["method"], "budget": c["budget"], "kl": c["kl"], "kl_ci": c["kl_ci"], "score": c["score"],
            "score_ci": c["score_ci"], "bytes_ratio": c["bytes_ratio"], "n": c["n"]}


def frontier_choices(records: dict[str, dict], fingerprints: dict[str, str | None]) -> dict:
    """The frontier's ranking as the data kvpack's default reads (``kvpack/data/frontier_choices.json``): per
    model (with its fingerprint hash, to recognise it), setting and budget, the resident kvpack cells best first
    (:func:`ranked_per_budget`), the best storage codec and the best peer at no more bytes, FullKV's score."""
    models = {}
    for model, data in records.items():
        settings = {}
        for setting in ("query_aware", "query_agnostic"):
            full = next((c for c in data["cells"] if c["setting"] == setting and c["family"] == REFERENCE), None)
            budgets = []
            for budget in data["budgets"]:
                ranked = ranked_per_budget(data["cells"], setting, budget)
                if not ranked:
                    continue
                _, storage, peer = best_per_budget(data["cells"], setting, budget)
                budgets.append({"budget": budget, "ranked": [_choice(c) for c in ranked],
                                "storage": _choice(storage), "peer": _choice(peer),
                                "full_score": None if full is None else full["score"]})
            settings[setting] = budgets
        models[model] = {"fingerprint": fingerprints.get(model), "settings": settings}
    return {"format": CHOICES_FORMAT, "version": 1, "source": "benchmarks/results/frontier-*.json", "models": models}


def guidance_markdown(choices: dict) -> str:
    """Which method when, from :func:`frontier_choices`: per model, setting and budget, the method to use with its
    KL and score, the runner-up, and the best peer at no more bytes."""
    lines = ["| model | setting | budget | use | its KL, score | runner-up: KL, score | best peer at ≤ bytes: KL, "
             "score |", "|---|---|---|---|---|---|---|"]

    def figures(c: dict) -> str:
        kl = "–" if c["kl"] is None else f"{c['kl']:.3g}"
        return f"{kl}, {_fmt_ci(c['score'], c['score_ci'])}"

    for model, data in choices["models"].items():
        for setting, budgets in data["settings"].items():
            for b in budgets:
                best, rest = b["ranked"][0], b["ranked"][1:]
                runner = f"`{rest[0]['method']}` {figures(rest[0])}" if rest else "–"
                peer = f"`{b['peer']['method']}` {figures(b['peer'])}" if b["peer"] else "none at ≤ bytes"
                lines.append(f"| {model} | {setting.replace('_', '-')} | {b['budget']:g} | `{best['method']}` | "
                             f"{figures(best)} | {runner} | {peer} |")
    return "\n".join(lines)
