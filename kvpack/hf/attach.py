"""``kvpack.attach``: a compressed cache for a model, used inside one ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..resident import StoreFactory
from .attention import attached
from .cache import KVPackCache


@contextlib.contextmanager
def attach(model: torch.nn.Module, method: StoreFactory | str = "full", *, cache: KVPackCache | None = None,
           **config) -> Iterator[KVPackCache]:
    """``with attach(model, "puzzle", budget=0.6) as cache:`` — a new :class:`KVPackCache` of a
    resident method (or the given ``cache``) that the model uses inside the block.

    The model's attention implementation is ``"kvpack"`` inside the block and what it was before
    after it, also when the block raises; nothing else of the model changes. Pass the cache to the
    model as transformers expects (``cache=`` from transformers 5.24, ``past_key_values=`` before;
    :func:`kvpack.hf.cache.cache_kwargs` picks it).

    Args:
        model: a transformers causal LM (its config gives the layers, heads and RoPE).
        method: a resident method's name (``kvpack methods``) or a configured ``StoreFactory``.
        cache: an existing :class:`KVPackCache` to use instead of making one.
        **config: the method's config fields (``budget=0.28``, ``page_size=64``, ...).

    Example:
        >>> import kvpack
        >>> from kvpack.hf.cache import cache_kwargs
        >>> model, tok = kvpack.load_model("smollm2")  # doctest: +SKIP
        >>> ids = tok("...", return_tensors="pt")  # doctest: +SKIP
        >>> with kvpack.attach(model, "anchor_plus", budget=0.28) as cache:  # doctest: +SKIP
        ...     out = model.generate(**ids, max_new_tokens=32, **cache_kwargs(model, cache))
        >>> cache.kv_bytes() <= 0.28 * cache.dense_kv_bytes()  # doctest: +SKIP
        True
    """
    if cache is None:
        cache = KVPackCache(model, method, **config)
    elif config or method != "full":
        raise ValueError("pass either a method and its config, or an existing cache")
    with attached(model, cache):
        yield cache
