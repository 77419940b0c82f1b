"""Resident methods: each keeps one layer's KV of one sequence compressed in a store attention reads.

One module per method (``anchor/``, ``puzzle_plus/`` and ``pca_quant/`` are packages), named for it; kvpack's
own are registered in :mod:`kvpack.methods.catalog`'s list. :func:`get_resident_method` looks them up.
"""

from __future__ import annotations

from ..config import MethodConfig
from ..registry import registered, resolve
from .base import LayerLayout, LayerStore, StoreFactory


def resident_methods() -> dict[str, type[LayerStore]]:
    """Every registered resident method's store class, by name."""
    return registered(LayerStore)


def available_resident_methods() -> list[str]:
    return sorted(resident_methods())


def get_resident_method(name: str, config: MethodConfig | dict | None = None, **overrides) -> StoreFactory:
    """A registered resident method with its config: the :class:`StoreFactory` of its per-layer stores
    (``kvpack.methods.get_method`` wraps it under the protocol both families share).

    Raises:
        ValueError: unknown name (the message lists the known ones) or invalid config field.
    """
    cls, config = resolve(resident_methods(), name, config)
    return StoreFactory(cls, config, **overrides)


__all__ = ["LayerLayout", "LayerStore", "StoreFactory", "available_resident_methods", "get_resident_method",
           "resident_methods"]
