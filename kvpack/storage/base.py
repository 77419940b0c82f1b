"""The storage family's interface: a codec that turns a one-sequence cache into bytes and back.

Storage methods keep nothing resident: the cache is exact while the model runs and is compressed
only to be kept (a prefix store, disk, a shared server) or moved, then restored to a plain cache.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import MethodConfig
from ..hf.generation import GenerationResult


class PrefixCutError(ValueError):
    """A restored cache that cannot be cut back to its leading tokens (a sliding-window layer)."""


@dataclass
class DenseLayer:
    """One layer of one sequence: ``keys``/``values`` ``[1, kv_heads, T, d]`` (keys post-RoPE)."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class DenseKV:
    """Every layer of one sequence's cache as plain tensors (a sliding-window layer holds its window).

    It reads like a transformers cache (``layers[i].keys``); ``kvpack.hf.dense.to_dynamic_cache``
    turns it into one to continue generating from.
    """

    layers: list[DenseLayer]

    def leading(self, n_tokens: int) -> DenseKV:
        """The cache of the first ``n_tokens`` tokens (views, no copy): how a stored prefix is reused
        for a prompt that shares only its leading tokens.

        Raises:
            ValueError: ``n_tokens`` out of range. PrefixCutError: a layer that holds only the most
                recent tokens (a sliding window shorter than the sequence), whose earlier window is gone.
        """
        total = max(layer.keys.shape[2] for layer in self.layers)
        if not 1 <= n_tokens <= total:
            raise ValueError(f"cannot keep the first {n_tokens} tokens of a cache of {total}")
        for i, layer in enumerate(self.layers):
            if layer.keys.shape[2] != total and n_tokens != total:
                raise PrefixCutError(f"cache layer {i} keeps only the last {layer.keys.shape[2]} of {total} tokens "
                                     f"(a sliding window): it cannot be cut back to the first {n_tokens}")
        return DenseKV([DenseLayer(layer.keys[:, :, :n_tokens], layer.values[:, :, :n_tokens])
                        for layer in self.layers])


class StorageCodec(ABC):
    """A storage method with a validated config.

    Subclasses set ``Config`` and implement :meth:`compress` and :meth:`decompress`; register them with
    in :mod:`kvpack.methods.catalog` (a user's own with ``@register_method("name")``).
    """

    name: ClassVar[str] = ""  # set when registered (kvpack.registry.register)
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    budgeted: ClassVar[bool] = True  # a budget (fraction of the dense bytes) sets the target size

    def __init__(self, config: MethodConfig | None = None, **overrides):
        if config is None:
            config = self.Config(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.Config):
            raise TypeError(f"method {self.name!r} expects a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config

    def check_ready(self, compressing: bool = True) -> None:  # noqa: B027 - a hook: most need nothing
        """Refuse now what would fail after loading a model (e.g. a missing calibration; with
        ``compressing``, also what only compression needs, e.g. bits allocated for its ratio)."""

    def check_model(self, model: torch.nn.Module) -> None:  # noqa: B027 - a hook
        """Refuse a model the codec was not made for (e.g. a calibration of another model)."""

    @abstractmethod
    def dense_bytes(self, blob: bytes) -> int:
        """Bytes of the cache in ``blob`` as dense bf16 (read from the blob, not decoded)."""

    @abstractmethod
    def compress(self, model: torch.nn.Module, cache, token_ids: list[int]) -> bytes:
        """Bytes of a filled one-sequence cache (``cache.layers[i].keys [1, H, T, d]``) of ``token_ids``."""

    @abstractmethod
    def decompress(self, model: torch.nn.Module, blob: bytes) -> tuple[DenseKV, list[int]]:
        """The cache and the token ids it holds, back from :meth:`compress`'s bytes (refused when
        corrupted or made for another model)."""

    @abstractmethod
    def resume(self, model: torch.nn.Module, tokenizer, blob: bytes, new_token_ids: list[int], max_new_tokens: int,
               min_new_tokens: int = 0, prefix_tokens: int | None = None) -> GenerationResult:
        """Greedy generation after the cache in ``blob`` (its first ``prefix_tokens`` tokens, default
        all) plus ``new_token_ids``, measured (``restored_tokens``, ``restore_s``, the blob's bytes)."""

    def resume_from_store(self, store, model: torch.nn.Module, tokenizer, token_ids: list[int],
                          max_new_tokens: int, min_new_tokens: int = 0) -> GenerationResult | None:
        """Generation after ``token_ids``, restoring the longest prefix of them that ``store`` (a
        prefix store) holds for this model and method; None when it holds none."""
        raise NotImplementedError(f"method {self.name!r} keeps no prefix-store entries")

    def describe(self) -> dict[str, Any]:
        """The config, plus what the codec derived (e.g. a calibration's id)."""
        return self.config.to_dict()
