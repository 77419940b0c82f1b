"""Every method, resident or storage, behind one protocol (:class:`Method`); see ``protocol.py``.

``get_method("puzzle", budget=0.5)`` / ``get_method("kvtc", calibration="cal/")`` return a
:class:`Method`; so does a preset's name (``get_method("pca_quant-layers", budget=0.28)``, the table in
:mod:`kvpack.presets`). ``available_methods()`` lists both families, ``available_presets()`` the presets. A new
method is one module in ``kvpack/resident/`` or ``kvpack/storage/`` with its class in :mod:`.catalog`'s list.
"""

from __future__ import annotations

from ..config import MethodConfig
from ..presets import PRESETS, Preset, preset
from ..registry import resolve, unknown_method
from ..resident import StoreFactory, resident_methods
from ..storage import storage_methods
from .catalog import register_kvpack_methods
from .protocol import GenerationResult, Method, PreparedCache
from .resident import ResidentMethod
from .storage import StorageMethod

register_kvpack_methods()  # the one list of kvpack's methods (catalog.py), on `import kvpack`


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


def available_presets() -> list[str]:
    """The names of every preset (:mod:`kvpack.presets`), in the table's order.

    Example:
        >>> import kvpack
        >>> "pca_quant-layers" in kvpack.available_presets()
        True
        >>> kvpack.get_method("pca_quant-layers", budget=0.28).config.calibration  # made for the model on first use
        'auto'
    """
    return [p.name for p in PRESETS]


def _registered(name: str) -> str:
    """The registered method behind ``name`` (a method's own name, or a preset's method)."""
    p = preset(name)
    if p is not None:
        return p.method
    if name not in method_classes():
        raise unknown_method(name, [*method_classes(), *available_presets()])
    return name


def method_config_class(name: str) -> type[MethodConfig]:
    """The config dataclass of method or preset ``name`` (``ValueError`` for an unknown name)."""
    return resolve(method_classes(), _registered(name))[0].Config


def method_takes_budget(name: str) -> bool:
    """Whether method or preset ``name`` takes a byte budget (FullKV and the fixed-ratio presets do not;
    ``ValueError`` when unknown)."""
    p = preset(name)
    if p is not None:
        return p.budgeted
    return resolve(method_classes(), _registered(name))[0].budgeted


def preset_config(p: Preset, overrides: dict) -> dict:
    """A preset's fixed fields with the caller's ``overrides`` on top (``ValueError`` for a budget given to a
    preset whose bytes follow from its own fields)."""
    if overrides.get("budget") is not None and not p.budgeted:
        fixed = ", ".join(f"{k}={v}" for k, v in p.config.items() if k != "calibration")
        raise ValueError(f"{p.name} takes no budget: its bytes follow from {fixed}; choose a preset or method that "
                         f"takes one (kvpack methods)")
    return {**p.config_dict(), **overrides}


def get_method(name: str, config: MethodConfig | dict | None = None, **overrides) -> Method:
    """A registered method with its config, under the :class:`Method` protocol.

    Args:
        name: a registered method (:func:`available_methods`; ``kvpack methods`` lists each one's fields) or a
            preset (:func:`available_presets`: a method with some fields fixed). A preset whose calibration is
            ``"auto"`` gets the model's own when it runs (:meth:`Method.for_model`).
        config: the method's config dataclass, or a dict of its fields; None = its defaults (or the preset's).
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
    p = preset(name)
    if p is not None:
        if config is not None:
            raise ValueError(f"{name} is a preset: give its fields as keywords, not a config object")
        method = get_method(p.method, **preset_config(p, overrides))
        method.preset = p.name
        return method
    cls, config = resolve(method_classes(), _registered(name), config)
    if name in resident_methods():
        return ResidentMethod(StoreFactory(cls, config, **overrides))
    return StorageMethod(cls(config, **overrides))


__all__ = ["GenerationResult", "Method", "PreparedCache", "ResidentMethod", "StorageMethod", "available_methods",
           "available_presets", "get_method", "method_classes", "method_config_class", "method_takes_budget",
           "preset_config"]
