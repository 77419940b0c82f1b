"""The frontier's cells from rows: pooling, the paired tests, the best peer at equal or fewer bytes, plots
and the docs table (synthetic rows with known answers)."""

from __future__ import annotations

import pytest

from kvpack.eval.frontier import frontier_cells, frontier_table_markdown, plot_frontier

SAMPLES = [(task, length, i) for task in ("niah_single_1", "vt") for length in (4096, 8192) for i in range(3)]


def _rows(label, method, budget, ratio, scores, kls, setting="query-agnostic", decode_ms=10.0, errors=()):
    rows = []
    for (task, length, i), score, kl in zip(SAMPLES, scores, kls):
        row = {"setting": setting, "task": task, "length": length, "sample": i, "label": label, "method": method,
               "budget": budget, "ratio": ratio, "score": score, "kl": kl, "kl_answer": kl, "kl_continuation": kl,
               "top1": 1.0 - kl, "decode_ms": decode_ms, "config": {"version": 1}, "overrides": {}}
        if (task, length, i) in errors:
            row.update(error="ValueError: refused", score=None)
        rows.append(row)
    return rows


def _cell(cells, method, budget=None, setting="query_agnostic"):
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
    assert mine["model"] == "tiny" and mine["setting"] == "query_agnostic" and not mine["peer"]
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
    assert mine["decode_vs_full"] == {"median": pytest.approx(1.2), "max": pytest.approx(1.2), "n": 12}
    assert _cell(cells, "hf_quantized-quanto4")["best_peer"] is None  # peers are not compared with peers
    assert _cell(cells, "kivi", 0.1)["best_peer"] is None  # no peer holds <= 0.1 of the bytes


def test_plots_and_the_docs_table(rows, tmp_path):
    cells = frontier_cells(rows, "tiny")
    written = plot_frontier(cells, tmp_path / "frontier-tiny")
    assert [p.name for p in written] == ["frontier-tiny-query_agnostic.png"]
    assert written[0].stat().st_size > 10_000
    table = frontier_table_markdown({"tiny": {"cells": cells, "budgets": [0.28, 0.1]}})
    lines = table.splitlines()
    assert len(lines) == 2 + 2  # header, rule, one line per budget that has a kvpack cell
    assert "`anchor_plus` 0.67" in lines[2] and "`hf_quantized-quanto4` 1.00" in lines[2]
    assert "| 0.1 |" in lines[3] and "none at ≤ bytes" in lines[3]
