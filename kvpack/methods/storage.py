"""Storage methods under the :class:`Method` protocol: prefill exactly, compress to bytes, restore a
plain cache and continue from it."""

from __future__ import annotations

import time

import torch

from ..hf.dense import prefill, to_dynamic_cache
from ..hf.generation import ProgressStreamer, check_context, greedy_generate
from ..hf.prefill import ExactPrefill, dense_cache_from
from ..ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ..storage import StorageCodec
from .protocol import GenerationResult, Method, PreparedCache


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

    def check_ready(self) -> None:
        self.codec.check_ready()

    def roundtrip(self, model, cache, token_ids: list[int]) -> tuple[object, int]:
        """``(restored DynamicCache, blob bytes)`` of a filled one-sequence cache of ``token_ids``."""
        blob = self.codec.compress(model, cache, token_ids)
        dense, _ = self.codec.decompress(model, blob)
        return to_dynamic_cache(model, dense, len(token_ids)), len(blob)

    @torch.no_grad()
    def generate(self, model, tokenizer, token_ids, max_new_tokens, min_new_tokens=0, progress=False):
        """Prefill all but the last prompt token, compress, decompress, and generate after the prompt
        (the last token is prefilled over the restored cache)."""
        if len(token_ids) < 2:
            raise ValueError(f"{self.name} needs a prompt of at least 2 tokens (a prefix to compress and one to "
                             "continue)")
        self.check_ready()
        check_context(model, len(token_ids), max_new_tokens)
        prefix = token_ids[:-1]
        start = time.perf_counter()
        dense = prefill(model, prefix)
        blob = self.codec.compress(model, dense, prefix)
        compress_s = time.perf_counter() - start
        dense_bytes = dense_reference_bytes(dense)
        del dense
        # Created before decompressing, so that its time to the first token includes decompression.
        streamer = ProgressStreamer(1, max_new_tokens, enabled=False)
        restored, _ = self.codec.decompress(model, blob)
        cache = to_dynamic_cache(model, restored, len(prefix))
        decompress_s = time.perf_counter() - streamer.start
        new = greedy_generate(model, tokenizer, cache, token_ids, max_new_tokens, min_new_tokens, streamer)
        first_token_s = streamer.prefill_s if streamer.prefill_s is not None else time.perf_counter() - streamer.start
        config = {**self.codec.describe(), "compress_s": compress_s, "decompress_s": decompress_s}
        return GenerationResult(
            text=tokenizer.decode(new, skip_special_tokens=True), method=self.name, config=config,
            prompt_tokens=len(token_ids), new_tokens=len(new), kv_bytes=len(blob), dense_kv_bytes=dense_bytes,
            prefill_s=compress_s + first_token_s, total_s=time.perf_counter() - start, token_ids=new)

    def from_prefill(self, model, prefill: ExactPrefill) -> PreparedCache:
        start = time.perf_counter()
        dense = dense_cache_from(model, prefill)
        ref = dense_reference_bytes(dense)
        restored, blob_bytes = self.roundtrip(model, dense, prefill.token_ids)
        return PreparedCache(restored, blob_bytes, ref, time.perf_counter() - start, self.codec.describe())
