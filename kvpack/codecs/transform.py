"""kvtc as a method of ``kvpack generate``: prefill, compress to a blob, decompress, continue.

kvtc (Staniszewski & Łańcucki, ICLR 2026; ../shared/notes/kvtc.md) is a *storage* codec: the cache
is not kept compressed while attention runs, it is turned into bytes to be kept or moved and
turned back into a normal cache later. As a ``generate`` method it runs that round trip on the
prompt — the prompt minus its last token is prefilled exactly, compressed, decompressed, and
generation continues from the restored cache — and reports the blob's size as the KV bytes. The
pipeline itself lives in ``kvpack.kvtc``.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import ClassVar

from .base import Codec, CodecConfig, register_codec, require_int


@dataclass
class KvtcConfig(CodecConfig):
    """kvtc settings for one compression.

    Attributes:
        ratio: target ratio vs bf16 of the coded tokens (one the calibration allocated bits for,
            e.g. 8, 16, 32, 64); ``budget`` (a fraction) may be given instead: ratio = 1 / budget.
        calibration: directory written by ``kvpack calibrate`` (required).
        backend: entropy coder: ``zlib`` (DEFLATE, default), ``zstd`` or ``none``.
        level: the entropy coder's level.
    """

    VERSION: ClassVar[int] = 1

    ratio: float = 16.0
    calibration: str | None = None
    backend: str = "zlib"
    level: int = 6

    def validate(self) -> None:
        super().validate()
        if self.budget is not None:
            self.ratio = round(1.0 / self.budget, 6)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not math.isfinite(self.ratio) \
                or self.ratio <= 1.0:
            raise ValueError(f"ratio must be a number > 1, got {self.ratio!r}")
        from ..store.format import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        require_int(self, "level", minimum=0, maximum=22)


@functools.lru_cache(maxsize=4)
def _load_calibration(path: str, mtime: float):
    from ..kvtc.calibration import Calibration

    return Calibration.load(path)


def load_calibration(path: str | os.PathLike):
    """A calibration directory, loaded once per process (reloaded when its files change)."""
    from ..kvtc.calibration import META_FILE

    meta = os.path.join(path, META_FILE)
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{meta} is missing: not a kvtc calibration directory "
                                "(make one with `kvpack calibrate --model M --out DIR`)")
    return _load_calibration(os.path.abspath(path), os.path.getmtime(meta))


@register_codec("kvtc")
class KVTC(Codec):
    """Storage codec: the whole cache round-trips through a kvtc blob between prefill and decode."""

    Config = KvtcConfig
    storage = True

    def calibration(self):
        if self.config.calibration is None:
            raise ValueError("kvtc needs a calibration: pass --calibration DIR (make one with "
                             "`kvpack calibrate --model M --out DIR`)")
        return load_calibration(self.config.calibration)

    def new_store(self, layout):
        raise ValueError("kvtc is a storage codec: it does not hold a resident cache (use kvpack.kvtc or "
                         "`kvpack generate --method kvtc`)")

    def roundtrip_cache(self, model, cache, token_ids: list[int]):
        """Compress a filled one-sequence ``DynamicCache`` and decompress it again.

        Returns:
            ``(restored cache, blob bytes)``.
        """
        from ..kvtc.coder import compress_cache, decompress_cache

        calibration = self.calibration()
        blob = compress_cache(cache, calibration, self.config.ratio, token_ids, model=model,
                              backend=self.config.backend, level=self.config.level)
        restored, _ = decompress_cache(blob, calibration, model)
        return restored, len(blob)

    def roundtrip_generate(self, model, tokenizer, token_ids: list[int], max_new_tokens: int,
                           min_new_tokens: int = 0) -> dict:
        """Prefill ``token_ids[:-1]``, compress, decompress, generate after ``token_ids``.

        Returns the fields of a :class:`kvpack.generate.GenerationResult`.
        """
        from ..kvtc.session import compress_tokens, continue_from_blob

        calibration = self.calibration()
        if len(token_ids) < 2:
            raise ValueError("kvtc needs a prompt of at least 2 tokens (a prefix to compress and one to continue)")
        start = time.perf_counter()
        blob = compress_tokens(model, calibration, token_ids[:-1], self.config.ratio, self.config.backend,
                               self.config.level)
        compress_s = time.perf_counter() - start
        cont = continue_from_blob(model, tokenizer, calibration, blob, token_ids[-1:], max_new_tokens, min_new_tokens)
        config = self.config.to_dict()
        config.update(calibration_id=calibration.calibration_id, compress_s=compress_s,
                      decompress_s=cont.decompress_s)
        return {"text": cont.text, "config": config, "new_tokens": len(cont.token_ids), "kv_bytes": len(blob),
                "dense_kv_bytes": cont.dense_bf16_bytes, "prefill_s": compress_s + cont.first_token_s,
                "total_s": time.perf_counter() - start, "token_ids": cont.token_ids}
