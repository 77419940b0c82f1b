"""kvtc end to end: prefill → compress → (store) → decompress → continue generating.

These are the flows behind ``kvpack compress``, ``kvpack continue``, ``kvpack generate --method
kvtc`` and the prefix store's multi-turn use. Prefill is exact (plain attention, the model's own
``DynamicCache``); kvtc only changes what is kept between turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...hf.dense import prefill, to_dynamic_cache
from ...hf.generation import ProgressStreamer, greedy_generate
from .calibration import Calibration
from .coder import compress_cache, decompress_cache, read_blob


def compress_tokens(model, calibration: Calibration, token_ids: list[int], ratio: float, backend: str = "zlib",
                    level: int = 6, sinks: int | None = None, window: int | None = None) -> bytes:
    """Prefill ``token_ids`` exactly and compress the resulting cache into a blob (see
    :func:`kvpack.storage.kvtc.coder.compress_cache` for the options)."""
    calibration.check_model(model)
    calibration.allocation(ratio)  # refuse an uncalibrated ratio before the prefill
    cache = prefill(model, token_ids)
    return compress_cache(cache, calibration, ratio, token_ids, model=model, backend=backend, level=level,
                          sinks=sinks, window=window)


@dataclass
class Continuation:
    """A generation continued from a decompressed cache."""

    text: str
    token_ids: list[int]
    prefix_tokens: int  # tokens restored from the blob
    prefilled_tokens: int  # tokens run through the model before generating
    blob_bytes: int
    dense_bf16_bytes: int
    decompress_s: float
    first_token_s: float  # decompression + prefill of the new tokens + first decode step
    total_s: float


@torch.no_grad()
def continue_from_blob(model, tokenizer, calibration: Calibration, blob: bytes, new_token_ids: list[int],
                       max_new_tokens: int = 32, min_new_tokens: int = 0) -> Continuation:
    """Decompress ``blob`` and generate greedily after its tokens plus ``new_token_ids``.

    Raises:
        ValueError: no new tokens (a restored cache needs at least one token to run), or a blob of
            another model/calibration; BlobError: an unreadable blob.
    """
    if not new_token_ids:
        raise ValueError("empty prompt: continuing from a stored cache needs at least one new token")
    # Created first, so that its prefill time (to the first generated token) includes decompression.
    streamer = ProgressStreamer(len(new_token_ids), max_new_tokens, enabled=False)
    start = streamer.start
    parsed, header = read_blob(blob, calibration, model)
    restored, prefix = decompress_cache((parsed, header), calibration, model)
    cache = to_dynamic_cache(model, restored, len(prefix))
    decompress_s = time.perf_counter() - start
    new = greedy_generate(model, tokenizer, cache, prefix + list(new_token_ids), max_new_tokens, min_new_tokens,
                          streamer)
    end = time.perf_counter()
    first = streamer.prefill_s if streamer.prefill_s is not None else end - start
    return Continuation(text=tokenizer.decode(new, skip_special_tokens=True), token_ids=new,
                        prefix_tokens=len(prefix), prefilled_tokens=len(new_token_ids), blob_bytes=len(blob),
                        dense_bf16_bytes=header.dense_bf16_bytes, decompress_s=decompress_s,
                        first_token_s=first, total_s=end - start)


__all__ = ["Continuation", "compress_tokens", "continue_from_blob", "prefill"]
