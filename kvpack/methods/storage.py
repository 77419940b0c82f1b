"""Storage methods under the :class:`Method` protocol: prefill exactly, compress to bytes, restore a
plain cache and continue from it."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..hf.dense import prefill, to_dynamic_cache
from ..hf.generation import GenerationResult, check_context
from ..hf.prefill import ExactPrefill, dense_cache_from
from ..ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ..presets import is_auto_calibration
from ..storage import StorageCodec
from .protocol import Method, PreparedCache


def dense_reference_bytes(cache) -> int:
    """Bytes of a dense cache's tensors (``cache.layers[i].keys/values``) in bf16."""
    return sum((layer.keys.numel() + layer.values.numel()) for layer in cache.layers) \
        * DENSE_REFERENCE_BYTES_PER_ELEMENT


class StorageMethod(Method):
    """A storage method (``kvpack.storage``): the cache round-trips through its bytes."""

    family = "storage"

    def __init__(self, codec: StorageCodec):
        self.codec = codec
        self.name = codec.name
        self.config = codec.config

    def with_config(self, config) -> StorageMethod:
        return StorageMethod(type(self.codec)(config))

    def check_ready(self, compressing: bool = True) -> None:
        if not is_auto_calibration(getattr(self.config, "calibration", None)):  # else: made for the model later
            self.codec.check_ready(compressing)

    def check_model(self, model) -> None:
        self.codec.check_model(model)

    def dense_bytes(self, blob: bytes) -> int:
        """Bytes of the cache in ``blob`` as dense bf16."""
        return self.codec.dense_bytes(blob)

    def compress(self, model, token_ids: list[int]) -> bytes:
        """Prefill ``token_ids`` exactly (the model's own cache) and compress that cache to bytes."""
        if not token_ids:
            raise ValueError("empty prompt: nothing to compress")
        bound = self.for_model(model)
        if bound is not self:
            return bound.compress(model, token_ids)
        self.check_ready()
        self.check_model(model)  # before the prefill, not after
        return self.codec.compress(model, prefill(model, token_ids), token_ids)

    def decompress(self, model, blob: bytes):
        """``(DenseKV, token ids)`` back from :meth:`compress`'s bytes (refused when corrupted or made
        for another model or calibration)."""
        return self.for_model(model).codec.decompress(model, blob)

    def resume(self, model, tokenizer, blob: bytes, new_token_ids: list[int], max_new_tokens: int,
               min_new_tokens: int = 0, prefix_tokens: int | None = None) -> GenerationResult:
        """Greedy generation after the cache in ``blob`` plus ``new_token_ids`` (see
        ``StorageCodec.resume``)."""
        codec = self.for_model(model, tokenizer).codec
        return codec.resume(model, tokenizer, blob, new_token_ids, max_new_tokens, min_new_tokens, prefix_tokens)

    def resume_from_store(self, store, model, tokenizer, token_ids: list[int], max_new_tokens: int,
                          min_new_tokens: int = 0) -> GenerationResult | None:
        """Generation after ``token_ids`` from the longest prefix ``store`` holds (None: none)."""
        check_context(model, len(token_ids), max_new_tokens)
        codec = self.for_model(model, tokenizer).codec
        return codec.resume_from_store(store, model, tokenizer, token_ids, max_new_tokens, min_new_tokens)

    def roundtrip(self, model, cache, token_ids: list[int]) -> tuple[object, int]:
        """``(restored DynamicCache, blob bytes)`` of a filled one-sequence cache of ``token_ids``."""
        blob = self.codec.compress(model, cache, token_ids)
        dense, _ = self.codec.decompress(model, blob)
        return to_dynamic_cache(model, dense, len(token_ids)), len(blob)

    @torch.no_grad()
    def generate(self, model, tokenizer, token_ids, max_new_tokens, min_new_tokens=0, progress=False,
                 budget_scope="whole"):
        """:meth:`compress` all but the last prompt token, then :meth:`resume` after them (the last
        token is prefilled over the restored cache); prefill_s and total_s include the compression."""
        bound = self.for_model(model, tokenizer, progress)  # an "auto" calibration: the model's own
        if bound is not self:
            return bound.generate(model, tokenizer, token_ids, max_new_tokens, min_new_tokens, progress,
                                  budget_scope)
        if len(token_ids) < 2:
            raise ValueError(f"{self.name} needs a prompt of at least 2 tokens (a prefix to compress and one to "
                             "continue)")
        self.check_ready()
        check_context(model, len(token_ids), max_new_tokens)
        start = time.perf_counter()
        blob = self.compress(model, token_ids[:-1])
        compress_s = time.perf_counter() - start
        result = self.resume(model, tokenizer, blob, token_ids[-1:], max_new_tokens, min_new_tokens)
        config = {**result.config, "compress_s": compress_s, "decompress_s": result.restore_s}
        return dataclasses.replace(result, method=self.label, config=config, prefill_s=compress_s + result.prefill_s,
                                   total_s=time.perf_counter() - start)

    def from_prefill(self, model, prefill: ExactPrefill) -> PreparedCache:
        bound = self.for_model(model)
        if bound is not self:
            return bound.from_prefill(model, prefill)
        start = time.perf_counter()
        dense = dense_cache_from(model, prefill)
        ref = dense_reference_bytes(dense)
        restored, blob_bytes = self.roundtrip(model, dense, prefill.token_ids)
        return PreparedCache(restored, blob_bytes, ref, time.perf_counter() - start, self.codec.describe())
