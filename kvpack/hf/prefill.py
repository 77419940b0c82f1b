"""One exact prefill, many compressed caches: how the evaluation harness builds every method from one run.

:func:`exact_prefill` runs the model once over the prompt with exact attention through kvpack's
cache and keeps, per full-attention layer, the keys, values, queries and exact attention outputs
(everything a resident store sees in a prefill). :func:`resident_cache_from` then gives a resident
method a cache as if it had compressed during that prefill — each layer's store receives the same
``append(k, v, q, out)`` it would have received (``LayerStore.load_prefill``); layers kvpack does
not compress (sliding windows) are copied. :func:`dense_cache_from` gives storage methods the plain
``DynamicCache`` of the same prefill. Equivalence with compressing during prefill: layer l+1 never
sees layer l's cache during the prefill, so compressing after it changes nothing (the test matrix,
tests/test_method_matrix.py, checks it for every method).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..resident import StoreFactory
from ..resident.full import FullConfig, FullStore
from .attention import attached
from .cache import KVPackCache, KVPackLayer, cache_kwargs
from .dense import new_dense_cache


class CaptureStore(FullStore):
    """FullKV that also keeps the prefill's queries and attention outputs (``attend`` keeps the
    logit scale)."""

    def append(self, k, v, q=None, out=None):
        if self.seq_len:
            raise RuntimeError("the capture cache records a single prefill chunk")
        super().append(k, v, q, out)
        self.q, self.out = q, out


@dataclass
class ExactPrefill:
    """Per-layer tensors of one exact prefill of ``token_ids`` (batch 1).

    Attributes:
        layers: ``{layer_idx: (k [kv_heads, T, d], v, q [q_heads, T, d], out [q_heads, T, d], scaling)}``.
        other_layers: the model's own cache layers that kvpack does not compress.
    """

    token_ids: list[int]
    layers: dict[int, tuple]
    other_layers: dict[int, object] = field(default_factory=dict)
    seconds: float = 0.0

    def leading(self, n_tokens: int) -> ExactPrefill | None:
        """The prefill of the first ``n_tokens`` tokens, cut from this one (``seconds`` is 0: no model
        ran). Attention is causal: the first positions' keys, values, queries and outputs do not
        depend on later tokens, so the cut equals a prefill of those tokens up to floating-point
        rounding — the kernels may round differently for another sequence length. Measured on
        SmolLM2 in bf16: bit for bit for 2000 of 2048 and 2016 of 2047 tokens; 2018 of 2051 up to
        0.22 apart (1.6% of a layer's largest value: a few bf16 ulps).
        None when the model has layers kvpack does not hold (sliding windows keep only their last
        tokens): prefill again."""
        if self.other_layers or not 1 <= n_tokens <= len(self.token_ids):
            return None
        layers = {i: (*(t[:, :n_tokens].clone() for t in tensors[:4]), tensors[4])
                  for i, tensors in self.layers.items()}
        return ExactPrefill(self.token_ids[:n_tokens], layers, {}, 0.0)


@torch.no_grad()
def exact_prefill(model, token_ids: list[int]) -> ExactPrefill:
    if not token_ids:
        raise ValueError("empty prompt: nothing to prefill")
    cache = KVPackCache(model, StoreFactory(CaptureStore, FullConfig(storage_dtype="auto")))
    ids = torch.tensor([token_ids], device=model.device)
    start = time.perf_counter()
    with attached(model, cache):
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
              **cache_kwargs(model, cache))
    seconds = time.perf_counter() - start
    layers, other = {}, {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVPackLayer):
            s = layer.rows[0]
            layers[i] = (s.k, s.v, s.q, s.out, s.scaling)
        else:
            other[i] = layer
    return ExactPrefill(token_ids=list(token_ids), layers=layers, other_layers=other, seconds=seconds)


def dense_cache_from(model, prefill: ExactPrefill):
    """The plain ``DynamicCache`` of the prefill (what a storage method compresses)."""
    cache = new_dense_cache(model)
    for i, (k, v, _, _, _) in prefill.layers.items():
        cache.layers[i].update(k[None], v[None])
    for i, layer in prefill.other_layers.items():
        cache.layers[i] = copy.deepcopy(layer)
    return cache


@torch.no_grad()
def resident_cache_from(model, codec: StoreFactory, prefill: ExactPrefill) -> KVPackCache:
    """A fresh cache of a resident method holding the prefilled tokens, compressed."""
    cache = KVPackCache(model, codec)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVPackLayer):
            k, v, q, out, scaling = prefill.layers[i]
            layer.load_prefill(k[None], v[None], q[None], out[None], scaling)
        else:
            cache.layers[i] = copy.deepcopy(prefill.other_layers[i])
    return cache
