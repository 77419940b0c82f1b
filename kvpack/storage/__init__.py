"""Storage methods: each turns one sequence's filled cache into bytes (to keep or move) and back.

One module (or subpackage) per method, each registering its :class:`StorageCodec` subclass with
``@register_method("name")``; :func:`storage_methods` finds them all (``kvpack.methods.get_method``
builds one). kvtc is the one today.
"""

from __future__ import annotations

from ..registry import discover, registered
from .base import DenseKV, DenseLayer, StorageCodec


def storage_methods() -> dict[str, type[StorageCodec]]:
    """Every registered storage method's class, by name."""
    discover(__name__)
    return registered(StorageCodec)


__all__ = ["DenseKV", "DenseLayer", "StorageCodec", "storage_methods"]
