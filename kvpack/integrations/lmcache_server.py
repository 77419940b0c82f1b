"""``python -m kvpack.integrations.lmcache_server ARGS``: LMCache's server (``lmcache server ARGS``) with
the ``"kvtc"`` serde registered first, and LMCache's usage telemetry off."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # before LMCache is imported

from lmcache.cli.main import main as lmcache_main  # noqa: E402

from . import lmcache_serde  # noqa: E402  (registers the serde before the server starts)


def main(argv: list[str] | None = None) -> int:
    lmcache_serde.register()
    return lmcache_main(["server", *(sys.argv[1:] if argv is None else argv)]) or 0


if __name__ == "__main__":
    sys.exit(main())
