"""Calibration text that every fresh machine has: the Python standard library's own documentation.

kvtc calibrates its PCA on KV caches of real text. With no network, the text comes from the
interpreter itself: the ``pydoc`` topic pages (``pydoc_data.topics``: the language reference,
about 465 K characters of English prose with code) followed by the docstrings of standard-library
modules, in a fixed order, so that a calibration is reproducible. The paper calibrates on
FineWeb + OpenR1Math; this corpus is narrower (technical English and Python), which the paper
finds keeps in-context retrieval while costing some accuracy on other domains.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

_DOC_MODULES_LIMIT = 400


def _module_docstrings() -> list[str]:
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names
                   and not m.name.startswith("_") and m.name not in ("antigravity", "this", "idlelib", "tkinter",
                                                                   "turtle", "turtledemo"))
    docs = []
    for name in names[:_DOC_MODULES_LIMIT]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform-specific modules may not import; skip them
            continue
        doc = getattr(module, "__doc__", None)
        if doc and len(doc) > 200:
            docs.append(doc.strip())
    return docs


def calibration_documents() -> list[str]:
    """Documents in a fixed order: every pydoc topic page, then module docstrings."""
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)] + _module_docstrings()


def corpus_token_ids(tokenizer, n_tokens: int, documents: list[str] | None = None) -> list[int]:
    """The first ``n_tokens`` token ids of ``documents`` (default :func:`calibration_documents`), each
    followed by a blank line, fewer where the corpus is shorter."""
    ids: list[int] = []
    for doc in documents if documents is not None else calibration_documents():
        ids.extend(tokenizer(doc + "\n\n", add_special_tokens=False).input_ids)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]
