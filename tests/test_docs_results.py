"""The figures in the docs are the committed results': the frontier table at the top of docs/eval.md is
what ``python benchmarks/frontier.py --render`` makes of ``benchmarks/results/frontier-*.json``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_frontier_table_in_the_docs_is_rendered_from_the_committed_results(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier

    text = (ROOT / "docs" / "eval.md").read_text()
    assert frontier.BEGIN in text and frontier.END in text, "docs/eval.md lost the frontier table's markers"
    block = text.split(frontier.BEGIN, 1)[1].split(frontier.END, 1)[0]
    expected = "\n" + frontier.rendered_block(frontier.committed_records())
    assert block == expected, "docs/eval.md's frontier table is stale: run `python benchmarks/frontier.py --render`"
