"""The one protocol above both method families: what ``generate``, ``eval`` and the CLI talk to.

A :class:`Method` is a resident method (the cache stays compressed while attention runs) or a
storage method (the cache becomes bytes and a plain cache again); callers never ask which. Two
operations cover every use:

* :meth:`Method.generate` — greedy generation of a prompt with the method's cache, measured;
* :meth:`Method.from_prefill` — the method's cache built from one exact prefill (the evaluation
  harness builds every method from the same run), ready to continue from.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MethodConfig
from ..hf.generation import GenerationResult
from ..hf.prefill import ExactPrefill
from ..presets import is_auto_calibration
from .calibrations import resolve_calibration


@dataclass
class PreparedCache:
    """A method's cache holding a compressed prefix, ready to continue from.

    Attributes:
        cache: the transformers cache; use it inside :meth:`active`.
        kv_bytes: what the method holds right after compression (for a storage method: the blob's size).
        dense_kv_bytes: the same tokens in bf16.
        seconds: time to build it from the prefill.
        config: the method's config plus what it derived from the input (e.g. PuzzleKV's ranks).
    """

    cache: Any
    kv_bytes: int
    dense_kv_bytes: int
    seconds: float
    config: dict[str, Any]
    scope: Any = None  # (model, cache -> context manager) that the cache needs while the model runs

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module) -> Iterator[Any]:
        """The block inside which ``model`` may run with :attr:`cache`."""
        with (self.scope(model, self.cache) if self.scope is not None else contextlib.nullcontext()):
            yield self.cache

    def copy(self) -> PreparedCache:
        """An independent copy (the cache deep-copied), to run twice from the same compressed state
        without compressing twice."""
        return dataclasses.replace(self, cache=copy.deepcopy(self.cache))


class Method(ABC):
    """A compression method with a validated config, resident or storage, under one protocol.

    ``generate`` runs greedy generation with the method's cache and returns the generated token ids
    with the measured bytes (``kv_bytes``: the tensors the cache holds; ``dense_kv_bytes``: the same
    tokens in bf16); ``from_prefill`` builds the method's cache from an exact prefill (what the
    evaluation harness uses). Obtain one with :func:`kvpack.get_method`.

    Example:
        >>> import kvpack
        >>> model, tok = kvpack.load_model("smollm2")  # doctest: +SKIP
        >>> ids = tok("The capital of France is").input_ids  # doctest: +SKIP
        >>> result = kvpack.get_method("puzzle_plus", budget=0.3).generate(model, tok, ids, 8)  # doctest: +SKIP
        >>> result.kv_bytes / result.dense_kv_bytes <= 0.3  # doctest: +SKIP
        True
    """

    name: str
    config: MethodConfig
    family: str  # "resident" or "storage" (descriptive: callers never branch on it)
    preset: str | None = None  # the preset it was made from (kvpack.presets), if any

    @property
    def label(self) -> str:
        """What results call it: the preset's name, else the method's."""
        return self.preset or self.name

    def check_ready(self) -> None:  # noqa: B027 - a hook: most methods need nothing ready
        """Refuse now what would fail after loading a model (e.g. a missing calibration)."""

    def for_model(self, model, tokenizer=None, progress: bool = True) -> Method:
        """This method for ``model``: where its config's ``calibration`` is ``"auto"``, the same method with the
        model's own calibration (shipped, cached, or made now with a progress bar:
        :mod:`kvpack.methods.calibrations`); otherwise itself. ``tokenizer`` tokenizes the calibration corpus
        when one must be made (default: the one saved beside the model)."""
        if not is_auto_calibration(getattr(self.config, "calibration", None)):
            return self
        resolved = resolve_calibration(self.name, self.config.to_dict(), model, tokenizer, progress)
        method = self.with_config(type(self.config).from_dict(resolved))
        method.preset = self.preset
        return method

    @abstractmethod
    def with_config(self, config: MethodConfig) -> Method:
        """The same method with another config of its class."""

    @abstractmethod
    def generate(self, model, tokenizer, token_ids: list[int], max_new_tokens: int, min_new_tokens: int = 0,
                 progress: bool = False, budget_scope: str = "whole") -> GenerationResult:
        """Greedy generation after ``token_ids`` with this method's cache, with measured bytes
        (implementations call :func:`kvpack.hf.generation.check_context` first). ``budget_scope``: what a
        resident method's budget covers (:mod:`kvpack.hf.whole_budget`); a storage method codes every layer the
        cache holds and ignores it."""

    @abstractmethod
    def from_prefill(self, model, prefill: ExactPrefill) -> PreparedCache:
        """This method's cache of the prefilled tokens."""
