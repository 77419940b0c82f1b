"""Greedy generation from a prepared cache, with the prefill timed and decode progress shown."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .cache import cache_kwargs


@dataclass
class GenerationResult:
    """One measured generation, by any method (``kvpack generate`` / ``continue``'s ``--json`` fields,
    plus the new token ids).

    Attributes:
        prompt_tokens: tokens before the generated ones (for a resumed generation: the restored ones
            plus those prefilled over them).
        kv_bytes: what the method holds (a storage method: the blob's size); dense_kv_bytes: the same
            tokens in bf16.
        prefill_s: time to the first generated token (a storage method's compression and restore
            included).
        restored_tokens: tokens restored from stored bytes rather than prefilled (0: none);
            restore_s: the time that took (reading and decoding the bytes); restore_stages: its
            seconds per stage (kvtc: read, verify, inflate, dequantize, inverse_pca, rope, assemble,
            to_cache; empty where not measured).
    """

    text: str
    method: str
    config: dict[str, Any]
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int
    dense_kv_bytes: int
    prefill_s: float
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    restored_tokens: int = 0
    restore_s: float = 0.0
    restore_stages: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.dense_kv_bytes if self.dense_kv_bytes else float("nan")

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run through the model (after the restored ones)."""
        return self.prompt_tokens - self.restored_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text, "method": self.method, "config": self.config, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "kv_bytes": self.kv_bytes, "dense_kv_bytes": self.dense_kv_bytes,
            "ratio": self.ratio, "prefill_s": self.prefill_s, "total_s": self.total_s,
            "restored_tokens": self.restored_tokens, "prefilled_tokens": self.prefilled_tokens,
            "restore_s": self.restore_s, "restore_stages": self.restore_stages,
        }


class StepClock(BaseStreamer):
    """Timestamps of generate's puts: the first is the prompt, the second the first new token (the
    rest of the prompt was prefilled before it), each later one a decode step over the cache."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def decode_steps_ms(self) -> list[float]:
        """Milliseconds of each decode step after the first new token."""
        return [(b - a) * 1e3 for a, b in zip(self.stamps[1:], self.stamps[2:])]


class ProgressStreamer(BaseStreamer):
    """Times the prefill (up to the first generated token) and counts decode steps on stderr.

    ``start`` is when it was created: create it before any work that should count as prefill (a
    decompression, say).
    """

    def __init__(self, n_prompt: int, max_new_tokens: int, enabled: bool):
        self.n_prompt, self.max_new, self.enabled = n_prompt, max_new_tokens, enabled
        self.calls = 0
        self.start = time.perf_counter()
        self.prefill_s: float | None = None
        self.bar = None

    def put(self, value):
        self.calls += 1
        if self.calls == 1:
            if self.enabled:
                print(f"[kvpack] prefill of {self.n_prompt} tokens ...", file=sys.stderr, flush=True)
            return
        if self.calls == 2:
            self.prefill_s = time.perf_counter() - self.start
            if self.enabled:
                from tqdm import tqdm

                print(f"[kvpack] prefill done in {self.prefill_s:.1f} s", file=sys.stderr, flush=True)
                self.bar = tqdm(total=self.max_new, desc="[kvpack] decode", unit="tok", file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.update(1)

    def end(self):
        if self.bar is not None:
            self.bar.close()


def context_limit(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings``; None when the config has none)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_context(model, n_tokens: int, max_new_tokens: int = 0) -> None:
    """Refuse a prompt (or restored prefix + new text) that, with the tokens to generate, does not fit
    the model's context (``max_position_embeddings``), naming both."""
    limit = context_limit(model)
    if not n_tokens:
        raise ValueError("empty prompt: nothing to run the model on")
    if limit is not None and n_tokens + max_new_tokens > limit:
        raise ValueError(f"{n_tokens} tokens + {max_new_tokens} to generate exceed the model's context of {limit} "
                         "tokens")


class StopWhen(StoppingCriteria):
    """Stops generation once ``done(new_token_ids)`` holds (batch 1)."""

    def __init__(self, n_prompt: int, done: Callable[[list[int]], bool]):
        self.n_prompt, self.done = n_prompt, done

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = self.done(input_ids[0, self.n_prompt:].tolist())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def greedy_generate(model, tokenizer, cache, token_ids: list[int], max_new_tokens: int, min_new_tokens: int = 0,
                    streamer: BaseStreamer | None = None,
                    stop_when: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy continuation of ``token_ids`` with ``cache`` (which may already hold a prefix of them:
    only the rest is prefilled); returns the new token ids. ``stop_when(new_ids)``: stop early once
    it holds (checked after every step)."""
    check_context(model, len(token_ids), max_new_tokens)
    ids = torch.tensor([token_ids], device=model.device)
    stopping = StoppingCriteriaList([StopWhen(len(token_ids), stop_when)]) if stop_when is not None else None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=min_new_tokens, do_sample=False, streamer=streamer,
                         pad_token_id=tokenizer.pad_token_id, stopping_criteria=stopping,
                         **cache_kwargs(model, cache))
    return out[0, ids.shape[1]:].tolist()
