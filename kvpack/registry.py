"""The method registry: names to method classes, both families in one table.

Both families register here — resident methods (a :class:`kvpack.resident.base.LayerStore` subclass
with a ``Config``) and storage methods (a :class:`kvpack.storage.base.StorageCodec` subclass) — so a
name means one method whatever the family. kvpack's own methods are registered explicitly, in one list
(:mod:`kvpack.methods.catalog`, read when ``kvpack`` is imported); a user's method registers with
:func:`register_method` on its class.

This module sits at the bottom of kvpack's layers: it imports nothing of kvpack.
"""

from __future__ import annotations

METHODS: dict[str, type] = {}


def register(name: str, cls: type) -> type:
    """Register ``cls`` under ``name`` (sets ``cls.name``); ``ValueError`` when the name is another class's."""
    if name in METHODS and METHODS[name] is not cls:
        raise ValueError(f"method {name!r} is already registered (by {METHODS[name].__qualname__})")
    cls.name = name
    METHODS[name] = cls
    return cls


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
        return register(name, cls)

    return deco


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
