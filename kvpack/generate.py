"""One generation with a kvpack cache, measured: the engine behind ``kvpack generate`` and the demo."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from .codecs.base import Codec, get_codec
from .hf.cache import KVPackCache, cache_kwargs


class _ProgressStreamer(BaseStreamer):
    """Reports the prefill (its first ``put``) and counts decode steps on stderr."""

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


@dataclass
class GenerationResult:
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

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.dense_kv_bytes if self.dense_kv_bytes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text, "method": self.method, "config": self.config, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "kv_bytes": self.kv_bytes, "dense_kv_bytes": self.dense_kv_bytes,
            "ratio": self.ratio, "prefill_s": self.prefill_s, "total_s": self.total_s,
        }


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> torch.Tensor:
    """Token ids ``[1, S]`` of ``prompt`` (through the model's chat template with ``chat``)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def resolved_config(codec: Codec, cache: KVPackCache) -> dict[str, Any]:
    """The codec's config plus what its stores decided from the input (e.g. PuzzleKV's ranks)."""
    config = codec.config.to_dict()
    for layer in cache.kvpack_layers:
        for store in layer.rows:
            config.update(store.resolved_params())
            return config
    return config


@torch.no_grad()
def generate(model, tokenizer, prompt: str, method: str | Codec = "puzzle", config: dict[str, Any] | None = None,
             chat: bool = False, max_new_tokens: int = 32, progress: bool = False,
             min_new_tokens: int = 0) -> GenerationResult:
    """Greedy generation of ``prompt`` with a ``method`` cache, with measured KV bytes.

    Args:
        method: a registered codec name or a :class:`Codec`.
        config: codec config fields (with a name).
        min_new_tokens: generate at least this many tokens (end-of-sequence suppressed until then).
    """
    codec = method if isinstance(method, Codec) else get_codec(method, **(config or {}))
    ids = encode_prompt(tokenizer, prompt, chat).to(model.device)
    if codec.storage:
        fields = codec.roundtrip_generate(model, tokenizer, ids[0].tolist(), max_new_tokens, min_new_tokens)
        return GenerationResult(method=codec.name, prompt_tokens=ids.shape[1], **fields)
    cache = KVPackCache(model, codec)
    streamer = _ProgressStreamer(ids.shape[1], max_new_tokens, progress)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=min_new_tokens, do_sample=False,
                         streamer=streamer, **cache_kwargs(model, cache), pad_token_id=tokenizer.pad_token_id)
    total = time.perf_counter() - start
    new = out[0, ids.shape[1]:]
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True), method=codec.name,
        config=resolved_config(codec, cache), prompt_tokens=ids.shape[1], new_tokens=int(new.numel()),
        kv_bytes=cache.kv_bytes(), dense_kv_bytes=cache.dense_kv_bytes(),
        prefill_s=streamer.prefill_s if streamer.prefill_s is not None else total, total_s=total,
        token_ids=new.tolist(),
    )
