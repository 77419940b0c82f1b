"""Every repository path that a docstring, a comment or a doc names exists, and none names a file
outside the repository (a reader of the repository cannot open it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("kvpack", "docs", "tests", "benchmarks", "examples", "scripts", ".ci")
# A path: optional ../ steps, a top-level folder of the repository (or the project's shared folder
# beside it), then path characters; it ends before ``:line`` or punctuation. Globs and placeholders
# (``*``, ``<name>``) are patterns, not paths.
FOLDERS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"(?<![\w./-])((?:\.\./)*(?:{FOLDERS}|shared)/[\w./*<>-]*[\w*>])")
BARE_MARKDOWN = re.compile(r"(?<![\w./-])([A-Z][\w-]*\.md)\b")  # README.md, DESIGN.md, ...


def _texts() -> list[tuple[str, str]]:
    out = []
    for folder in ("kvpack", "benchmarks", "examples", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((str(path.relative_to(ROOT)), doc))
            comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
            out.append((str(path.relative_to(ROOT)), "\n".join(comments)))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        out.append((str(path.relative_to(ROOT)), path.read_text()))
    return out


def named_paths(text: str) -> list[str]:
    return [m.rstrip(".,:;)") for m in PATH.findall(text)]


def test_the_path_pattern_finds_what_a_reader_would_follow():
    text = "see kvpack/resident/puzzle.py:300-318, docs/kvtc.md and `../shared/notes/kvtc.md`; tests/*.py"
    assert named_paths(text) == ["kvpack/resident/puzzle.py", "docs/kvtc.md", "../shared/notes/kvtc.md", "tests/*.py"]


def test_every_named_repository_path_exists_and_none_is_outside():
    missing, outside = [], []
    for where, text in _texts():
        if where == "tests/test_docs_paths.py":
            continue  # this file names examples on purpose
        for path in named_paths(text):
            if path.startswith(("../", "shared/")):
                outside.append(f"{where}: {path}")
            elif "*" not in path and "<" not in path and not (ROOT / path).exists():
                missing.append(f"{where}: {path}")
        for name in BARE_MARKDOWN.findall(text):
            if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists():
                missing.append(f"{where}: {name}")
    assert not outside, f"files outside the repository: {outside}"
    assert not missing, f"named but not in the repository: {missing}"
