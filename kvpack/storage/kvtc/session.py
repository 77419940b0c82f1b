"""kvtc end to end: prefill → compress → (store) → decompress → continue generating.

These are the flows behind ``kvpack compress``, ``kvpack continue``, ``kvpack generate --method
kvtc`` and the prefix store's multi-turn use. Prefill is exact (plain attention, the model's own
``DynamicCache``); kvtc only changes what is kept between turns.
"""

from __future__ import annotations

import time
import warnings

import torch

from ...hf.dense import prefill, to_dynamic_cache
from ...hf.fingerprint import model_fingerprint
from ...hf.generation import GenerationResult, ProgressStreamer, greedy_generate
from ...store.prefix import PrefixStoreBase
from ..base import PrefixCutError
from .calibration import Calibration
from .coder import compress_cache, decompress_cache, read_blob
from .stages import StageTimes


def compress_tokens(model, calibration: Calibration, token_ids: list[int], ratio: float, backend: str = "zlib",
                    level: int = 6, sinks: int | None = None, window: int | None = None) -> bytes:
    """Prefill ``token_ids`` exactly and compress the resulting cache into a blob (see
    :func:`kvpack.storage.kvtc.coder.compress_cache` for the options)."""
    calibration.check_model(model)
    calibration.allocation(ratio)  # refuse an uncalibrated ratio before the prefill
    cache = prefill(model, token_ids)
    return compress_cache(cache, calibration, ratio, token_ids, model=model, backend=backend, level=level,
                          sinks=sinks, window=window)


@torch.no_grad()
def continue_from_blob(model, tokenizer, calibration: Calibration, blob: bytes, new_token_ids: list[int],
                       max_new_tokens: int = 32, min_new_tokens: int = 0,
                       prefix_tokens: int | None = None, config: dict | None = None,
                       times: StageTimes | None = None, precision: str = "auto") -> GenerationResult:
    """Decompress ``blob`` and generate greedily after its first ``prefix_tokens`` tokens (default:
    all of them) plus ``new_token_ids``.

    ``prefix_tokens`` below the blob's length reuses a stored conversation whose last tokens the new
    prompt does not share (a chat template's closing of the user turn, a trailing space that the
    next word absorbs); the restored cache is cut to its leading tokens, which a kvtc cache allows
    for every full-attention layer (a sliding-window layer shorter than the sequence refuses).

    Returns the generation with ``restored_tokens`` (from the blob), ``restore_s`` (reading and
    decoding it) and ``restore_stages`` (its seconds per stage; ``times``, when given, is the clock
    they are added to, e.g. one that already holds the store's ``read``), ``prefill_s`` = restore +
    prefill of the new tokens + the first decode step, and ``config`` (default: the blob's ratio and
    calibration id). ``precision``: the inverse PCA's (``coder.inverse_dtype``).

    Raises:
        ValueError: no new tokens (a restored cache needs at least one token to run), a blob of
            another model/calibration, a cache that cannot be cut; BlobError: an unreadable blob.
    """
    if not new_token_ids:
        raise ValueError("empty prompt: continuing from a stored cache needs at least one new token")
    # Created first, so that its prefill time (to the first generated token) includes decompression.
    streamer = ProgressStreamer(len(new_token_ids), max_new_tokens, enabled=False)
    start = streamer.start
    times = StageTimes() if times is None else times
    parsed, header = read_blob(blob, calibration, model, times)
    restored, prefix = decompress_cache((parsed, header), calibration, model, times, precision)
    with times("to_cache"):
        if prefix_tokens is not None and prefix_tokens != len(prefix):
            restored, prefix = restored.leading(prefix_tokens), prefix[:prefix_tokens]
        cache = to_dynamic_cache(model, restored, len(prefix))
    decompress_s = time.perf_counter() - start
    new = greedy_generate(model, tokenizer, cache, prefix + list(new_token_ids), max_new_tokens, min_new_tokens,
                          streamer)
    end = time.perf_counter()
    read_s = times.seconds.get("read", 0.0)  # a store's read, before this call (continue_from_store)
    first = (streamer.prefill_s if streamer.prefill_s is not None else end - start) + read_s
    if config is None:
        config = {"ratio": float(header.ratio), "calibration_id": calibration.calibration_id}
    return GenerationResult(text=tokenizer.decode(new, skip_special_tokens=True), method="kvtc", config=config,
                            prompt_tokens=len(prefix) + len(new_token_ids), new_tokens=len(new),
                            kv_bytes=len(blob), dense_kv_bytes=header.dense_bf16_bytes, prefill_s=first,
                            total_s=end - start + read_s, token_ids=new, restored_tokens=len(prefix),
                            restore_s=decompress_s + read_s, restore_stages=times.as_dict())


def continue_from_store(store: PrefixStoreBase, model, tokenizer, calibration: Calibration, token_ids: list[int],
                        max_new_tokens: int = 32, min_new_tokens: int = 0,
                        config: dict | None = None, precision: str = "auto") -> GenerationResult | None:
    """Generate after ``token_ids``, restoring the longest stored prefix of them (at least one token
    is left to run); None when the store holds no prefix for this model and calibration.

    The entry found may hold a longer conversation that begins with that prefix (a chat turn that
    the template closed, a trailing space the next word absorbs): its leading tokens are restored.
    A cache that cannot be cut (sliding-window layers) falls back to an entry of exactly a prefix.
    """
    keys = model_fingerprint(model)["hash"], calibration.calibration_id
    for whole in (False, True):
        times = StageTimes()
        with times("read"):
            found = store.longest_prefix(*keys, token_ids[:-1], whole=whole)
        if found is None:
            return None
        n, blob = found
        try:
            return continue_from_blob(model, tokenizer, calibration, blob, token_ids[n:], max_new_tokens,
                                      min_new_tokens, prefix_tokens=n, config=config, times=times,
                                      precision=precision)
        except PrefixCutError as exc:
            warnings.warn(f"{exc}; looking for a stored entry of exactly a prefix", stacklevel=2)
    return None


__all__ = ["compress_tokens", "continue_from_blob", "continue_from_store", "prefill"]
