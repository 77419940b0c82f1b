"""An optional keyed MAC (HMAC-SHA256) for what prefix stores and engines keep.

A blob's SHA-256 and a chunk's digest catch accidents (a flipped bit, a torn write), not someone who
can write to the store: such a writer can relabel an entry and recompute the checksum. A prefix
store is therefore *trusted storage* unless a key is set. With a key (``KVPACK_STORE_KEY``, or passed
explicitly), every entry is written *sealed* — ``SEAL_MAGIC || HMAC-SHA256(key, blob) || blob`` —
and every read requires a valid seal before the blob is parsed; a store holding entries from a
writer without the key returns none of them. The key is secret material: at least
``MIN_KEY_BYTES`` bytes, shared by the processes that share the store, never stored with it.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from .schema import BlobError

KEY_ENV = "KVPACK_STORE_KEY"
SEAL_MAGIC = b"KVPACKS\x01"
MAC_BYTES = 32
MIN_KEY_BYTES = 16


class SealError(BlobError):
    """An entry whose seal is missing, wrong, or present where no key was given to check it."""


def store_key(key: bytes | str | None = None) -> bytes | None:
    """The MAC key: ``key`` when given, else ``$KVPACK_STORE_KEY`` (its UTF-8 bytes), else None.

    Raises:
        ValueError: a key shorter than ``MIN_KEY_BYTES`` bytes.
    """
    if key is None:
        key = os.environ.get(KEY_ENV) or None
        if key is None:
            return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"the store key ({KEY_ENV}) must be at least {MIN_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def mac(key: bytes, data: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``data`` under ``key``."""
    return hmac.new(key, data, hashlib.sha256).digest()


def seal(blob: bytes, key: bytes | None) -> bytes:
    """``blob`` as a store keeps it: sealed under ``key``, or unchanged without one."""
    if key is None:
        return blob
    return SEAL_MAGIC + mac(key, blob) + blob


def unseal(data: bytes, key: bytes | None) -> bytes:
    """The blob inside a stored entry, after checking its seal under ``key``.

    Raises:
        SealError: with a key, an entry that is not sealed or whose MAC does not verify; without
            one, a sealed entry (its authenticity cannot be checked, so it is not returned).
    """
    sealed = data[:len(SEAL_MAGIC)] == SEAL_MAGIC
    if key is None:
        if sealed:
            raise SealError(f"the entry is sealed with a key; set {KEY_ENV} to read it")
        return data
    if not sealed:
        raise SealError("the entry is not sealed, and this store requires a valid MAC on every entry")
    start = len(SEAL_MAGIC) + MAC_BYTES
    if len(data) < start or not hmac.compare_digest(data[len(SEAL_MAGIC):start], mac(key, data[start:])):
        raise SealError("the entry's MAC does not verify under this store's key (forged, or another key)")
    return data[start:]
