"""The decoder families kvpack is tested on, and what it does with each: one table the architecture matrix
(``tests/test_architectures.py``) holds kvpack to, ``load_model`` checks a model against, and the docs render
(the ``supported-models`` block).

A family is a transformers ``model_type`` with the attention features that break KV-cache code. For each: whether
kvpack's cache serves it at all (or is refused when the cache is made, naming the feature), which methods refuse
which feature, and whether the byte budget still leaves some of its cache out (sliding-window layers kept as the
model keeps them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Family:
    """Attributes:
        model_type: transformers' ``config.model_type``.
        name: the family as users call it.
        features: what its attention does that a cache must get right.
        refused: why kvpack's cache refuses this family, as its message says it (None: served).
        method_refusals: per method, the feature it refuses on this family, as its message names it.
        sliding_layers: it interleaves sliding-window layers, which the model keeps (dense, in its dtype) and the
            budget charges to the full-attention layers (:mod:`kvpack.hf.whole_budget`).
    """

    model_type: str
    name: str
    features: str
    refused: str | None = None
    method_refusals: Mapping[str, str] = field(default_factory=dict)
    sliding_layers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "method_refusals", MappingProxyType(dict(self.method_refusals)))


PARTIAL_ROTARY = "full-width rotary"  # pre-RoPE keys need RoPE over the whole head to undo it
# the methods that keep keys before RoPE (by default): they refuse a partial rotary by name
PRE_ROPE_METHODS = ("anchor", "anchor_plus", "pca_quant", "puzzle_plus")

FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 3 (and SmolLM2)", "llama3 RoPE scaling, GQA"),
    Family("mistral", "Mistral", "a sliding window on every layer",
           refused="no full-attention layer"),
    Family("qwen2", "Qwen2 / Qwen2.5", "q/k/v biases, GQA 7:1"),
    Family("qwen3", "Qwen3", "q/k norm before RoPE"),
    Family("gemma2", "Gemma 2", "attention logit softcap, alternating sliding layers", refused="softcap"),
    Family("gemma3_text", "Gemma 3", "sliding and global layers with two RoPE bases, q/k norm",
           sliding_layers=True),
    Family("phi3", "Phi-3", "fused qkv projection"),
    Family("olmo2", "OLMo 2", "q/k norm after the projection"),
    Family("gpt_neox", "GPT-NeoX / Pythia", "partial rotary (a quarter of the head), no GQA",
           method_refusals=dict.fromkeys(PRE_ROPE_METHODS, PARTIAL_ROTARY)),
    Family("stablelm", "StableLM", "partial rotary, q/k/v biases",
           method_refusals=dict.fromkeys(PRE_ROPE_METHODS, PARTIAL_ROTARY)),
    Family("granite", "Granite", "attention multiplier, residual and logit scaling"),
)

BY_MODEL_TYPE: Mapping[str, Family] = MappingProxyType({f.model_type: f for f in FAMILIES})


def family_of(config) -> Family | None:
    """The tested family of a model's config (its text config's ``model_type``), or None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found = BY_MODEL_TYPE.get(getattr(text, "model_type", None))
    return found or BY_MODEL_TYPE.get(getattr(config, "model_type", None))


def check_tested(config, source: str) -> None:
    """Refuse a model whose family the architecture matrix does not cover, naming it (``ValueError``)."""
    if family_of(config) is None:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
        raise ValueError(f"{source}: model_type {getattr(config, 'model_type', None)!r} ({archs}) has not been tested "
                         f"with kvpack; tested: {', '.join(sorted(BY_MODEL_TYPE))}. load_model(..., "
                         "allow_untested=True) loads it anyway")
