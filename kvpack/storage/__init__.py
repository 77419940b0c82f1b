"""Storage methods: each turns one sequence's filled cache into bytes (to keep or move) and back.

One module (or subpackage) per method, each registering its :class:`StorageCodec` subclass with
``@register_method("name")``; :func:`get_storage_codec` finds them all. kvtc is the one today.
"""

from __future__ import annotations

from ..config import MethodConfig
from ..registry import discover, registered, resolve
from .base import DenseKV, DenseLayer, StorageCodec


def storage_methods() -> dict[str, type[StorageCodec]]:
    """Every registered storage method's class, by name."""
    discover(__name__)
    return registered(StorageCodec)


def get_storage_codec(name: str, config: MethodConfig | dict | None = None, **overrides) -> StorageCodec:
    """A registered storage method with its config (``ValueError`` for an unknown name or field)."""
    cls, config = resolve(storage_methods(), name, config)
    return cls(config, **overrides)


__all__ = ["DenseKV", "DenseLayer", "StorageCodec", "get_storage_codec", "storage_methods"]
