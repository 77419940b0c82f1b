"""The frontier's tables as Markdown (the README's and the docs' generated blocks): the summary, each method's
cells, the peers against kvpack, the coverage of the plan, which method when."""

from __future__ import annotations

from collections.abc import Iterable

from ...presets import preset
from ..runner import SETTINGS
from .families import REFERENCE, is_peer, label
from .ranking import best_per_budget


def _fmt_ci(value, ci, spec=".2f") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}} ({ci[0]:{spec}}–{ci[1]:{spec}})" if ci else format(value, spec)


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


def frontier_table_markdown(records: dict[str, dict]) -> str:
    """A short table from frontier results files (``{model: file contents}``): per model, setting and
    budget, the best resident kvpack method, the best storage codec and the best peer at equal or fewer
    bytes (:func:`best_per_budget`), each with its mean KL, score (95% interval) and measured bytes (and its
    samples, where fewer than the kvpack method's)."""
    lines = ["| model | setting | budget | best resident kvpack method: KL, score, bytes | storage (kvtc) at ≤ "
             "bytes | best peer at ≤ bytes | FullKV score | samples |", "|---|---|---|---|---|---|---|---|"]
    for model, data in records.items():
        cells = data["cells"]
        for setting in SETTINGS:
            full = next((c for c in cells if c["setting"] == setting and c["family"] == REFERENCE), None)
            for budget in data["budgets"]:
                best, storage, peer = best_per_budget(cells, setting, budget)
                if best is None:
                    continue
                lines.append(f"| {model} | {setting} | {budget:g} | {_cell_text(best)} | "
                             f"{_cell_text(storage, samples=best['n'])} | {_cell_text(peer, samples=best['n'])} | "
                             f"{_fmt_ci(full['score'], full['score_ci']) if full else '–'} | {best['n']} |")
    return "\n".join(lines)


def _verdict(vs: dict) -> str:
    """Who wins a paired comparison of a peer with kvpack (``vs``: :func:`paired_test` of the peer against the
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
            head = f"| {model} | {c['setting']} | `{label(c)}` | {_figures_text(c)} | "
            if mine is None or vs is None:
                lines.append(head + "none at ≤ bytes | – | – | – | – |")
                continue
            kl = "–" if vs["kl_diff"] is None else _fmt_ci(vs["kl_diff"], vs["kl_diff_ci"], ".3g")
            lines.append(head + f"`{label(mine)}` {_figures_text(mine)} | {vs['score_diff']:+.2f} "
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
                    lines.append(f"| {model} | {c['setting']} | `{c['method']}` | "
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
            lines.append(f"| {model} | {c['setting']} | `{c['method']}` | {_budget_text(c)} | "
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
        target, settings = plan["target"], list(plan["settings"])
        have = {(label(c), c["setting"]): (c["n"], c["refused"]) for c in data["cells"]}
        short: dict[tuple[str, str], list[str]] = {}  # (kind, method) -> its short budgets' text, in plan order
        for kind, labels in (("kvpack", plan["cells"]), ("peer", plan["peers"])):
            for planned in labels:
                counts = [have.get((planned, s), (0, 0)) for s in settings]
                if all(n + refused >= target for n, refused in counts):
                    continue
                name, _, budget = planned.partition("@")
                text = " / ".join(f"{n}" + (f" (+{refused} refused)" if refused else "") for n, refused in counts)
                spec = preset(name)  # a peer run inside kvpack's harness (hf_quantized, lmcache_quant) is a peer
                who = "peer" if kind == "peer" or is_peer(spec.method if spec else name) else "kvpack"
                short.setdefault((who, name), []).append(f"{budget}: {text}" if budget else text)
        n_short, total = sum(len(v) for v in short.values()), len(plan["cells"]) + len(plan["peers"])
        lines.append(f"{model}: {total - n_short} of {total} planned cells hold all {target} samples in both "
                     f"settings; {n_short} hold fewer.")
        if short:
            lines += ["", f"| model | kind | method | samples ({' / '.join(settings)})"
                      " where fewer than the target, by budget |", "|---|---|---|---|"]
            lines += [f"| {model} | {kind} | `{name}` | {'; '.join(parts)} |" for (kind, name), parts in short.items()]
        lines.append("")
    return "\n".join(lines).rstrip() if lines else "(no frontier results yet)"


def guidance_markdown(choices: dict) -> str:
    """Which method when, from :func:`frontier_choices`: per model, setting and budget, the method to use with its
    KL and score, the runner-up, and the best peer at no more bytes."""
    lines = ["| model | setting | budget | use | its KL, score | runner-up: KL, score | best peer at ≤ bytes: KL, "
             "score |", "|---|---|---|---|---|---|---|"]

    def figures(c: dict, samples: int | None = None) -> str:
        """KL, score (interval); the sample count too where fewer than ``samples`` (a peer cut short)."""
        kl = "–" if c["kl"] is None else f"{c['kl']:.3g}"
        fewer = f", {c['n']} samples" if samples is not None and c["n"] < samples else ""
        return f"{kl}, {_fmt_ci(c['score'], c['score_ci'])}{fewer}"

    for model, data in choices["models"].items():
        for setting, budgets in data["settings"].items():
            for b in budgets:
                best, rest = b["ranked"][0], b["ranked"][1:]
                runner = f"`{rest[0]['method']}` {figures(rest[0])}" if rest else "–"
                peer = f"`{b['peer']['method']}` {figures(b['peer'], best['n'])}" if b["peer"] else "none at ≤ bytes"
                lines.append(f"| {model} | {setting} | {b['budget']:g} | `{best['method']}` | "
                             f"{figures(best)} | {runner} | {peer} |")
    return "\n".join(lines)
