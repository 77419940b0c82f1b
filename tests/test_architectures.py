"""Decoder families a user brings: tiny random-weight models from transformers' own config classes (no download),
each with the attention features that break KV-cache code.

The matrix's first columns: FullKV through kvpack's cache and attention generates exactly what transformers
generates with its own cache on every family kvpack serves, and the families it does not serve are refused when
the cache is made, naming the feature (Gemma 2's logit softcap; Mistral's window on every layer); every compressing
resident method holds its budget after the prefill and every decode step (SnapKV and H2O: after the prefill, as
their papers keep generated tokens dense), or names the feature it refuses (a partial rotary, for the methods that
keep keys before RoPE); a left-padded batch decodes what each prompt decodes alone; a chunk attends over each
compressed layer as fp64 attention over the store's reconstruction. The methods that need a calibration of the
model (``kvtc_resident``, the presets with ``calibration=auto``) are held to the same on the method matrix's
three models.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvpack.hf.attach import attach
from kvpack.hf.cache import cache_kwargs
from kvpack.hf.families import BY_MODEL_TYPE, FAMILIES, family_of

from .helpers import check_padded_batch_decodes_as_each_prompt_alone

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


# model_type: a tiny model of the family (what each exercises: kvpack.hf.families, the table these tests hold
# kvpack to and the docs render)
FACTORIES = {
    "llama": _build(
        "LlamaConfig", "LlamaForCausalLM", head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": _build("MistralConfig", "MistralForCausalLM", head_dim=HEAD_DIM, sliding_window=24),
    "qwen2": _build("Qwen2Config", "Qwen2ForCausalLM", head_dim=HEAD_DIM),
    "qwen3": _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=HEAD_DIM),
    "gemma2": _build("Gemma2Config", "Gemma2ForCausalLM", head_dim=HEAD_DIM, sliding_window=24,
                     attn_logit_softcapping=20.0, final_logit_softcapping=30.0),
    "gemma3_text": _build("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=HEAD_DIM, sliding_window=24,
                          layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)),
    "phi3": _build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "olmo2": _build("Olmo2Config", "Olmo2ForCausalLM"),
    "gpt_neox": _build("GPTNeoXConfig", "GPTNeoXForCausalLM", gqa=False, rotary_pct=0.25,
                       use_parallel_residual=True),
    "stablelm": _build("StableLmConfig", "StableLmForCausalLM", partial_rotary_factor=0.25, use_qkv_bias=True),
    "granite": _build("GraniteConfig", "GraniteForCausalLM", attention_multiplier=0.3, residual_multiplier=0.5,
                      logits_scaling=2.0, embedding_multiplier=3.0),
}
REFUSED = {f.model_type: f.refused for f in FAMILIES if f.refused}


def test_every_family_of_the_table_has_a_tiny_model_of_its_type():
    assert set(FACTORIES) == {f.model_type for f in FAMILIES} and len(FAMILIES) >= 10
    for model_type, make in FACTORIES.items():
        model = make()
        assert family_of(model.config) is BY_MODEL_TYPE[model_type], model_type


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_full_generates_exactly_like_transformers_on_every_family(family):
    model = FACTORIES[family]()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    if family in REFUSED:  # refused when the cache is made, naming the feature; nothing runs
        with pytest.raises((ValueError, NotImplementedError), match=re.escape(REFUSED[family])):
            with attach(model, "full"):
                pass
        return
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        with attach(model, "full") as cache:
            out = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                 **cache_kwargs(model, cache))
    assert torch.equal(out, ref), family


def _compressing_methods() -> dict[str, dict]:
    """Every resident method that compresses, with the method matrix's small config (kvtc_resident, which needs a
    kvtc calibration of each model, is held to the same on the matrix's three models)."""
    from kvpack.resident import resident_methods

    from .test_method_matrix import CALIBRATED, MATRIX

    return {m: MATRIX[m] for m in sorted(resident_methods()) if m != "full" and m not in CALIBRATED}


COMPRESSING = _compressing_methods()


def _family_method_params():
    """Every served family with every compressing method (the budget is over the whole cache: a family's
    sliding-window layers included)."""
    for family in sorted(set(FACTORIES) - set(REFUSED)):
        for method in COMPRESSING:
            yield pytest.param(family, method, id=f"{family}-{method}")


@pytest.mark.parametrize(("family", "method"), list(_family_method_params()))
def test_a_compressing_method_holds_its_budget_or_names_the_feature_it_refuses(family, method):
    model = FACTORIES[family]()
    refusal = BY_MODEL_TYPE[family].method_refusals.get(method)
    budget = COMPRESSING[method].get("budget")
    # a family with sliding-window layers: a longer prompt, so the windows charged to the compressed layers leave
    # every method a budget it can reach (at 150 tokens they hold a quarter of this fp32 model's cache)
    tokens = 480 if BY_MODEL_TYPE[family].sliding_layers else 150
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), attach(model, method, **COMPRESSING[method]) as cache:
        if refusal is not None:
            with pytest.raises(ValueError, match=re.escape(refusal)):
                model(ids, use_cache=True, **cache_kwargs(model, cache))
            return
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        ratios = [cache.kv_bytes() / cache.dense_kv_bytes()]
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
            nxt = out.logits[:, -1:].argmax(-1)
            ratios.append(cache.kv_bytes() / cache.dense_kv_bytes())
    # a method whose paper keeps generated tokens dense (SnapKV, H2O) holds its budget over the prompt only
    covers_decode = cache.kvpack_layers[0].rows[0].budget_covers_decode
    held = ratios if covers_decode else ratios[:1]
    if budget is not None:  # hf_quantized's bytes follow its bits: the budget is the method matrix's concern
        assert max(held) <= budget, (family, method, ratios)
    assert all(0 < r < 1 for r in ratios), (family, method, ratios)


def _served_pairs():
    """Every served family with FullKV and every compressing method; a pair whose method refuses the family's
    feature is a named skip (the refusal itself is checked above)."""
    for family in sorted(set(FACTORIES) - set(REFUSED)):
        for method in ["full", *COMPRESSING]:
            refusal = BY_MODEL_TYPE[family].method_refusals.get(method)
            marks = [pytest.mark.skip(reason=f"{method} refuses {family}: {refusal}")] if refusal else []
            yield pytest.param(family, method, marks=marks, id=f"{family}-{method}")


def _config(method: str) -> dict:
    return {} if method == "full" else COMPRESSING[method]


@pytest.mark.parametrize(("family", "method"), list(_served_pairs()))
@torch.no_grad()
def test_a_padded_batch_decodes_as_each_prompt_alone_on_every_family(family, method):
    g = torch.Generator().manual_seed(5)
    lengths = (480, 453) if BY_MODEL_TYPE[family].sliding_layers else (150, 123)  # see the budget test
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    check_padded_batch_decodes_as_each_prompt_alone(FACTORIES[family](), method, _config(method), prompts, 6, family)


@pytest.mark.parametrize(("family", "method"), list(_served_pairs()))
@torch.no_grad()
def test_attention_over_the_store_is_attention_over_its_reconstruction_on_every_family(family, method):
    """After the prefill, a chunk attends over each compressed layer as fp64 attention over what the store's
    ``reconstruct()`` returns: the family's own features (biases, norms, RoPE variants, scaling) live in the keys
    and queries the model hands the store, so the stored form must hold exactly what attention reads."""
    from kvpack.attention.reference import reference_attention

    model = FACTORIES[family]()
    tokens = 480 if BY_MODEL_TYPE[family].sliding_layers else 150  # see the budget test
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(6))
    with attach(model, method, **_config(method)) as cache:
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    for layer in cache.kvpack_layers:
        store = layer.rows[0]
        k_hat, v_hat = store.reconstruct()
        H, n, d = k_hat.shape
        g = torch.Generator().manual_seed(store.layout.layer_idx)
        q = torch.randn(store.layout.q_heads, 3, d, generator=g)
        k_new, v_new = torch.randn(H, 3, d, generator=g), torch.randn(H, 3, d, generator=g)
        out = store.attend(q, k_new, v_new, d ** -0.5)
        ref = reference_attention(q.double(), torch.cat([k_hat, k_new], 1).double(),
                                  torch.cat([v_hat, v_new], 1).double(), d ** -0.5, causal_offset=n)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_load_model_names_a_family_it_has_not_been_tested_on(tmp_path):
    from transformers import GPT2Config

    from kvpack.hf.families import check_tested
    from kvpack.hf.models import load_model

    # a config alone: the family is refused before any weight is read
    GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' \(GPT2LMHeadModel\) has not been tested with kvpack; "
                                         r"tested: .*llama.*allow_untested=True"):
        load_model(str(tmp_path))
    for make in FACTORIES.values():  # every family of the table passes the check
        check_tested(make().config, "tiny")
