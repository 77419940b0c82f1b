"""The figures in the README and docs are the committed results': every generated block (``<!-- render: NAME
-->`` ... ``<!-- /render -->``) is what ``python benchmarks/render.py`` makes of ``benchmarks/results/*.json``
and the method registry, and a page shows no frontier table that is not such a block."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def render(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import render

    return render


def test_every_generated_block_is_rendered_from_the_committed_results(render):
    assert render.stale_blocks() == [], "stale generated blocks: run `python benchmarks/render.py`"


def test_the_pages_hold_the_frontier_summary_and_each_method_page_its_rows_and_options(render):
    names = {p.relative_to(ROOT).as_posix(): [m.group("name") for m in render.BLOCK.finditer(p.read_text())]
             for p in render.pages()}
    assert "frontier-summary" in names["README.md"] and "frontier-summary" in names["docs/eval.md"]
    for page, method in [("docs/methods/puzzlekv.md", "puzzle"), ("docs/methods/anchorkv.md", "anchor"),
                         ("docs/methods/kvtc.md", "kvtc")]:
        assert f"options:{method}" in names[page], f"{page} lost its options table"
        assert any(n.startswith("frontier-rows:") and method in n.split(":")[1].split(",") for n in names[page])


def test_rendering_replaces_only_the_blocks_and_an_unknown_block_is_named(render):
    text = "intro\n<!-- render: options:full -->\nstale text\n<!-- /render -->\noutro\n"
    out = render.render_text(text, {})
    assert out.startswith("intro\n<!-- render: options:full -->\n| option |")
    assert out.endswith("<!-- /render -->\noutro\n")
    assert "stale text" not in out
    with pytest.raises(ValueError, match="unknown generated block 'nonsense'"):
        render.render_text("<!-- render: nonsense -->\n<!-- /render -->", {})
