"""``kvpack.attach``: a compressed cache for a model inside one ``with`` block, by method, preset or ``auto``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from ..hf.attach import attach as attach_store
from ..hf.cache import KVPackCache
from ..resident import StoreFactory
from . import get_method
from .recommend import resolve_auto
from .resident import ResidentMethod


@contextlib.contextmanager
def attach(model: torch.nn.Module, method: StoreFactory | str | None = None, *, cache: KVPackCache | None = None,
           tokenizer=None, progress: bool = True, budget_scope: str = "whole", **config) -> Iterator[KVPackCache]:
    """``with kvpack.attach(model, budget=0.28) as cache:`` — a new :class:`KVPackCache` that the model uses
    inside the block: the recommended method at that budget, or the method or preset named.

    The model's attention implementation is ``"kvpack"`` inside the block and what it was before after it,
    also when the block raises; nothing else of the model changes. Pass the cache to the model as transformers
    expects (:func:`kvpack.hf.cache.cache_kwargs` picks the keyword).

    Args:
        model: a transformers causal LM (its config gives the layers, heads and RoPE).
        method: None or ``"auto"`` (default): the frontier's best resident method at ``budget`` for a cache
            reused across questions (:func:`kvpack.methods.recommend.recommend`; with no budget, at 0.28 of the
            bytes); the choice and its reason are printed (``progress``) and kept as ``cache.recommendation``.
            Else a resident method's or preset's name (``kvpack methods``; ``"full"`` for the exact cache) or a
            configured ``StoreFactory``.
        cache: an existing :class:`KVPackCache` to use instead of making one.
        tokenizer: the model's tokenizer, used only to make a calibration a preset needs on first use (default:
            the one saved beside the model).
        progress: print the automatic choice and a calibration's progress on stderr.
        budget_scope: ``"whole"`` (default): ``budget`` is the fraction of the whole cache's dense bf16 bytes, a
            model's sliding-window layers included (their bytes charged to the compressed layers:
            :mod:`kvpack.hf.whole_budget`); ``"full_layers"``: of the full-attention layers' alone.
        **config: the method's config fields (``budget=0.28``, ``page_size=64``, ...).

    Example:
        >>> import kvpack
        >>> from kvpack.hf.cache import cache_kwargs
        >>> model, tok = kvpack.load_model("smollm2")  # doctest: +SKIP
        >>> ids = tok("...", return_tensors="pt")  # doctest: +SKIP
        >>> with kvpack.attach(model, budget=0.28) as cache:  # doctest: +SKIP
        ...     out = model.generate(**ids, max_new_tokens=32, **cache_kwargs(model, cache))
        >>> cache.kv_bytes() <= 0.28 * cache.dense_kv_bytes()  # doctest: +SKIP
        True
    """
    if cache is not None or isinstance(method, StoreFactory):
        scope = {} if cache is not None else {"budget_scope": budget_scope}
        with attach_store(model, method if method is not None else "full", cache=cache, **scope, **config) as made:
            yield made
        return
    name, config, recommendation = resolve_auto(model, method, config)
    if recommendation is not None and progress:
        print(recommendation.announcement(), file=sys.stderr, flush=True)
    chosen = get_method(name, **config).for_model(model, tokenizer, progress)
    if not isinstance(chosen, ResidentMethod):
        raise ValueError(f"{name} is a storage method (the cache as bytes between turns): attach takes a resident "
                         "method; use kvpack.get_method(...).compress / resume")
    made = KVPackCache(model, chosen.codec, budget_scope=budget_scope)
    made.recommendation = recommendation
    made.method_label = chosen.label
    with attach_store(model, cache=made) as attached_cache:
        yield attached_cache
