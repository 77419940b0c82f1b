"""Storage methods: each turns one sequence's filled cache into bytes (to keep or move) and back.

One module (or subpackage) per method, its :class:`StorageCodec` subclass registered in
:mod:`kvpack.methods.catalog`'s list; :func:`storage_methods` looks them up (``kvpack.methods.get_method``
builds one). kvtc is the one today (``kvtc_resident``, a resident method built on its codes, lives beside it).
"""

from __future__ import annotations

from ..registry import registered
from .base import DenseKV, DenseLayer, StorageCodec


def storage_methods() -> dict[str, type[StorageCodec]]:
    """Every registered storage method's class, by name."""
    return registered(StorageCodec)


__all__ = ["DenseKV", "DenseLayer", "StorageCodec", "storage_methods"]
