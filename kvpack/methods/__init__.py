"""Every method, resident or storage, behind one protocol (:class:`Method`); see ``protocol.py``.

``get_method("puzzle", budget=0.5)`` / ``get_method("kvtc", calibration="cal/")`` return a
:class:`Method`; ``available_methods()`` lists both families. A new method is one module in
``kvpack/resident/`` or ``kvpack/storage/`` with ``@register_method("name")`` on its class.
"""

from __future__ import annotations

from ..config import MethodConfig
from ..registry import resolve
from ..resident import StoreFactory, resident_methods
from ..storage import storage_methods
from .protocol import GenerationResult, Method, PreparedCache
from .resident import ResidentMethod
from .storage import StorageMethod


def method_classes() -> dict[str, type]:
    """Every registered method's class (a resident store class or a storage codec class), by name."""
    return {**resident_methods(), **storage_methods()}


def available_methods() -> list[str]:
    return sorted(method_classes())


def method_config_class(name: str) -> type[MethodConfig]:
    """The config dataclass of method ``name`` (``ValueError`` for an unknown name)."""
    return resolve(method_classes(), name)[0].Config


def method_takes_budget(name: str) -> bool:
    """Whether method ``name`` takes a byte budget (FullKV does not; ``ValueError`` when unknown)."""
    return resolve(method_classes(), name)[0].budgeted


def get_method(name: str, config: MethodConfig | dict | None = None, **overrides) -> Method:
    """A registered method with its config, under the :class:`Method` protocol.

    Raises:
        ValueError: unknown name (the message lists the known ones) or an invalid config field.
    """
    cls, config = resolve(method_classes(), name, config)
    if name in resident_methods():
        return ResidentMethod(StoreFactory(cls, config, **overrides))
    return StorageMethod(cls(config, **overrides))


__all__ = ["GenerationResult", "Method", "PreparedCache", "ResidentMethod", "StorageMethod", "available_methods",
           "get_method", "method_classes", "method_config_class", "method_takes_budget"]
