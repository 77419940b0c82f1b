"""The budget over the whole cache: a model's sliding-window layers charged to the full-attention layers."""

from __future__ import annotations

import pytest
import torch

from kvpack.hf.attach import attach
from kvpack.hf.cache import KVPackCache, cache_kwargs
from kvpack.hf.whole_budget import CacheShape, full_layers_budget

from .helpers import tiny_llama

VOCAB = 128
WINDOW = 64


def _tiny_gemma3(dtype=torch.float32):
    """Gemma 3's pattern at a tiny size: five sliding-window layers (window 64) to one global layer, twice."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                           max_position_embeddings=8192,
                           layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)
    return Gemma3ForCausalLM(cfg).eval().to(dtype)


def _ratios(cache: KVPackCache) -> tuple[float, float]:
    """(whole cache, compressed layers) held bytes ÷ their dense bf16 bytes."""
    layers = cache.kvpack_layers
    compressed = sum(layer.nbytes() for layer in layers) / sum(layer.dense_reference_bytes() for layer in layers)
    return cache.kv_bytes() / cache.dense_kv_bytes(), compressed


@pytest.mark.parametrize("tokens", [100, 3072, 16384, 131072])
@pytest.mark.parametrize("model_bytes", [2, 4])
def test_the_charge_leaves_the_whole_cache_exactly_at_the_budget(tokens, model_bytes):
    shape = CacheShape(full_layers=4, windows=(511,) * 22, model_bytes=model_bytes)
    budget = 0.6 if tokens == 100 else 0.28
    try:
        charged = full_layers_budget(budget, tokens, shape)
    except ValueError:
        assert shape.window_share(tokens) > budget - 0.01  # refused only where the windows leave too little
        return
    held = 22 * min(tokens, 511)
    whole = (charged * 4 * tokens * 2 + held * model_bytes) / ((4 * tokens + held) * 2)
    assert whole == pytest.approx(budget, rel=1e-12) and charged < budget


def test_gemma3_1b_shape_at_3k_is_refused_and_at_16k_gets_the_full_layers_a_smaller_budget():
    """Gemma 3 1B's cache shape (26 layers: 22 sliding with a 512 window, 4 global), bf16."""
    shape = CacheShape(full_layers=4, windows=(511,) * 22, model_bytes=2)
    with pytest.raises(ValueError, match=r"hold 0\.47\d of its dense bf16 bytes .*budget_scope='full_layers'"):
        full_layers_budget(0.28, 3072, shape)
    assert full_layers_budget(0.28, 16384, shape) == pytest.approx(0.1565, abs=1e-4)
    assert full_layers_budget(0.28, 16384, CacheShape(4, (), 2)) == 0.28  # nothing else held: nothing charged


@pytest.mark.parametrize(("method", "budget"), [("pca_quant", 0.28), ("snapkv", 0.28), ("kivi", 0.4)])
def test_a_sliding_window_model_holds_the_budget_over_the_whole_cache(method, budget):
    """3K tokens of an fp32 model; KIVI's smallest configuration needs 0.22 of the bytes, so it asks for more."""
    model = _tiny_gemma3()
    ids = torch.randint(0, VOCAB, (1, 3072), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attach(model, method, budget=budget) as cache:
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        ratios = [_ratios(cache)]
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
            nxt = out.logits[:, -1:].argmax(-1)
            ratios.append(_ratios(cache))
    # fp32 windows (4 bytes an element) of 10 sliding layers: at 0.28 the two global layers get 0.104
    assert cache.full_layers_budget == pytest.approx(full_layers_budget(budget, 3072, cache._shape))
    assert cache.full_layers_budget < budget - 0.1
    held = ratios if cache.kvpack_layers[0].rows[0].budget_covers_decode else ratios[:1]
    assert max(whole for whole, _ in held) <= budget, ratios
    assert all(compressed <= cache.full_layers_budget + 1e-9 for _, compressed in held), ratios


def test_the_full_layers_scope_keeps_the_budget_over_the_compressed_layers_alone():
    model = _tiny_gemma3()
    ids = torch.randint(0, VOCAB, (1, 3072), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attach(model, "pca_quant", budget=0.28, budget_scope="full_layers") as cache:
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    whole, compressed = _ratios(cache)
    assert cache.full_layers_budget == 0.28 and compressed <= 0.28 < whole


def test_a_budget_the_windows_alone_exceed_is_refused_naming_their_share():
    model = _tiny_gemma3()
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attach(model, "pca_quant", budget=0.28) as cache:
        with pytest.raises(ValueError, match=r"budget=0\.28 of the whole cache cannot be met at 400 tokens: the "
                                             r"model's 10 uncompressed layers \(10 sliding-window\) hold"):
            model(ids, use_cache=True, **cache_kwargs(model, cache))


def test_a_model_without_sliding_layers_gets_the_budget_as_asked():
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 1000), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attach(model, "pca_quant", budget=0.28) as cache:
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    whole, compressed = _ratios(cache)
    assert cache.full_layers_budget == 0.28 and whole == compressed <= 0.28


def test_an_unknown_budget_scope_is_refused():
    with pytest.raises(ValueError, match="budget_scope must be one of"):
        KVPackCache(tiny_llama(), "pca_quant", budget_scope="layers")


@torch.no_grad()
def test_a_padded_row_gets_the_budget_its_prompt_gets_alone():
    """Each row is charged from its own real tokens (here 0.21 and 0.18 for its full layers), so a left-padded batch
    decodes as each prompt alone."""
    from .helpers import check_padded_batch_decodes_as_each_prompt_alone

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (2048, 1800)]
    check_padded_batch_decodes_as_each_prompt_alone(_tiny_gemma3(), "pca_quant", {"budget": 0.45}, prompts, 4,
                                                    "gemma3 whole budget")
