"""One exact prefill, many compressed caches: how the harness builds every method from the same run.

:func:`exact_prefill` runs the model once over the prompt with exact attention through kvpack's
cache and keeps, per full-attention layer, the keys, values, queries and exact attention outputs
(everything a codec's store sees in a prefill). :func:`build_cache` then gives each method a cache
as if it had compressed during that prefill — each layer's store receives the same
``append(k, v, q, out)`` it would have received (``LayerStore.load_prefill``); layers kvpack does
not compress (sliding windows) are copied. Storage codecs (kvtc) get a dense ``DynamicCache`` that
they round-trip through their blob. Equivalence with compressing during prefill: layer l+1 never
sees layer l's cache during the prefill, so compressing after it changes nothing (DESIGN.md).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..codecs.base import DENSE_REFERENCE_BYTES_PER_ELEMENT, Codec
from ..codecs.full import FullConfig, FullKV, FullStore
from ..hf.cache import KVPackCache, KVPackLayer, cache_kwargs


class _CaptureStore(FullStore):
    """FullKV that also keeps the prefill's queries, attention outputs and logit scale."""

    def attend(self, q, k, v, scaling):
        self.scaling = scaling
        return super().attend(q, k, v, scaling)

    def append(self, k, v, q=None, out=None):
        if self.seq_len:
            raise RuntimeError("the capture cache records a single prefill chunk")
        super().append(k, v, q, out)
        self.q, self.out = q, out


class _CaptureCodec(FullKV):
    def __init__(self):
        super().__init__(FullConfig(storage_dtype="auto"))

    def new_store(self, layout):
        return _CaptureStore(layout, self.config)


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


@torch.no_grad()
def exact_prefill(model, token_ids: list[int]) -> ExactPrefill:
    if not token_ids:
        raise ValueError("empty prompt: nothing to prefill")
    cache = KVPackCache(model, _CaptureCodec())
    ids = torch.tensor([token_ids], device=model.device)
    start = time.perf_counter()
    model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    seconds = time.perf_counter() - start
    layers, other = {}, {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVPackLayer):
            s = layer.rows[0]
            layers[i] = (s.k, s.v, s.q, s.out, s.scaling)
        else:
            other[i] = layer
    return ExactPrefill(token_ids=list(token_ids), layers=layers, other_layers=other, seconds=seconds)


@dataclass
class BuiltCache:
    cache: object
    kv_bytes: int
    dense_kv_bytes: int
    seconds: float


def _dense_cache(model, prefill: ExactPrefill):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v, _, _, _) in prefill.layers.items():
        cache.layers[i].update(k[None], v[None])
    for i, layer in prefill.other_layers.items():
        cache.layers[i] = copy.deepcopy(layer)
    return cache


@torch.no_grad()
def build_cache(model, codec: Codec, prefill: ExactPrefill) -> BuiltCache:
    """A fresh cache of ``codec`` holding the prefilled tokens, with its measured bytes.

    ``kv_bytes`` is what the cache holds right after compression (for kvtc: the blob's size);
    ``dense_kv_bytes`` the same tokens in bf16.
    """
    start = time.perf_counter()
    if codec.storage:
        dense = _dense_cache(model, prefill)
        ref = sum((layer.keys.numel() + layer.values.numel()) for layer in dense.layers) \
            * DENSE_REFERENCE_BYTES_PER_ELEMENT
        restored, blob_bytes = codec.roundtrip_cache(model, dense, prefill.token_ids)
        from ..hf.attention import use_kvpack_attention

        use_kvpack_attention(model)  # plain SDPA for non-kvpack layers; keeps one attention setting
        return BuiltCache(restored, blob_bytes, ref, time.perf_counter() - start)
    cache = KVPackCache(model, codec)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVPackLayer):
            k, v, q, out, scaling = prefill.layers[i]
            layer.load_prefill(k[None], v[None], q[None], out[None], scaling)
        else:
            cache.layers[i] = copy.deepcopy(prefill.other_layers[i])
    return BuiltCache(cache, cache.kv_bytes(), cache.dense_kv_bytes(), time.perf_counter() - start)
