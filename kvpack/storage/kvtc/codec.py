"""kvtc as a storage method: a calibrated transform coder from a one-sequence cache to a blob and back.

kvtc (Staniszewski & Łańcucki, ICLR 2026; docs/methods/kvtc.md) does not keep the cache
compressed while attention runs: it turns a filled cache into bytes to be kept or moved and turns
them back into a normal cache later. The pipeline lives beside this file: ``calibration.py`` (PCA
bases and DP bit allocations, once per model), ``coder.py`` (cache ↔ blob), ``session.py``
(prefill → compress → continue).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ...config import MethodConfig, choice, integer, number, option, text
from ...presets import unresolved_auto_calibration
from ...store.format import BACKENDS, Blob
from ..base import DenseKV, StorageCodec
from .calibration import META_FILE, Calibration
from .coder import DECODE_PRECISIONS, compress_cache, decompress_cache
from .session import continue_from_blob, continue_from_store

ZLIB_MAX_LEVEL, ZSTD_MAX_LEVEL = 9, 22
DEFAULT_RATIO = 16.0  # the ratio compressed at when neither ratio nor budget is given


@dataclass(frozen=True)
class KvtcConfig(MethodConfig):
    """kvtc settings for one compression.

    Attributes:
        ratio: target ratio vs bf16 of the coded tokens (one the calibration allocated bits for,
            e.g. 8, 16, 32, 64). ``budget`` (a fraction) may be given instead — the target ratio is
            then ``1 / budget`` — but not both (refused). Neither: :data:`DEFAULT_RATIO`. The ratio
            compressed at is :attr:`target_ratio`.
        calibration: directory written by ``kvpack calibrate`` (required to compress).
        backend: entropy coder: ``zlib`` (DEFLATE, default), ``zstd`` or ``none``.
        level: the entropy coder's level (zlib 0–9, zstd 0–22).
        decode_precision: the inverse PCA's arithmetic when a blob is decoded (not stored in it):
            ``auto`` (default: bf16 operands with fp32 accumulation on CUDA and on CPUs that multiply
            bf16 natively, AMX or AVX-512 BF16; fp32 elsewhere), ``float32`` (the reference) or ``bfloat16``
            (:func:`kvpack.storage.kvtc.coder.inverse_dtype`).
    """

    ratio: float | None = option(None, number(1.0, low_open=True, optional=True),
                                 f"target ratio vs bf16 (a calibrated one; default {DEFAULT_RATIO:g} when no budget)")
    calibration: str | None = option(None, text(optional=True), "calibration directory (kvpack calibrate)")
    backend: str = option("zlib", choice(*BACKENDS), "entropy coder")
    level: int = option(6, integer(minimum=0, maximum=ZSTD_MAX_LEVEL), "entropy coder level (zlib 0-9, zstd 0-22)")
    decode_precision: str = option("auto", choice(*DECODE_PRECISIONS),
                                   "inverse PCA: auto (bf16 where AMX / AVX-512 BF16 / CUDA), float32, bfloat16")

    def check(self) -> None:
        if self.ratio is not None and self.budget is not None:
            raise self.error(f"give ratio ({self.ratio:g}) or budget ({self.budget:g}), not both "
                             f"(a budget b means ratio 1/b)")
        if self.backend == "zlib" and self.level > ZLIB_MAX_LEVEL:
            raise self.error(f"level must be <= {ZLIB_MAX_LEVEL} for zlib, got {self.level}")

    @property
    def target_ratio(self) -> float:
        """The ratio to compress at: ``1 / budget`` when a budget is given, else ``ratio`` (else the default)."""
        if self.budget is not None:
            return round(1.0 / self.budget, 6)
        return self.ratio if self.ratio is not None else DEFAULT_RATIO

    def to_dict(self) -> dict:
        return {**super().to_dict(), "target_ratio": self.target_ratio}

    @classmethod
    def from_dict(cls, data: dict) -> KvtcConfig:
        return super().from_dict({k: v for k, v in data.items() if k != "target_ratio"})


@functools.lru_cache(maxsize=4)
def _load_calibration(path: str, mtime: float) -> Calibration:
    return Calibration.load(path)


def load_calibration(path: str | os.PathLike) -> Calibration:
    """A calibration directory, loaded once per process (reloaded when its files change)."""
    unresolved_auto_calibration(path)
    meta = os.path.join(path, META_FILE)
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{meta} is missing: not a kvtc calibration directory "
                                "(make one with `kvpack calibrate --model M --out DIR`)")
    return _load_calibration(os.path.abspath(path), os.path.getmtime(meta))


class KvtcCodec(StorageCodec):
    """kvtc: cross-layer PCA, DP bit allocation, DEFLATE. See :class:`KvtcConfig`."""

    Config = KvtcConfig

    def calibration(self) -> Calibration:
        if self.config.calibration is None:
            raise ValueError("kvtc needs a calibration: pass --calibration DIR (make one with "
                             "`kvpack calibrate --model M --out DIR`)")
        return load_calibration(self.config.calibration)

    def check_ready(self, compressing: bool = True) -> None:
        calibration = self.calibration()
        if compressing:
            calibration.allocation(self.config.target_ratio)

    def check_model(self, model) -> None:
        self.calibration().check_model(model)

    def dense_bytes(self, blob: bytes) -> int:
        return int(Blob(blob).meta["dense_bf16_bytes"])

    def compress(self, model: torch.nn.Module, cache, token_ids: list[int]) -> bytes:
        return compress_cache(cache, self.calibration(), self.config.target_ratio, token_ids, model=model,
                              backend=self.config.backend, level=self.config.level)

    def decompress(self, model: torch.nn.Module, blob: bytes) -> tuple[DenseKV, list[int]]:
        return decompress_cache(blob, self.calibration(), model, precision=self.config.decode_precision)

    def resume(self, model, tokenizer, blob, new_token_ids, max_new_tokens, min_new_tokens=0, prefix_tokens=None):
        return continue_from_blob(model, tokenizer, self.calibration(), blob, new_token_ids, max_new_tokens,
                                  min_new_tokens, prefix_tokens=prefix_tokens, config=self.describe(),
                                  precision=self.config.decode_precision)

    def resume_from_store(self, store, model, tokenizer, token_ids, max_new_tokens, min_new_tokens=0):
        return continue_from_store(store, model, tokenizer, self.calibration(), token_ids, max_new_tokens,
                                   min_new_tokens, config=self.describe(), precision=self.config.decode_precision)

    def describe(self) -> dict:
        return {**self.config.to_dict(), "calibration_id": self.calibration().calibration_id}
