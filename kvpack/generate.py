"""One generation with a kvpack method, measured: the engine behind ``kvpack generate`` and the demo."""

from __future__ import annotations

from typing import Any

import torch

from .methods import GenerationResult, Method, get_method


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> torch.Tensor:
    """Token ids ``[1, S]`` of ``prompt`` (through the model's chat template with ``chat``)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


@torch.no_grad()
def generate(model, tokenizer, prompt: str, method: str | Method = "puzzle", config: dict[str, Any] | None = None,
             chat: bool = False, max_new_tokens: int = 32, progress: bool = False,
             min_new_tokens: int = 0, budget_scope: str = "whole") -> GenerationResult:
    """Greedy generation of ``prompt`` with a ``method`` cache, with measured KV bytes.

    Args:
        method: a registered method name or a :class:`Method` (``kvpack.methods.get_method``).
        config: the method's config fields (with a name).
        min_new_tokens: generate at least this many tokens (end-of-sequence suppressed until then).
        budget_scope: ``"whole"``: the budget is over the whole cache, a model's sliding-window layers included;
            ``"full_layers"``: over the full-attention layers alone (:mod:`kvpack.hf.whole_budget`).
    """
    method = method if isinstance(method, Method) else get_method(method, **(config or {}))
    ids = encode_prompt(tokenizer, prompt, chat)[0].tolist()
    if not ids:
        raise ValueError("empty prompt: nothing to generate from")
    return method.generate(model, tokenizer, ids, max_new_tokens, min_new_tokens, progress, budget_scope)


__all__ = ["GenerationResult", "encode_prompt", "generate"]
