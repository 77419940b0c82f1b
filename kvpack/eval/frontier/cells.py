"""The frontier's cells: an evaluation's rows pooled per (setting, method, budget), with their intervals and
the paired comparisons against FullKV and the best peer at no more bytes (the package doc lists every field)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from ..report import score_interval
from ..stats import bootstrap_interval, mcnemar_exact
from .families import REFERENCE, SIGNIFICANCE, is_peer, is_resident_kvpack, label
from .ranking import best_kvpack, best_peer


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
            "model": model, "setting": setting, "method": name, "family": crows[0]["method"],
            "peer": is_peer(crows[0]["method"]), "budget": budget, "overrides": crows[0].get("overrides", {}),
            "config": next((r["config"] for r in ok if r.get("config")), None),
            "bytes_ratio": _mean(r.get("ratio") for r in ok),
            "bytes_ratio_range": [min(r["ratio"] for r in ok), max(r["ratio"] for r in ok)] if ok else None,
            "n": len(ok), "refused": len(crows) - len(ok),
            "errors": sorted({r["error"] for r in crows if r.get("error")}),
            "score": statistics.fmean(scores) if scores else None,
            "score_ci": list(score_interval(scores)) if scores else None,
            "kl": statistics.fmean(kls) if kls else None, "kl_ci": ci_of(kls),
            "kl_answer": _mean(r.get("kl_answer") for r in ok),
            "kl_continuation": _mean(r.get("kl_continuation") for r in ok),
            "top1": statistics.fmean(top1) if top1 else None, "top1_ci": ci_of(top1),
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
            c["vs_full"] = paired_test(c, full) if full is not None and c is not full else None
            c["decode_vs_full"] = _decode_ratio(c, full) if full is not None else None
            best = best_peer(c, peers)
            c["best_peer"] = best["method"] if best is not None else None
            c["best_peer_bytes_ratio"] = best["bytes_ratio"] if best is not None else None
            c["vs_best_peer"] = paired_test(c, best) if best is not None else None
        own = [c for c in scells if is_resident_kvpack(c) and c["n"] and c["bytes_ratio"] is not None]
        for c in scells:
            if not c["peer"]:
                continue
            mine = best_kvpack(c, own)
            c["best_kvpack"] = mine["method"] if mine is not None else None
            c["best_kvpack_budget"] = mine["budget"] if mine is not None else None
            c["vs_best_kvpack"] = paired_test(c, mine) if mine is not None else None
    for c in cells:
        del c["_rows"]
    return sorted(cells, key=lambda c: (c["setting"], c["family"] != REFERENCE, c["peer"], c["method"],
                                        -(c["budget"] or 1.0)))


def ci_of(values: list[float]) -> list[float] | None:
    ci = _mean_interval(values)
    return list(ci) if ci is not None else None


def _by_task(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        out[r["task"]].append(r["score"])
    return out


def paired_test(cell: dict, other: dict) -> dict | None:
    """McNemar on fully correct answers and the mean KL difference (cell − other), over the samples
    both ran."""
    shared = sorted(set(cell["_rows"]) & set(other["_rows"]))
    if not shared:
        return None
    mine = [cell["_rows"][k] for k in shared]
    theirs = [other["_rows"][k] for k in shared]
    test = mcnemar_exact([r["score"] == 1.0 for r in theirs], [r["score"] == 1.0 for r in mine])
    diffs = [a["kl"] - b["kl"] for a, b in zip(mine, theirs) if a.get("kl") is not None and b.get("kl") is not None]
    return {"against": label(other),
            "n": len(shared), "score_diff": statistics.fmean(a["score"] - b["score"] for a, b in zip(mine, theirs)),
            "only_other": test["only_reference"], "only_method": test["only_method"], "p_value": test["p_value"],
            "distinguishable": test["p_value"] < SIGNIFICANCE,
            "kl_diff": statistics.fmean(diffs) if diffs else None, "kl_diff_ci": ci_of(diffs)}


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
