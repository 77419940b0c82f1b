"""Plain transformers caches (``DynamicCache``) for storage methods: prefill into one, read its
tensors, rebuild one from tensors. kvpack's storage family works on tensors; this module is where
they meet transformers' cache API.

A *dense cache* here is anything with ``layers[i].keys`` / ``layers[i].values`` ``[1, kv_heads, T,
d]`` for every layer of the model (keys post-RoPE; a sliding-window layer holds its window only):
a ``DynamicCache``, or :class:`kvpack.storage.base.DenseKV`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .cache import cache_kwargs
from .generation import check_context


def new_dense_cache(model: torch.nn.Module) -> DynamicCache:
    """The empty cache transformers would build for ``model``."""
    return DynamicCache(config=model.config)


@torch.no_grad()
def prefill(model: torch.nn.Module, token_ids: list[int], cache: DynamicCache | None = None) -> DynamicCache:
    """Run ``token_ids`` through the model into ``cache`` (a new ``DynamicCache`` if None); returns it.

    Tokens the cache already holds (a prefix) are not run again.
    """
    if not token_ids:
        raise ValueError("empty prompt: nothing to prefill")
    check_context(model, len(token_ids))
    cache = cache if cache is not None else new_dense_cache(model)
    past = cache.get_seq_length()
    ids = torch.tensor([token_ids[past:]], device=model.device)
    if ids.shape[1]:
        mask = torch.ones(1, past + ids.shape[1], dtype=torch.long, device=model.device)
        model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    return cache


def to_dynamic_cache(model: torch.nn.Module, dense, n_tokens: int) -> DynamicCache:
    """A ``DynamicCache`` holding ``dense``'s tensors (``dense.layers[i].keys [1, H, T_i, d]``), as
    after a prefill of ``n_tokens`` tokens, in the model's dtype and on its device (a cache stored
    from a float32 model continues in a bfloat16 one, and the other way round).

    A sliding-window layer that holds fewer than ``n_tokens`` tokens (its window) is filled through
    its own ``update`` with the window behind ``n_tokens − T_i`` zero rows, which it drops: its
    length and position bookkeeping come out as after the real prefill, through transformers'
    public API (no field written from outside).
    """
    cache = new_dense_cache(model)
    if len(cache.layers) != len(dense.layers):
        raise ValueError(f"the stored cache holds {len(dense.layers)} layers, the model's cache has "
                         f"{len(cache.layers)}")
    for layer, stored in zip(cache.layers, dense.layers):
        k = stored.keys.to(device=model.device, dtype=model.dtype)
        v = stored.values.to(device=model.device, dtype=model.dtype)
        missing = n_tokens - k.shape[2]
        if missing < 0:
            raise ValueError(f"a stored layer holds {k.shape[2]} tokens, more than the {n_tokens} of the sequence")
        if missing:
            if not getattr(layer, "is_sliding", False):
                raise ValueError(f"a full-attention layer holds {k.shape[2]} of the sequence's {n_tokens} tokens")
            pad = k.new_zeros(*k.shape[:2], missing, k.shape[3])
            k, v = torch.cat([pad, k], dim=2), torch.cat([pad.to(v.dtype), v], dim=2)
        layer.update(k, v)
    return cache
