"""The harness on the packaged SmolLM2 at 4K tokens: FullKV must clear a recorded floor on NIAH tasks.

Floor: FullKV on SmolLM2-135M-Instruct (fp32), 4096-token
prompts, 2 samples per task, seed 0, query-aware, scored niah_single_1 1.00, niah_single_2 0.50,
niah_multikey_1 0.50. A broken pipeline (wrong cache, wrong positions, wrong prompt assembly)
scores 0 on all of them; the floor below leaves room for numerical differences across machines.
"""

from __future__ import annotations

import pytest

from kvpack.eval.runner import EvalPlan, method_specs, run_eval

pytestmark = pytest.mark.model

FLOOR_SINGLE_1 = 1.0
FLOOR_AVERAGE = 0.5


def test_fullkv_clears_the_niah_floor_at_4k(smollm2, tmp_path):
    model, tok = smollm2
    plan = EvalPlan(tasks=["niah_single_1", "niah_single_2", "niah_multikey_1"], lengths=[4096], samples=2,
                    specs=method_specs(["full"], []), fidelity=False)
    rows = run_eval(model, tok, plan, tmp_path, progress=False)
    assert len(rows) == 6 and all(r.get("error") is None for r in rows)
    assert all(abs(r["prompt_tokens"] - 4096) <= 0.02 * 4096 for r in rows)
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r["score"])
    assert sum(by_task["niah_single_1"]) / 2 >= FLOOR_SINGLE_1, rows
    assert sum(sum(v) for v in by_task.values()) / 6 >= FLOOR_AVERAGE, by_task


def test_cli_eval_writes_outputs(tmp_path, capsys):
    from kvpack.cli import main

    out = tmp_path / "ev"
    assert main(["eval", "--methods", "full,streaming", "--budgets", "0.5", "--tasks", "niah_single_1", "--lengths",
                 "512", "--samples", "1", "--setting", "query-agnostic", "--no-fidelity", "--quiet", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| streaming@0.5 |" in printed and "query-agnostic" in printed
    for name in ("results.jsonl", "summary.md", "summary.json", "score_vs_ratio.png", "heatmap_query-agnostic.png"):
        assert (out / name).is_file()
    assert main(["eval", "--tasks", "bogus", "--out", str(out)]) == 2
    assert "unknown task" in capsys.readouterr().err
