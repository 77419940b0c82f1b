"""The ``"kvpack"`` attention function, registered through transformers' ``AttentionInterface``, and
the scope in which a model uses it.

:func:`attached` is the only way a model runs kvpack attention: inside ``with attached(model,
cache):`` the model's attention implementation is ``"kvpack"`` and ``cache`` is the active cache;
on exit (also on an exception) the model's previous implementation is back. The route from a
cache update to attention is one: the attention function asks the active cache (a context
variable) for the layer of the calling attention module (``module.layer_idx``). For a layer whose
cache is a compressed kvpack layer, attention is computed over that layer's stores; for every other
layer — sliding-window layers — it is transformers' own SDPA attention, so the switch changes
nothing else. Registration happens on first use (nothing is patched at import time).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "kvpack"


class RoutedCache(Protocol):
    """What the attention function asks of the active cache (``KVPackCache`` implements it)."""

    def is_compressed_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is compressed by kvpack (else the model's own cache holds it)."""

    def kvpack_attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """``[B, Q, H, d]``: attention of a compressed layer's parked chunk over its stores."""


_ACTIVE: contextvars.ContextVar[RoutedCache | None] = contextvars.ContextVar("kvpack_active_cache", default=None)


def active_cache() -> RoutedCache | None:
    """The cache of the innermost :func:`attached` block, or None outside any."""
    return _ACTIVE.get()


def kvpack_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs):
    """transformers attention-function signature; returns ``(out [B, Q, H, d], None)``."""
    cache = _ACTIVE.get()
    layer_idx = getattr(module, "layer_idx", None)
    if cache is not None and layer_idx is not None and cache.is_compressed_layer(layer_idx):
        for unsupported in ("softcap", "s_aux", "position_bias"):
            if kwargs.get(unsupported) is not None:
                raise NotImplementedError(f"kvpack attention does not support {unsupported!r} (layer {layer_idx})")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        return cache.kvpack_attend(layer_idx, query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register_kvpack_attention() -> None:
    """Register ``"kvpack"`` with transformers' attention and mask interfaces (idempotent)."""
    if ATTENTION_NAME not in AttentionInterface().valid_keys():
        AttentionInterface.register(ATTENTION_NAME, kvpack_attention)
        # Same boolean masks as SDPA: padding information reaches the stores through them.
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def attached(model: torch.nn.Module, cache: RoutedCache) -> Iterator[RoutedCache]:
    """Run ``model`` with kvpack attention over ``cache`` inside the block; restore the model's
    previous attention implementation on exit, also on an exception."""
    register_kvpack_attention()
    previous = model.config._attn_implementation
    token = _ACTIVE.set(cache)
    try:
        if previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        yield cache
    finally:
        _ACTIVE.reset(token)
        if previous != ATTENTION_NAME:
            model.set_attn_implementation(previous)
