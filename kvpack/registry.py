"""The method registry: one decorator, ``@register_method("name")``, on a method's class in its own module.

Both families register here — resident methods (a :class:`kvpack.resident.base.LayerStore` subclass
with a ``Config``) and storage methods (a :class:`kvpack.storage.base.StorageCodec` subclass) — so a
name means one method whatever the family. A family's package finds its methods by importing every
module in it (:func:`discover`): adding a method is adding one file, no list to extend.

This module sits at the bottom of kvpack's layers: it imports nothing of kvpack.
"""

from __future__ import annotations

import importlib
import pkgutil

METHODS: dict[str, type] = {}
_DISCOVERED: set[str] = set()


def register_method(name: str):
    """Class decorator: register a method class under ``name`` (sets ``cls.name``).

    A resident method is a ``LayerStore`` subclass with a ``Config`` (a frozen :class:`MethodConfig`
    dataclass); a storage method a ``StorageCodec`` subclass. Registering is all it takes for
    ``kvpack generate --method name``, ``kvpack eval --methods name`` and ``kvpack methods`` to find it.

    Example:
        >>> from kvpack import register_method
        >>> from kvpack.resident.base import LayerStore
        >>> @register_method("my_method")  # doctest: +SKIP
        ... class MyStore(LayerStore):
        ...     Config = MyConfig
    """

    def deco(cls: type) -> type:
        if name in METHODS and METHODS[name] is not cls:
            raise ValueError(f"method {name!r} is already registered (by {METHODS[name].__qualname__})")
        cls.name = name
        METHODS[name] = cls
        return cls

    return deco


def discover(package: str) -> None:
    """Import every module of ``package`` (once per process), so that each registers its methods."""
    if package in _DISCOVERED:
        return
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        importlib.import_module(info.name)
    _DISCOVERED.add(package)


def registered(base: type) -> dict[str, type]:
    """The registered methods that derive from ``base`` (one family), by name."""
    return {name: cls for name, cls in METHODS.items() if issubclass(cls, base)}


def unknown_method(name: str, known: list[str]) -> ValueError:
    return ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(known))}")


def resolve(methods: dict[str, type], name: str, config=None):
    """``(class, config)`` of method ``name`` among ``methods``, a config given as a dict turned into
    the method's ``Config`` (``ValueError`` for an unknown name or field)."""
    if name not in methods:
        raise unknown_method(name, list(methods))
    cls = methods[name]
    return cls, cls.Config.from_dict(config) if isinstance(config, dict) else config
