"""Prefix stores: compressed caches keyed by model + calibration + token prefix.

Two backends with the same semantics, chosen by :func:`kvpack.store.open_prefix_store` from a location:

* a directory (the embedded default, :class:`PrefixStore`):
  ``ROOT/<model hash>/<calibration id>/<n tokens>-<sha256 of the tokens>.kvtc``;
* ``redis://host:port/db`` (:class:`kvpack.store.redis_prefix.RedisPrefixStore`): a server that
  several processes and machines share.

A lookup for a token sequence tries every stored length that could be a prefix of it, longest
first, so a second turn that extends a stored first turn finds it and only its new tokens need a
prefill. An entry of ``n`` tokens is also found by its leading ``n - 1`` … ``n - ALIAS_TOKENS``
tokens (an alias: a hard link on disk, an index field in Redis), so a second turn that shares all
of the first but its last few tokens — the chat template's closing of the user turn, a trailing
space the next word absorbs — still reuses it: the caller restores the leading tokens only
(``kvpack.storage.base.DenseKV.leading``). An exact entry of those tokens always wins over an alias.
Every entry read is verified (checksum, magic, version, and that its header names the requested
model and calibration and its tokens begin with the requested ones); a corrupted or foreign entry raises
:class:`CorruptEntryError` from ``get`` and is skipped with a warning by ``longest_prefix`` — it is
never returned.

Disk safety: writes go to a temporary file in the same directory, are flushed and ``fsync``-ed, then
renamed over the entry (``os.replace`` is atomic): a crash leaves the previous entry intact and
readers never see a torn file.
"""

from __future__ import annotations

import os
import re
import stat
import time
import warnings
from abc import ABC, abstractmethod
from pathlib import Path

from ..paths import cache_dir
from .atomic import atomic_write_bytes
from .format import Blob, BlobError, tokens_digest
from .mac import seal, store_key, unseal
from .schema import get_int, get_object, get_str

SUFFIX = ".kvtc"
ENTRY_NAME = re.compile(r"^(\d+)-[0-9a-f]{64}\.kvtc$")  # <n tokens>-<sha256 of the tokens>.kvtc
MAX_ENTRY_BYTES = 64 << 30  # a larger file is not read (no kvtc blob of a real cache comes near)
ENTRY_ID = r"[0-9A-Za-z]{1,128}"  # model hashes and calibration ids name directories and keys
ALIAS_TOKENS = 16  # an entry is also found by its leading n-1 ... n-16 tokens
STALE_TMP_SECONDS = 3600  # temporary files older than this are a crashed writer's leftovers


class CorruptEntryError(BlobError):
    """A stored entry exists but fails verification."""


def default_store_root() -> Path:
    return cache_dir() / "prefix-store"


def check_names(model_hash: str, calibration_id: str) -> None:
    """Refuse identifiers that could escape a directory or a key namespace."""
    for name, value in (("model hash", model_hash), ("calibration id", calibration_id)):
        if not value or not all(c.isalnum() for c in value):
            raise ValueError(f"{name} must be a non-empty alphanumeric string, got {value!r}")


def entry_identity(blob: bytes, token_ids: list[int]) -> tuple[str, str]:
    """``(model hash, calibration id)`` a blob is stored under, after checking it verifies and that its
    header describes ``token_ids``.

    Raises:
        BlobError: the blob does not verify or its header disagrees with ``token_ids``.
    """
    if not token_ids:
        raise ValueError("cannot store an empty prefix")
    meta = Blob(blob).meta
    if get_int(meta, "tokens") != len(token_ids) or get_str(meta, "tokens_sha256") != tokens_digest(token_ids):
        raise BlobError("the blob's header does not describe these token ids")
    model_hash = get_str(get_object(meta, "model"), "hash", "blob header's model", pattern=ENTRY_ID)
    calibration_id = get_str(meta, "calibration_id", pattern=ENTRY_ID)
    return model_hash, calibration_id


def alias_lengths(n_tokens: int) -> range:
    """The shorter prefixes an entry of ``n_tokens`` is also found by (longest first)."""
    return range(n_tokens - 1, max(0, n_tokens - 1 - ALIAS_TOKENS), -1)


def verified_entry(data: bytes, where: str, model_hash: str, calibration_id: str, token_ids: list[int],
                   key: bytes | None = None) -> bytes:
    """The blob in a stored entry ``data`` (sealed under ``key`` when the store has one, ``kvpack.store.mac``)
    when it is an intact blob of exactly this model and calibration whose tokens are ``token_ids`` or
    begin with them (an entry reached through an alias).

    Raises:
        CorruptEntryError: naming ``where``.
    """
    try:
        data = unseal(data, key)
        blob = Blob(data)
        meta = blob.meta
        stored = get_int(meta, "tokens")
        same = (get_str(get_object(meta, "model"), "hash", "blob header's model") == model_hash
                and get_str(meta, "calibration_id") == calibration_id)
        if same and stored > len(token_ids):
            ids = blob.section("token_ids")
            begins = ids.shape == (stored,) and ids[:len(token_ids)].tolist() == token_ids
        else:
            begins = stored == len(token_ids) and get_str(meta, "tokens_sha256") == tokens_digest(token_ids)
    except BlobError as exc:
        raise CorruptEntryError(f"store entry {where} is corrupted: {exc}") from None
    if not (same and begins):
        raise CorruptEntryError(f"store entry {where} holds a different model, calibration or prefix")
    return data


class PrefixStoreBase(ABC):
    """What both backends offer; ``longest_prefix`` is shared."""

    @abstractmethod
    def put(self, blob: bytes, token_ids: list[int]) -> str | Path:
        """Store a kvtc blob under the model, calibration and tokens its header records; returns
        where it went (a path or a key).

        Raises:
            BlobError: the blob does not verify or its header disagrees with ``token_ids``.
        """

    @abstractmethod
    def get(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> bytes | None:
        """The blob stored for exactly ``token_ids`` (None if there is none).

        Raises:
            CorruptEntryError: the entry exists but is corrupted or is not what its name says.
        """

    @abstractmethod
    def lengths(self, model_hash: str, calibration_id: str) -> list[int]:
        """Token counts of the stored prefixes, longest first."""

    def longest_prefix(self, model_hash: str, calibration_id: str, token_ids: list[int],
                       whole: bool = False) -> tuple[int, bytes] | None:
        """``(n, blob)`` for the longest stored prefix ``token_ids[:n]`` (``n <= len(token_ids)``), or None.

        The blob holds ``token_ids[:n]`` or, found through an alias, a longer sequence that begins
        with them (restore its first ``n`` tokens); ``whole=True`` skips those. Corrupted entries
        are reported with a warning and skipped.
        """
        for n in self.lengths(model_hash, calibration_id):
            if n > len(token_ids) or n == 0:
                continue
            try:
                blob = self.get(model_hash, calibration_id, token_ids[:n])
            except CorruptEntryError as exc:
                warnings.warn(str(exc), stacklevel=2)
                continue
            if blob is not None and not (whole and Blob(blob).meta["tokens"] != n):
                return n, blob
        return None


class PrefixStore(PrefixStoreBase):
    """A directory of kvtc blobs addressed by (model hash, calibration id, token prefix).

    Args:
        root: directory (created on first write); default ``<kvpack cache dir>/prefix-store``.
        max_entry_bytes: entries larger than this are skipped unread.
        key: MAC key (default ``$KVPACK_STORE_KEY`` if set): entries are written sealed with
            HMAC-SHA256 and only entries whose MAC verifies are read (``kvpack.store.mac``). Without
            one the store is trusted storage: checksums catch accidents, not a hostile writer.

    Opening the store removes temporary files that crashed writers left (``*.tmp-*`` older than an
    hour: a live writer's file is younger). A lookup reads only regular files named like the store's
    own entries and at most ``max_entry_bytes`` long — a directory, FIFO, symlink or stray file in
    the store is skipped with a warning, never opened in a way that blocks or reads without bound.
    """

    def __init__(self, root: str | os.PathLike | None = None, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 key: bytes | str | None = None):
        self.root = Path(root) if root is not None else default_store_root()
        self.max_entry_bytes = max_entry_bytes
        self.key = store_key(key)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        if not self.root.is_dir():
            return
        cutoff = time.time() - STALE_TMP_SECONDS
        for tmp in self.root.glob(f"*/*/*{SUFFIX}.tmp-*"):
            try:
                info = tmp.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                continue  # another process removed or renamed it meanwhile

    def _dir(self, model_hash: str, calibration_id: str) -> Path:
        check_names(model_hash, calibration_id)
        return self.root / model_hash / calibration_id

    def path(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> Path:
        return self._dir(model_hash, calibration_id) / f"{len(token_ids)}-{tokens_digest(token_ids)}{SUFFIX}"

    def put(self, blob: bytes, token_ids: list[int]) -> Path:
        model_hash, calibration_id = entry_identity(blob, token_ids)
        path = atomic_write_bytes(self.path(model_hash, calibration_id, token_ids), seal(blob, self.key))
        for n in alias_lengths(len(token_ids)):  # hard links: no bytes twice, each appears whole
            try:
                os.link(path, self.path(model_hash, calibration_id, token_ids[:n]))
            except FileExistsError:
                continue  # an entry of exactly those tokens, or an alias to another that begins with them
            except OSError:
                break  # a file system without hard links: exact prefixes only
        return path

    def get(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> bytes | None:
        path = self.path(model_hash, calibration_id, token_ids)
        # Opened without following links and without blocking (a FIFO), then checked on the open file
        # itself: a writer replacing the entry meanwhile swaps the name, not what this descriptor reads.
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:  # a symlink (ELOOP) or another file that cannot be an entry
            raise CorruptEntryError(f"store entry {path} is not a regular file ({exc.strerror})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_entry_bytes:
            os.close(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptEntryError(f"store entry {path} is not a regular file (a directory or device)")
            raise CorruptEntryError(f"store entry {path} is {info.st_size} bytes, more than the "
                                    f"{self.max_entry_bytes} an entry may have")
        with os.fdopen(fd, "rb") as f:
            data = f.read(info.st_size + 1)
        return verified_entry(data, str(path), model_hash, calibration_id, token_ids, self.key)

    def lengths(self, model_hash: str, calibration_id: str) -> list[int]:
        directory = self._dir(model_hash, calibration_id)
        if not directory.is_dir():
            return []
        out = set()
        for entry in directory.iterdir():
            match = ENTRY_NAME.match(entry.name)
            if match:
                out.add(int(match.group(1)))
            elif ".tmp-" not in entry.name:
                warnings.warn(f"prefix store: skipping {entry}, which is not an entry of the store", stacklevel=2)
        return sorted(out, reverse=True)
