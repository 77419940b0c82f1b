"""Where kvpack keeps files of its own (converted models, the default prefix store)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "KVPACK_CACHE_DIR"


def cache_dir() -> Path:
    """The user cache directory kvpack writes converted models (and other derived files) to:
    ``$KVPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpack``, else ``~/.cache/kvpack``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpack"
