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

# A resident method may be built on a storage codec (``kvtc_resident`` holds kvtc's codes) and so live in
# kvpack.storage, above the resident layer that lists resident methods: discover the storage family now,
# on ``import kvpack``, so that every resident lookup (``get_resident_method``, ``attach``) sees it.
storage_methods()


def method_classes() -> dict[str, type]:
    """Every registered method's class (a resident store class or a storage codec class), by name."""
    return {**resident_methods(), **storage_methods()}


def available_methods() -> list[str]:
    """The names of every registered method, resident and storage, sorted.

    Example:
        >>> import kvpack
        >>> "puzzle" in kvpack.available_methods() and "kvtc" in kvpack.available_methods()
        True
    """
    return sorted(method_classes())


def method_config_class(name: str) -> type[MethodConfig]:
    """The config dataclass of method ``name`` (``ValueError`` for an unknown name)."""
    return resolve(method_classes(), name)[0].Config


def method_takes_budget(name: str) -> bool:
    """Whether method ``name`` takes a byte budget (FullKV does not; ``ValueError`` when unknown)."""
    return resolve(method_classes(), name)[0].budgeted


def get_method(name: str, config: MethodConfig | dict | None = None, **overrides) -> Method:
    """A registered method with its config, under the :class:`Method` protocol.

    Args:
        name: a registered method (:func:`available_methods`; ``kvpack methods`` lists each one's fields).
        config: the method's config dataclass, or a dict of its fields; None = its defaults.
        **overrides: config fields (``budget=0.28``, ``calibration="cal/"``, ...), checked by the
            config's rules.

    Returns:
        A :class:`Method`: ``generate(model, tokenizer, token_ids, max_new_tokens)`` returns a
        ``GenerationResult`` with the generated ids and the measured ``kv_bytes``; a storage method
        (kvtc) also has ``compress``, ``resume``, ``resume_from_store`` and ``decompress``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or an invalid config field.

    Example:
        >>> import kvpack
        >>> method = kvpack.get_method("anchor_plus", budget=0.28)
        >>> method.config.budget
        0.28
    """
    cls, config = resolve(method_classes(), name, config)
    if name in resident_methods():
        return ResidentMethod(StoreFactory(cls, config, **overrides))
    return StorageMethod(cls(config, **overrides))


__all__ = ["GenerationResult", "Method", "PreparedCache", "ResidentMethod", "StorageMethod", "available_methods",
           "get_method", "method_classes", "method_config_class", "method_takes_budget"]
