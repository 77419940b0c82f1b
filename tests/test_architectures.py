"""Decoder families a user brings: tiny random-weight models from transformers' own config classes (no download),
each with the attention features that break KV-cache code.

The matrix's first columns: FullKV through kvpack's cache and attention generates exactly what transformers
generates with its own cache on every family kvpack serves, and the families it does not serve are refused when
the cache is made, naming the feature (Gemma 2's logit softcap; Mistral's window on every layer); a compressing
method (``pca_quant``, ``kivi``) holds its budget after the prefill and every decode step, or names the feature it
refuses (partial rotary for pre-RoPE keys). Every resident method on every family, padded batches and fp64
attention per family are the matrix's next columns.
"""

from __future__ import annotations

import pytest
import torch

from kvpack.hf.attach import attach
from kvpack.hf.cache import cache_kwargs

VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 4, 2, 16
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_size=HEADS * HEAD_DIM,
              intermediate_size=96, max_position_embeddings=512)


def _build(cls_name: str, model_name: str, gqa: bool = True, **extra):
    import transformers

    def make(seed: int = 0):
        torch.manual_seed(seed)
        config = getattr(transformers, cls_name)(**{**COMMON, **({"num_key_value_heads": KV_HEADS} if gqa else {}),
                                                     **extra})
        model = getattr(transformers, model_name)(config).eval()
        with torch.no_grad():  # random biases where the family has them (the init zeroes them)
            for name, p in model.named_parameters():
                if name.endswith("bias") and "proj" in name:
                    p.normal_(0, 0.3)
        return model

    return make


# family: (what it exercises, factory); REFUSED: the families kvpack refuses by name, with the feature named
REFUSED = {
    "gemma2": "softcap",  # logit softcapping: kvpack's attention does not apply it
    "mistral": "no full-attention layer",  # every layer slides: nothing for kvpack to compress (not yet)
}
FAMILIES = {
    "llama3": ("llama3 RoPE scaling", _build(
        "LlamaConfig", "LlamaForCausalLM", head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("a sliding window on every layer", _build(
        "MistralConfig", "MistralForCausalLM", head_dim=HEAD_DIM, sliding_window=24)),
    "qwen2": ("q/k/v biases", _build("Qwen2Config", "Qwen2ForCausalLM", head_dim=HEAD_DIM)),
    "qwen3": ("q/k norm", _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=HEAD_DIM)),
    "gemma2": ("attention softcap, alternating sliding layers", _build(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=HEAD_DIM, sliding_window=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0)),
    "gemma3": ("sliding and global layers with two RoPE bases, q/k norm", _build(
        "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=HEAD_DIM, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))),
    "phi3": ("fused qkv projection", _build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)),
    "olmo2": ("q/k norm after the projection", _build("Olmo2Config", "Olmo2ForCausalLM")),
    "gpt_neox": ("partial rotary (a quarter of the head)", _build(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", gqa=False, rotary_pct=0.25, use_parallel_residual=True)),
    "stablelm": ("partial rotary, q/k/v biases", _build(
        "StableLmConfig", "StableLmForCausalLM", partial_rotary_factor=0.25, use_qkv_bias=True)),
    "granite": ("attention multiplier, residual and logit scaling", _build(
        "GraniteConfig", "GraniteForCausalLM", attention_multiplier=0.3, residual_multiplier=0.5,
        logits_scaling=2.0, embedding_multiplier=3.0)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_generates_exactly_like_transformers_on_every_family(family):
    model = FAMILIES[family][1]()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    if family in REFUSED:  # refused when the cache is made, naming the feature; nothing runs
        with pytest.raises((ValueError, NotImplementedError), match=REFUSED[family]):
            with attach(model, "full"):
                pass
        return
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        with attach(model, "full") as cache:
            out = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                 **cache_kwargs(model, cache))
    assert torch.equal(out, ref), family


def test_the_matrix_covers_ten_families():
    assert len(FAMILIES) >= 10


# (family, method): the feature a method refuses on a family, named in its message
METHOD_REFUSALS = {
    ("gpt_neox", "pca_quant"): "full-width rotary",  # pre-RoPE keys: a quarter-width rotary is not undone
    ("stablelm", "pca_quant"): "full-width rotary",
}
COMPRESSING = {"pca_quant": {"budget": 0.6, "block": 16, "residual": 8}, "kivi": {"budget": 0.6}}
# Families whose sliding-window layers stay the model's own: the budget covers the full-attention layers only, so
# the whole cache holds more (0.71-0.73 of it at 0.6 here). A known gap, strict: it fails once the budget covers
# the whole cache, and this list must then shrink.
WHOLE_CACHE_GAP = {"gemma3"}


def _family_params():
    for family in sorted(set(FAMILIES) - set(REFUSED)):
        marks = [pytest.mark.xfail(strict=True, reason="the budget does not yet cover sliding-window layers")] \
            if family in WHOLE_CACHE_GAP else []
        yield pytest.param(family, marks=marks, id=family)


@pytest.mark.parametrize("method", sorted(COMPRESSING))
@pytest.mark.parametrize("family", list(_family_params()))
def test_a_compressing_method_holds_its_budget_or_names_the_feature_it_refuses(family, method):
    model = FAMILIES[family][1]()
    budget = COMPRESSING[method]["budget"]
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), attach(model, method, **COMPRESSING[method]) as cache:
        if (family, method) in METHOD_REFUSALS:
            with pytest.raises(ValueError, match=METHOD_REFUSALS[(family, method)]):
                model(ids, use_cache=True, **cache_kwargs(model, cache))
            return
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        ratios = [cache.kv_bytes() / cache.dense_kv_bytes()]
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
            nxt = out.logits[:, -1:].argmax(-1)
            ratios.append(cache.kv_bytes() / cache.dense_kv_bytes())
    assert max(ratios) <= budget, (family, method, ratios)
