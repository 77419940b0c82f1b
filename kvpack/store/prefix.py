"""``PrefixStore``: compressed caches on local disk, keyed by model + calibration + token prefix.

Layout: ``ROOT/<model hash>/<calibration id>/<n tokens>-<sha256 of the tokens>.kvtc``. A lookup for a
token sequence tries every stored length that could be a prefix of it, longest first, so a second
turn that extends a stored first turn finds it and only its new tokens need a prefill.

Safety:

* writes go to a temporary file in the same directory, are flushed and ``fsync``-ed, then
  renamed over the entry (``os.replace`` is atomic): a crash leaves the previous entry intact and
  readers never see a torn file;
* concurrent readers only ever open complete files;
* every entry read is verified (checksum, magic, version, and that its header names the requested
  model, calibration and tokens); a corrupted entry raises :class:`CorruptEntryError` from
  :meth:`get` and is skipped with a warning by :meth:`longest_prefix` — it is never returned.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..paths import cache_dir
from .atomic import atomic_write_bytes
from .format import Blob, BlobError, tokens_digest

SUFFIX = ".kvtc"


class CorruptEntryError(BlobError):
    """A stored entry exists but fails verification."""


def default_store_root() -> Path:
    return cache_dir() / "prefix-store"


def _digest(token_ids: list[int]) -> str:
    return tokens_digest(token_ids)


class PrefixStore:
    """A directory of kvtc blobs addressed by (model hash, calibration id, token prefix).

    Args:
        root: directory (created on first write); default ``<kvpack cache dir>/prefix-store``.
    """

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_store_root()

    def _dir(self, model_hash: str, calibration_id: str) -> Path:
        for name, value in (("model hash", model_hash), ("calibration id", calibration_id)):
            if not value or not all(c.isalnum() for c in value):
                raise ValueError(f"{name} must be a non-empty alphanumeric string, got {value!r}")
        return self.root / model_hash / calibration_id

    def path(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> Path:
        return self._dir(model_hash, calibration_id) / f"{len(token_ids)}-{_digest(token_ids)}{SUFFIX}"

    def put(self, blob: bytes, token_ids: list[int]) -> Path:
        """Store a kvtc blob under the model, calibration and tokens its header records.

        Raises:
            BlobError: the blob does not verify or its header disagrees with ``token_ids``.
        """
        if not token_ids:
            raise ValueError("cannot store an empty prefix")
        parsed = Blob(blob)
        meta = parsed.meta
        if meta.get("tokens") != len(token_ids) or meta.get("tokens_sha256") != _digest(token_ids):
            raise BlobError("the blob's header does not describe these token ids")
        return atomic_write_bytes(self.path(meta["model"]["hash"], meta["calibration_id"], token_ids), blob)

    def get(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> bytes | None:
        """The blob stored for exactly ``token_ids`` (None if there is none).

        Raises:
            CorruptEntryError: the entry exists but is corrupted or is not what its name says.
        """
        path = self.path(model_hash, calibration_id, token_ids)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            meta = Blob(data).meta
        except BlobError as exc:
            raise CorruptEntryError(f"store entry {path} is corrupted: {exc}") from None
        if (meta.get("model", {}).get("hash") != model_hash or meta.get("calibration_id") != calibration_id
                or meta.get("tokens_sha256") != _digest(token_ids)):
            raise CorruptEntryError(f"store entry {path} holds a different model, calibration or prefix")
        return data

    def lengths(self, model_hash: str, calibration_id: str) -> list[int]:
        """Token counts of the stored prefixes, longest first."""
        directory = self._dir(model_hash, calibration_id)
        if not directory.is_dir():
            return []
        out = set()
        for entry in directory.iterdir():
            name = entry.name
            if name.endswith(SUFFIX) and ".tmp-" not in name:
                head = name.split("-", 1)[0]
                if head.isdigit():
                    out.add(int(head))
        return sorted(out, reverse=True)

    def longest_prefix(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> tuple[int, bytes] | None:
        """``(n, blob)`` for the longest stored prefix ``token_ids[:n]`` (``n <= len(token_ids)``), or None.

        Corrupted entries are reported with a warning and skipped.
        """
        for n in self.lengths(model_hash, calibration_id):
            if n > len(token_ids) or n == 0:
                continue
            try:
                blob = self.get(model_hash, calibration_id, token_ids[:n])
            except CorruptEntryError as exc:
                warnings.warn(str(exc), stacklevel=2)
                continue
            if blob is not None:
                return n, blob
        return None
