"""``kvpack`` command line, one module per command group.

``eval`` is kvpack's main job (``evaluation.py``: methods compared at matched bytes on RULER-style
tasks); ``generate``, ``methods`` and ``demo`` (``generation.py``: one measured generation, every
method's fields, a one-minute needle demo); kvtc's storage flow (``storage.py``): ``calibrate``
(once per model), ``compress`` (prompt -> blob file or prefix-store entry), ``decompress`` (blob ->
dense cache tensors in safetensors) and ``continue`` (blob or store entry + new text -> generation).
"""

from __future__ import annotations

import argparse
import os
import sys

from safetensors import SafetensorError

from . import evaluation, generation, storage

DESCRIPTION = """kvpack: compressed KV caches for transformer language models, measured.

  eval        kvpack's main job: methods compared at matched bytes on RULER-style tasks
  generate    one measured generation with any method (methods: every method's fields)
  demo        one needle: FullKV, kvpack's default and the faithful PuzzleKV, in about a minute
  calibrate, compress, decompress, continue
              kvtc's storage flow: calibrate once per model, compress a prompt's cache to a blob
              or the prefix store, restore it and continue generating
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpack", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="command", required=True)
    evaluation.add_parsers(sub)
    generation.add_parsers(sub)
    storage.add_parsers(sub)
    return parser


# Errors kvpack anticipates (bad input, a file that cannot be read or written, a full disk): one
# line naming the problem. Anything else is a bug: one line too, its traceback only with --debug.
ANTICIPATED = (ValueError, TypeError, NotImplementedError, OSError, SafetensorError)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        print("kvpack: error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ANTICIPATED as exc:
        if args.debug:
            raise
        print(f"kvpack: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug: say so in one line unless asked for the traceback
        if args.debug:
            raise
        print(f"kvpack: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


__all__ = ["build_parser", "main"]
