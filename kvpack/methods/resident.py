"""Resident methods under the :class:`Method` protocol: a ``KVPackCache`` attached to the model."""

from __future__ import annotations

import time

import torch

from ..hf.attach import attach
from ..hf.cache import KVPackCache
from ..hf.generation import ProgressStreamer, greedy_generate
from ..hf.prefill import ExactPrefill, resident_cache_from
from ..resident import StoreFactory
from .protocol import GenerationResult, Method, PreparedCache


class ResidentMethod(Method):
    """A resident method (``kvpack.resident``): its stores hold the cache while attention runs."""

    family = "resident"

    def __init__(self, codec: StoreFactory):
        self.codec = codec
        self.name = codec.name
        self.config = codec.config

    def with_config(self, config) -> ResidentMethod:
        return ResidentMethod(StoreFactory(self.codec.store_cls, config))

    def resolved_config(self, cache: KVPackCache) -> dict:
        """The config plus what the stores decided from the input (e.g. PuzzleKV's ranks; on a model with
        sliding-window layers, the compressed layers' share of a whole-cache budget, ``full_layers_budget``)."""
        config = self.config.to_dict()
        if cache.full_layers_budget != cache.requested_budget:
            config["full_layers_budget"] = cache.full_layers_budget
        for layer in cache.kvpack_layers:
            for store in filter(None, layer.rows):
                config.update(store.resolved_params())
                return config
        return config

    @torch.no_grad()
    def generate(self, model, tokenizer, token_ids, max_new_tokens, min_new_tokens=0, progress=False,
                 budget_scope="whole"):
        bound = self.for_model(model, tokenizer, progress)  # an "auto" calibration: the model's own
        if bound is not self:
            return bound.generate(model, tokenizer, token_ids, max_new_tokens, min_new_tokens, progress,
                                  budget_scope)
        streamer = ProgressStreamer(len(token_ids), max_new_tokens, progress)
        start = time.perf_counter()
        with attach(model, self.codec, budget_scope=budget_scope) as cache:
            new = greedy_generate(model, tokenizer, cache, token_ids, max_new_tokens, min_new_tokens, streamer)
        total = time.perf_counter() - start
        return GenerationResult(
            text=tokenizer.decode(new, skip_special_tokens=True), method=self.label,
            config=self.resolved_config(cache), prompt_tokens=len(token_ids), new_tokens=len(new),
            kv_bytes=cache.kv_bytes(), dense_kv_bytes=cache.dense_kv_bytes(),
            prefill_s=streamer.prefill_s if streamer.prefill_s is not None else total, total_s=total, token_ids=new)

    def from_prefill(self, model, prefill: ExactPrefill) -> PreparedCache:
        bound = self.for_model(model)
        if bound is not self:
            return bound.from_prefill(model, prefill)
        start = time.perf_counter()
        cache = resident_cache_from(model, self.codec, prefill)
        return PreparedCache(cache, cache.kv_bytes(), cache.dense_kv_bytes(), time.perf_counter() - start,
                             self.resolved_config(cache), scope=lambda m, c: attach(m, cache=c))
