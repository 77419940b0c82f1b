"""Bytes on disk and elsewhere: the checksummed blob format, atomic writes, prefix stores."""

from __future__ import annotations

import os

from .prefix import CorruptEntryError, PrefixStore, PrefixStoreBase
from .redis_prefix import RedisPrefixStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_prefix_store(location: str | os.PathLike | None = None, key: bytes | str | None = None) -> PrefixStoreBase:
    """The prefix store at ``location``: ``redis://host:port/db[?ttl=SECONDS&prefix=NAME]`` for a Redis
    server, a directory otherwise (None: the default directory, ``<kvpack cache dir>/prefix-store``).
    ``key``: the MAC key entries are sealed and checked with (default ``$KVPACK_STORE_KEY`` if set;
    ``kvpack.store.mac``)."""
    if location is not None and str(location).startswith(REDIS_SCHEMES):
        return RedisPrefixStore.from_url(str(location), key=key)
    return PrefixStore(location, key=key)


__all__ = ["CorruptEntryError", "PrefixStore", "PrefixStoreBase", "RedisPrefixStore", "open_prefix_store"]
