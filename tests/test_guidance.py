"""No hand-written page recommends a method the frontier's data do not rank first.

The README's and the docs' "which method when" is a generated block (``frontier-guidance``); this test reads
everything *around* the generated blocks. A sentence recommends when it uses a recommending word (use, choose,
pick, prefer, compare, recommend, best, win, should) or stands in a guidance section (a heading or bold lead-in
saying "which method", "which one", "when to use" or "recommend"). Tables (method listings) and code are not
recommendations. Every method or preset such a sentence names must rank first somewhere in the packaged ranking
(resident or storage, any model, setting and budget), or be the family of one that does, or FullKV.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import kvpack
from kvpack.methods import get_method
from kvpack.methods.recommend import CHOICES_FILE

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- render: [^ ]+ -->\n.*?<!-- /render -->", re.DOTALL)
FENCE = re.compile(r"```.*?```", re.DOTALL)
RECOMMENDING = re.compile(r"\b(recommend\w*|use|choose|pick|prefer|compare|best|wins?|should)\b", re.I)
GUIDANCE = re.compile(r"which (method|one)|when to use|recommend", re.I)
SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z*`(-])")


def ranked_first() -> set[str]:
    """Every method or preset the packaged ranking puts first (resident or storage), and their methods."""
    choices = json.loads(CHOICES_FILE.read_text())
    firsts = set()
    for model in choices["models"].values():
        for entries in model["settings"].values():
            for entry in entries:
                firsts.add(entry["ranked"][0]["method"])
                if entry["storage"]:
                    firsts.add(entry["storage"]["method"])
    return firsts | {get_method(name).name for name in firsts} | {"full"}


def recommendations_not_ranked_first(text: str, allowed: set[str]) -> list[tuple[str, list[str]]]:
    """``(sentence, names)`` for every hand-written sentence of ``text`` that recommends methods not in
    ``allowed`` (the module doc's rule)."""
    names = set(kvpack.available_methods()) | set(kvpack.available_presets())
    text = FENCE.sub("", BLOCK.sub("", text))
    found, region = [], False
    for para in re.split(r"\n\s*\n", text):
        stripped = para.lstrip()
        if stripped.startswith("#"):
            region = bool(GUIDANCE.search(stripped.splitlines()[0]))
        elif stripped.startswith("**") and GUIDANCE.search(stripped.split("**")[1]):
            region = True
        if stripped.startswith("|"):
            continue
        for sentence in SENTENCE_END.split(para.replace("\n", " ")):
            if not (region or RECOMMENDING.search(sentence)):
                continue
            bad = sorted({n for n in re.findall(r"`([^`]+)`", sentence) if n in names} - allowed)
            if bad:
                found.append((sentence.strip(), bad))
    return found


def test_no_page_recommends_a_method_the_frontier_ranks_below_another():
    allowed = ranked_first()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [(p.relative_to(ROOT), s, bad) for p in pages
             for s, bad in recommendations_not_ranked_first(p.read_text(), allowed)]
    assert not found, "\n".join(f"{p}: {bad} in: {s[:200]}" for p, s, bad in found)


def test_the_check_catches_a_hand_written_recommendation():
    """The README's guidance before it was generated recommended methods that rank first nowhere."""
    old = ("## Methods, and which one when\n\n| method | kind |\n|---|---|\n| `anchor_plus` | resident |\n\n"
           "- **A cache reused for questions it was not built for**: at about 0.28 of the bytes compare "
           "`anchor_plus` with `hf_quantized`.\n- **The question inside the compressed prompt**: `anchor_plus`.\n\n"
           "## Documentation\n\nThe baselines `kivi` and `snapkv` have their own page.\n")
    found = recommendations_not_ranked_first(old, ranked_first())
    assert [bad for _, bad in found] == [["anchor_plus", "hf_quantized"], ["anchor_plus"]]
    # a generated block is the data's, not a recommendation typed by hand
    assert not recommendations_not_ranked_first("Use:\n<!-- render: x -->\nuse `anchor_plus`\n<!-- /render -->\n",
                                                ranked_first())
    assert recommendations_not_ranked_first("We recommend `puzzle_plus` here.", ranked_first())
