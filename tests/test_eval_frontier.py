"""The frontier's cells from rows: pooling, the paired tests, the best peer at equal or fewer bytes, plots
and the docs table (synthetic rows with known answers)."""

from __future__ import annotations

import pytest

from kvpack.eval.frontier import frontier_cells, frontier_table_markdown, method_table_markdown, plot_frontier

SAMPLES = [(task, length, i) for task in ("niah_single_1", "vt") for length in (4096, 8192) for i in range(3)]


def _rows(label, method, budget, ratio, scores, kls, setting="query-agnostic", decode_ms=10.0, errors=(),
          cpu="CPU A"):
    rows = []
    for (task, length, i), score, kl in zip(SAMPLES, scores, kls):
        row = {"setting": setting, "task": task, "length": length, "sample": i, "label": label, "method": method,
               "budget": budget, "ratio": ratio, "score": score, "kl": kl, "kl_answer": kl, "kl_continuation": kl,
               "top1": 1.0 - kl, "decode_ms": decode_ms, "config": {"version": 1}, "overrides": {}, "cpu": cpu}
        if (task, length, i) in errors:
            row.update(error="ValueError: refused", score=None)
        rows.append(row)
    return rows


def _cell(cells, method, budget=None, setting="query-agnostic"):
    return next(c for c in cells if c["method"] == method and c["budget"] == budget and c["setting"] == setting)


@pytest.fixture
def rows():
    full = _rows("full", "full", None, 1.0, [1.0] * 12, [0.0] * 12, decode_ms=10.0)
    # kvpack's method at 0.28: misses 4 of the 12 FullKV answers, KL 0.1 everywhere, 20% slower.
    mine = _rows("anchor_plus@0.28", "anchor_plus", 0.28, 0.279, [1.0] * 8 + [0.0] * 4, [0.1] * 12, decode_ms=12.0)
    # Two peers: one at fewer bytes (0.283 is within the 2% tolerance of 0.279) that answers all, one at more.
    near = _rows("hf_quantized-quanto4", "hf_quantized", None, 0.283, [1.0] * 12, [0.02] * 12)
    big = _rows("hf_quantized-hqq8", "hf_quantized", None, 0.55, [1.0] * 12, [0.0] * 12)
    weak = _rows("hf_quantized-quanto2", "hf_quantized", None, 0.15, [0.0] * 12, [3.0] * 12)
    refused = _rows("kivi@0.1", "kivi", 0.1, 0.1, [1.0] * 12, [0.5] * 12, errors=SAMPLES[:5])
    return full + mine + near + big + weak + refused


def test_cells_pool_every_task_and_length_and_count_refusals(rows):
    cells = frontier_cells(rows, "tiny")
    mine = _cell(cells, "anchor_plus", 0.28)
    assert mine["n"] == 12 and mine["score"] == pytest.approx(8 / 12) and mine["lengths"] == [4096, 8192]
    assert mine["score_ci"][0] < 8 / 12 < mine["score_ci"][1]  # Wilson on 0/1 scores
    assert mine["kl"] == pytest.approx(0.1) and mine["top1"] == pytest.approx(0.9)
    assert mine["model"] == "tiny" and mine["setting"] == "query-agnostic" and not mine["peer"]
    kivi = _cell(cells, "kivi", 0.1)
    assert kivi["n"] == 7 and kivi["refused"] == 5 and kivi["errors"] == ["ValueError: refused"]


def test_paired_tests_against_fullkv_and_the_best_peer_at_no_more_bytes(rows):
    cells = frontier_cells(rows, "tiny")
    mine = _cell(cells, "anchor_plus", 0.28)
    assert mine["vs_full"]["only_other"] == 4 and mine["vs_full"]["only_method"] == 0
    assert mine["vs_full"]["p_value"] == pytest.approx(0.125) and not mine["vs_full"]["distinguishable"]
    # The best peer at <= 0.279 (+2%): quanto4 at 0.283, not hqq8 at 0.55 (more bytes), not quanto2 (scores 0).
    assert mine["best_peer"] == "hf_quantized-quanto4"
    assert mine["vs_best_peer"]["score_diff"] == pytest.approx(-4 / 12)
    assert mine["vs_best_peer"]["kl_diff"] == pytest.approx(0.08)
    assert mine["decode_vs_full"] == {"median": pytest.approx(1.2), "max": pytest.approx(1.2), "n": 12, "same_run": 0}
    assert _cell(cells, "hf_quantized-quanto4")["best_peer"] is None  # peers are not compared with peers
    assert _cell(cells, "kivi", 0.1)["best_peer"] is None  # no peer holds <= 0.1 of the bytes


def test_a_peer_run_cut_short_does_not_rank_as_the_best_peer(rows):
    """A peer cell on 3 of the 12 samples that answers every one with KL 0 at fewer bytes neither replaces the
    complete quanto4 cell as the best peer nor as the summary's peer; with all 12 samples it does."""
    from kvpack.eval.frontier import best_per_budget

    press = _rows("kvpress-snapkv@0.28", "kvpress-snapkv", 0.28, 0.2, [1.0] * 12, [0.0] * 12)
    for r in press:
        r["method"] = "kvpress"  # a peer family; the cell's name comes from the label: kvpress-snapkv
    few = frontier_cells(rows + press[:3], "tiny")
    assert _cell(few, "kvpress-snapkv", 0.28)["n"] == 3
    assert _cell(few, "anchor_plus", 0.28)["best_peer"] == "hf_quantized-quanto4"
    assert best_per_budget(few, "query-agnostic", 0.28)[2]["method"] == "hf_quantized-quanto4"
    # the only peer at <= bytes is cut short: it is shown, with its sample count
    alone = frontier_cells([r for r in rows if r["method"] != "hf_quantized"] + press[:3], "tiny")
    record = {"tiny": {"cells": alone, "budgets": [0.28]}}
    line = [x for x in frontier_table_markdown(record).splitlines() if "query-agnostic" in x][0]
    assert "`kvpress-snapkv` 0, 1.00" in line and ", 0.200, 3 samples |" in line and line.endswith("| 12 |")
    full = frontier_cells(rows + press, "tiny")
    assert _cell(full, "anchor_plus", 0.28)["best_peer"] == "kvpress-snapkv"
    assert best_per_budget(full, "query-agnostic", 0.28)[2]["method"] == "kvpress-snapkv"


def test_decode_ratio_is_against_the_same_run_else_fullkv_on_the_same_cpu():
    # FullKV's rows ran on CPU A; the method's first 4 samples on CPU A (1.5x), the rest on CPU B (3x as slow
    # as FullKV on A: a figure of two machines, never a ratio)
    full = _rows("full", "full", None, 1.0, [1.0] * 12, [0.0] * 12, decode_ms=10.0)
    mine = _rows("kivi@0.28", "kivi", 0.28, 0.28, [1.0] * 12, [0.1] * 12, decode_ms=15.0)
    for r in mine[4:]:
        r.update(cpu="CPU B", decode_ms=30.0)
    assert _cell(frontier_cells(full + mine, "tiny"), "kivi", 0.28)["decode_vs_full"] == {
        "median": pytest.approx(1.5), "max": pytest.approx(1.5), "n": 4, "same_run": 0}
    for r in mine[:4]:
        r.update(cpu="CPU B")
    assert _cell(frontier_cells(full + mine, "tiny"), "kivi", 0.28)["decode_vs_full"] is None
    # rows that timed FullKV in their own run (on CPU B: 20 ms) are against that, whatever FullKV's rows say:
    # 4 samples at 15 ms, 2 at 30 ms
    for r in mine[:6]:
        r.update(reference_decode_ms=20.0)
    assert _cell(frontier_cells(full + mine, "tiny"), "kivi", 0.28)["decode_vs_full"] == {
        "median": pytest.approx(0.75), "max": pytest.approx(1.5), "n": 6, "same_run": 6}


def test_plots_and_the_docs_tables(rows, tmp_path):
    # a second kvpack method at 0.28 that scores higher but keeps FullKV's distribution worse, and kvtc
    louder = _rows("puzzle_plus@0.28", "puzzle_plus", 0.28, 0.276, [1.0] * 10 + [0.0] * 2, [0.4] * 12)
    kvtc = _rows("kvtc-8x", "kvtc", None, 0.12, [1.0] * 12, [0.01] * 12)
    cells = frontier_cells(rows + louder + kvtc, "tiny")
    written = plot_frontier(cells, tmp_path / "frontier-tiny")
    assert [p.name for p in written] == ["frontier-tiny-query-agnostic.png"]
    assert written[0].stat().st_size > 10_000
    from kvpack.eval.frontier import curve_label

    assert curve_label("kivi", [7], 12) == "kivi (n = 7)" and curve_label("anchor_plus", [12, 12], 12) == "anchor_plus"
    assert curve_label("anchor", [12, 3, 12], 12) == "anchor (n = 3–12)"
    table = frontier_table_markdown({"tiny": {"cells": cells, "budgets": [0.28, 0.1]}})
    lines = table.splitlines()
    assert len(lines) == 2 + 2  # header, rule, one line per budget that has a kvpack cell
    # the best resident method is the lower KL (anchor_plus 0.1), not the higher score (puzzle_plus 0.83);
    # kvtc is the storage column, the peer the lowest-KL one holding <= 0.279 (+2%) of the bytes
    best, storage, peer = lines[2].split(" | ")[3:6]
    assert best.startswith("`anchor_plus` 0.1, 0.67") and storage.startswith("`kvtc-8x` 0.01, 1.00")
    assert peer.startswith("`hf_quantized-quanto4` 0.02, 1.00")
    assert "| 0.1 |" in lines[3] and lines[3].count("none at ≤ bytes") == 2  # kvtc at 0.12 > 0.1; no peer
    rows_table = method_table_markdown({"tiny": {"cells": cells}}, ["anchor_plus", "kvtc"]).splitlines()
    assert len(rows_table) == 2 + 2 and "`anchor_plus` | 0.28 | 0.279 | 0.1" in rows_table[2]
    assert "no (p = 0.12)" in rows_table[2] and "| 1.20x | 12 |" in rows_table[2]
    assert "`kvtc-8x` | – | 0.120" in rows_table[3]
    assert method_table_markdown({"tiny": {"cells": cells}}, ["svd"]) == "(no frontier cells of this method yet)"
    # a budget the method refused on every sample is a line saying so, with its reason (not left out)
    refused = _rows("kivi@0.0625", "kivi", 0.0625, 0.06, [1.0] * 12, [0.5] * 12, errors=SAMPLES)
    kivi = method_table_markdown({"tiny": {"cells": frontier_cells(rows + refused, "tiny")}}, ["kivi"]).splitlines()
    assert len(kivi) == 2 + 2 and "| 0.1 | 0.100 |" in kivi[2] and kivi[2].endswith("| 7 |")
    assert "| 0.0625 | – |" in kivi[3]
    assert kivi[3].endswith("refused on every sample (12), e.g. ValueError: refused | – | – | 0 |")
    # a cell whose rows ran on two CPUs shows no speed ratio (figures of two CPUs never mix)
    mixed = [dict(r, cpu="CPU A" if i % 2 else "CPU B") for i, r in enumerate(rows + kvtc)]
    mixed_cells = frontier_cells(mixed, "tiny")
    assert _cell(mixed_cells, "anchor_plus", 0.28)["cpus"] == ["CPU A", "CPU B"]
    assert "| several CPUs | 12 |" in method_table_markdown({"tiny": {"cells": mixed_cells}}, ["anchor_plus"])


def test_peer_rows_from_their_scripts_join_the_frontier_as_peers(monkeypatch, rows):
    """llama.cpp's rows (one run, a cache that does not depend on the question) count in both settings;
    kvpress's keep their setting and budget; neither brings a speed ratio against kvpack's FullKV."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _peers import frontier_peer_rows

    llama = [{"task": t, "length": n, "sample": i, "method": "llamacpp", "label": "llama.cpp q4_0", "kv": "q4_0",
              "score": 1.0, "ratio": 0.2813, "decode_ms": 3.0, "cpu": "worker CPU"} for t, n, i in SAMPLES]
    press = [{"setting": "query-agnostic", "task": t, "length": n, "sample": i, "method": "kvpress-snapkv",
              "budget": 0.28, "label": "kvpress snapkv@0.28", "score": 0.0, "ratio": 0.28, "decode_ms": 9.0}
             for t, n, i in SAMPLES]
    fields = {"cpu": "driver CPU", "commit": "abc"}  # a row names its worker's CPU, not the driver's
    llama_rows = frontier_peer_rows(llama, "llamacpp", both_settings=True, fields=fields)
    press_rows = frontier_peer_rows(press, "kvpress", both_settings=False, fields=fields)
    assert len(llama_rows) == 2 * len(llama) and len(press_rows) == len(press)
    assert {r["setting"] for r in llama_rows} == {"query-aware", "query-agnostic"}
    assert all(r["label"] == "llamacpp-q4_0" and r["method"] == "llamacpp" and r["cpu"] == "worker CPU"
               and r["commit"] == "abc" and "decode_ms" not in r and r["decode_ms_own_runtime"] == 3.0
               for r in llama_rows)
    assert {r["cpu"] for r in press_rows} == {"unknown"}  # raw rows from before workers named their CPU
    cells = frontier_cells(rows + llama_rows + press_rows, "tiny")
    q4 = _cell(cells, "llamacpp-q4_0")
    assert q4["peer"] and q4["n"] == 12 and q4["decode_vs_full"] is None and q4["kl"] is None
    snap = _cell(cells, "kvpress-snapkv", 0.28)
    assert snap["peer"] and snap["family"] == "kvpress" and snap["score"] == 0.0
    # anchor_plus at 0.279: llama.cpp q4_0 (0.2813, inside the tolerance, scores 1.0) ties quanto4 on score;
    # the tie goes to the lower KL, and llama.cpp has none, so quanto4 stays the best peer.
    assert _cell(cells, "anchor_plus", 0.28)["best_peer"] == "hf_quantized-quanto4"
    aware = _cell(cells, "llamacpp-q4_0", setting="query-aware")  # the same run counted in the other setting
    assert aware["n"] == 12 and aware["vs_full"] is None  # the synthetic rows have no query-aware FullKV


def test_a_method_whose_rows_are_still_coming_does_not_headline_the_summary():
    from kvpack.eval.frontier import best_per_budget

    base = {"setting": "query-agnostic", "budget": 0.28, "peer": False, "family": "pca_quant", "bytes_ratio": 0.27,
            "score": 0.2, "score_ci": (0.1, 0.3)}
    complete = {**base, "method": "pca_quant", "n": 48, "kl": 0.006}
    partial = {**base, "method": "pca_quant-measured", "n": 12, "kl": 0.004}  # lower KL, on a quarter of the samples
    best, _, _ = best_per_budget([complete, partial], "query-agnostic", 0.28)
    assert best["method"] == "pca_quant"
    best, _, _ = best_per_budget([complete, {**partial, "n": 48}], "query-agnostic", 0.28)
    assert best["method"] == "pca_quant-measured"  # once it has caught up, it ranks


def test_a_method_set_by_its_own_ratio_ranks_at_every_target_it_fits_under():
    from kvpack.eval.frontier import best_per_budget

    base = {"setting": "query-agnostic", "peer": False, "score": 0.2, "score_ci": (0.1, 0.3), "n": 48}
    budgeted = {**base, "method": "pca_quant", "family": "pca_quant", "budget": 0.1, "bytes_ratio": 0.094, "kl": 0.2}
    ratio = {**base, "method": "kvtc_resident-16x", "family": "kvtc_resident", "budget": None, "bytes_ratio": 0.089,
             "kl": 0.02}
    full = {**base, "method": "full", "family": "full", "budget": None, "bytes_ratio": 1.0, "kl": 0.0}
    quanto = {**base, "method": "hf_quantized-quanto2", "family": "hf_quantized", "budget": None, "peer": True,
              "bytes_ratio": 0.08, "kl": 2.0}
    cells = [budgeted, ratio, full, quanto]
    assert best_per_budget(cells, "query-agnostic", 0.1)[0]["method"] == "kvtc_resident-16x"  # 0.089 <= 0.1
    assert best_per_budget(cells, "query-agnostic", 0.0625)[0] is None  # 0.089 > 0.0625; FullKV and peers never
    best, _, peer = best_per_budget([budgeted, {**ratio, "n": 12}, quanto], "query-agnostic", 0.1)
    assert best["method"] == "pca_quant" and peer["method"] == "hf_quantized-quanto2"  # still filling: not ranked


def test_every_kvtc_resident_row_names_a_calibration_the_frontier_makes(monkeypatch):
    """The runner makes each twin calibration a kvtc_resident row names, with the settings its name promises
    (a ratio the frontier's kvtc calibration lacks; a key basis per layer)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from frontier import KVTC_RATIOS, frontier_specs, resident_calibrations

    made = resident_calibrations("cal")
    rows = [s for s in frontier_specs([0.28], "cal") if s.method == "kvtc_resident"]
    assert rows and all(s.config["calibration"] in made for s in rows)
    for s in rows:
        settings = made[s.config["calibration"]]
        if settings is None:  # the frontier's own calibration: kvtc's ratios
            assert s.config["calibration"] == "cal" and s.config["ratio"] in KVTC_RATIOS
            continue
        assert s.config["ratio"] in settings["ratios"]
        assert (settings.get("key_layer_group") == 1) == s.name.endswith("-keys-per-layer")


def test_a_cell_meets_the_peers_at_its_budget_in_both_settings():
    """A cell's measured bytes under its target (0.2756 at 0.28) still meet a peer at 0.2812 (within 2% of the
    target, not of 0.2756); a method set by its own ratio, with no target, is held to its measured bytes."""
    from kvpack.eval.frontier import best_per_budget, bytes_limit

    assert bytes_limit(0.2756, 0.28) == pytest.approx(0.2856) and bytes_limit(0.2756, None) < 0.28125
    full = _rows("full", "full", None, 1.0, [1.0] * 12, [0.0] * 12)
    quanto = _rows("hf_quantized-quanto4", "hf_quantized", None, 0.28125, [1.0] * 6 + [0.0] * 6, [0.3] * 12)
    weak = _rows("hf_quantized-quanto2", "hf_quantized", None, 0.156, [0.0] * 12, [3.5] * 12)
    under = _rows("pca_quant-layers@0.28", "pca_quant", 0.28, 0.2756, [1.0] * 12, [0.002] * 12)
    ratio = _rows("kvtc_resident-8x", "kvtc_resident", None, 0.2756, [1.0] * 12, [0.004] * 12)
    cells = frontier_cells(full + quanto + weak + under + ratio, "tiny")
    assert _cell(cells, "pca_quant-layers", 0.28)["best_peer"] == "hf_quantized-quanto4"
    assert _cell(cells, "kvtc_resident-8x")["best_peer"] == "hf_quantized-quanto2"  # 0.28125 > 0.2756 * 1.02
    best, _, peer = best_per_budget(cells, "query-agnostic", 0.28)
    assert best["method"] == "pca_quant-layers" and peer["method"] == "hf_quantized-quanto4"


def test_every_peer_meets_the_best_kvpack_cell_at_no_more_bytes(rows):
    """The reverse comparison: a peer against kvpack's resident cell with the lowest KL at most at its bytes
    (never FullKV, another peer or a storage codec), paired, with who wins on answers and on KL."""
    from kvpack.eval.frontier import peers_vs_kvpack_markdown

    kvtc = _rows("kvtc-8x", "kvtc", None, 0.12, [1.0] * 12, [0.001] * 12)  # storage: not a resident rival
    cells = frontier_cells(rows + kvtc, "tiny")
    near = _cell(cells, "hf_quantized-quanto4")  # 0.283: anchor_plus@0.28 (12 samples) beats kivi@0.1 (7)
    assert (near["best_kvpack"], near["best_kvpack_budget"]) == ("anchor_plus", 0.28)
    assert near["vs_best_kvpack"]["score_diff"] == pytest.approx(4 / 12)
    assert near["vs_best_kvpack"]["kl_diff"] == pytest.approx(-0.08) and not near["vs_best_kvpack"]["distinguishable"]
    weak = _cell(cells, "hf_quantized-quanto2")  # 0.15: only kivi@0.1 fits; it answers 7 that quanto2 misses
    assert weak["best_kvpack"] == "kivi" and weak["vs_best_kvpack"]["only_other"] == 7
    assert weak["vs_best_kvpack"]["p_value"] == pytest.approx(2 / 128)
    assert "best_kvpack" not in _cell(cells, "anchor_plus", 0.28)  # kvpack's own cells have vs_best_peer
    table = peers_vs_kvpack_markdown({"tiny": {"cells": cells}})
    line = next(t for t in table.splitlines() if "`hf_quantized-quanto4`" in t)
    assert "`anchor_plus@0.28`" in line and line.endswith("| 12 | lower KL: peer |")
    line = next(t for t in table.splitlines() if "`hf_quantized-quanto2`" in t)
    assert "`kivi@0.1`" in line and line.endswith("more answers: kvpack; lower KL: kvpack |")
    assert peers_vs_kvpack_markdown({"tiny": {"cells": [c for c in cells if not c["peer"]]}}) == "(no peer cells yet)"


def test_status_counts_each_cells_samples_refusals_runs_to_do_and_peers(monkeypatch, tmp_path):
    """``frontier.py --status``: per plan spec and setting the samples answered (and refused) of the target, the
    runs still to do over how many units, and the peers' samples — from the rows alone."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import frontier

    from kvpack.eval.runner import EvalPlan, MethodSpec

    monkeypatch.setattr(frontier, "rows_dir", lambda model: tmp_path)
    units = [(s, "vt", 4096, i) for s in ("query-agnostic", "query-aware") for i in range(2)]
    specs = [MethodSpec("full"), MethodSpec("kivi", 0.1)]
    plan = EvalPlan(tasks=["vt"], lengths=[4096], samples=2, specs=specs, settings=["query-agnostic", "query-aware"])

    def row(unit, spec, **extra):
        return {"setting": unit[0], "task": unit[1], "length": unit[2], "sample": unit[3], "method": spec.method,
                "budget": spec.budget, "overrides": spec.config, "label": spec.label, **extra}

    (tmp_path / "rows").mkdir()
    lines = [row(u, specs[0]) for u in units] + [row(units[2], specs[1]), row(units[3], specs[1], error="refused")]
    lines.append(row(("query-aware", "vt", 4096, 7), specs[1]))  # a sample outside the plan: not counted
    (tmp_path / "rows" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    peer = {"label": "llamacpp-f16", "setting": "query-aware"}
    (tmp_path / "peer-llamacpp.jsonl").write_text(json.dumps(peer) + "\n")
    report = frontier.status_report("tiny", plan).splitlines()
    assert report[0] == "tiny: 2 method specs x 2 settings, 2 samples a cell"
    assert report[3].split() == ["full", "2/2", "2/2"]
    assert report[4].split() == ["kivi@0.1", "0/2", "1/2", "(1", "refused)"]
    assert "to do: 2 runs over 2 of 4 (setting, sample) units" in report[6]
    assert report[-1].split() == ["llamacpp-f16", "query-aware", "1/2"]


def test_coverage_lists_the_planned_cells_below_the_target_in_either_setting():
    """``frontier-coverage``: a cell short in one setting is listed with both settings' counts (a refusal counts
    towards the target); a planned cell with no rows is listed with 0; complete cells and peers are not."""
    from kvpack.eval.frontier import coverage_markdown

    def cell(method, budget, setting, n, refused=0):
        return {"method": method, "budget": budget, "setting": setting, "n": n, "refused": refused}

    cells = [cell("full", None, s, 2) for s in ("query-aware", "query-agnostic")]
    cells += [cell("kivi", 0.1, "query-aware", 0, 2), cell("kivi", 0.1, "query-agnostic", 1)]
    cells += [cell("llamacpp-q4_0", None, s, 2) for s in ("query-aware", "query-agnostic")]
    cells += [cell("svd", 0.28, s, 2) for s in ("query-aware", "query-agnostic")]  # a cell outside the plan
    cells += [cell("llamacpp-q8_0", None, "query-aware", 1)]
    plan = {"target": 2, "settings": ["query-aware", "query-agnostic"], "cells": ["full", "kivi@0.1", "svd@0.1"],
            "peers": ["llamacpp-q4_0", "llamacpp-q8_0", "kvpress-snapkv@0.1"]}
    text = coverage_markdown({"tiny": {"planned": plan, "cells": cells}}).splitlines()
    assert text[0] == "tiny: 2 of 6 planned cells hold all 2 samples in both settings; 4 hold fewer."
    assert text[2] == ("| model | kind | method | samples (query-aware / query-agnostic) where fewer than the target, "
                       "by budget |")
    assert text[4:] == ["| tiny | kvpack | `kivi` | 0.1: 0 (+2 refused) / 1 |",
                        "| tiny | kvpack | `svd` | 0.1: 0 / 0 |",
                        "| tiny | peer | `llamacpp-q8_0` | 1 / 0 |",
                        "| tiny | peer | `kvpress-snapkv` | 0.1: 0 / 0 |"]
    assert coverage_markdown({"old": {"cells": cells}}) == "old: no plan recorded in its results file."


def test_planned_cells_name_every_kvpack_spec_and_peer_configuration(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import frontier

    plan = {"budgets": [0.28, 0.15], "samples_per_task_and_length": 3, "tasks": list(frontier.TASKS),
            "lengths": [4096, 8192], "settings": ["query-aware", "query-agnostic"]}
    planned = frontier.planned_cells(plan)
    assert planned["target"] == 48 and planned["settings"] == plan["settings"]
    assert planned["cells"] == [s.label for s in frontier.frontier_specs([0.28, 0.15], "c", "p")]
    assert {"full", "h2o@0.15", "svd@0.28", "pca_quant-salient@0.28", "puzzle-int4-paper", "kvtc-16x",
            "kvtc_resident-32x", "kvtc_resident-8x-keys-per-layer"} <= set(planned["cells"])
    # FullKV; every budgeted method and the 4 budgeted pca_quant presets (layers, salient, fast, head) at 2 budgets;
    # puzzle-int4-paper, 3 hf_quantized, 4 TurboQuant + fp8 (lmcache_quant), 3 kvtc, 3 + 2 kvtc_resident
    assert len(planned["cells"]) == 1 + 2 * (len(frontier.BUDGETED) + 4) + 1 + 3 + 5 + 3 + 3 + 2
    assert planned["peers"][:3] == ["llamacpp-f16", "llamacpp-q8_0", "llamacpp-q4_0"]
    assert len(planned["peers"]) == 3 + 4 * 2 and "kvpress-kvzip@0.15" in planned["peers"]
