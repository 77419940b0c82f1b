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
    """
    if cache is None:
        cache = KVPackCache(model, method, **config)
    elif config or method != "full":
        raise ValueError("pass either a method and its config, or an existing cache")
    with attached(model, cache):
        yield cache
