"""The transformers integration on tiny random models: exactness, chunks, batches, layer kinds."""

import pytest
import torch

from kvpack import attach
from kvpack.hf.attention import active_cache
from kvpack.hf.cache import KVPackCache, KVPackLayer, cache_kwargs

from .helpers import tiny_gemma3, tiny_llama


@pytest.mark.parametrize("q_heads,kv_heads", [(6, 2), (4, 4), (8, 2)])
def test_full_generates_exactly_like_transformers(q_heads, kv_heads):
    model = tiny_llama(q_heads=q_heads, kv_heads=kv_heads)
    ids = torch.randint(0, 128, (1, 77), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    with attach(model, "full") as cache:
        out = model.generate(ids, max_new_tokens=24, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == 77 + 24 - 1  # the last generated token is never fed back
    assert all(isinstance(layer, KVPackLayer) for layer in cache.layers)


def test_puzzle_full_rank_generates_like_transformers():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    with attach(model, "puzzle", page_size=8, rank_k=8, rank_v=8, storage_dtype="float32") as cache:
        out = model.generate(ids, max_new_tokens=30, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    store = cache.kvpack_layers[0].rows[0]
    assert store.n_pages == (90 + 29 - 8) // 8 - 1 and store.factorizations == store.n_pages


@pytest.mark.parametrize("method,config", [("full", {}), ("puzzle", dict(page_size=8, rank_k=8, rank_v=8,
                                                                             storage_dtype="float32"))])
def test_chunk_after_compression_attends_history_and_itself(method, config):
    """A second multi-token chunk over a (compressed) cache gives the logits of one dense pass."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        with attach(model, method, **config) as cache:
            model(ids[:, :50], **cache_kwargs(model, cache))
            out = model(ids[:, 50:], **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(out, ref[:, 50:], rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 70


def test_low_rank_chunk_matches_reference_over_reconstruction():
    """With real compression, the chunk's attention equals attention over the reconstructed history."""
    from kvpack.attention.reference import reference_attention

    model = tiny_llama(layers=1)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    with attach(model, "puzzle", page_size=8, rank_k=2, rank_v=2, storage_dtype="float32") as cache, torch.no_grad():
        model(ids[:, :45], **cache_kwargs(model, cache))
        store = cache.kvpack_layers[0].rows[0]
        k_hat, v_hat = store.reconstruct()
        q = torch.randn(6, 5, 16)
        k_new, v_new = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        out = store.attend(q, k_new, v_new, 0.25)
    ref = reference_attention(q, torch.cat([k_hat, k_new], 1), torch.cat([v_hat, v_new], 1), 0.25, causal_offset=45)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)


# A left-padded batch decoding as each prompt alone: tests/test_method_matrix.py, for every method.


def test_sliding_window_layers_keep_their_own_cache():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny_gemma3()
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    ref = model.generate(ids, max_new_tokens=15, do_sample=False)
    with attach(model, "full") as cache:
        out = model.generate(ids, max_new_tokens=15, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, KVPackLayer] * 2
    with attach(model, "puzzle", page_size=8, rank_k=8, rank_v=8, storage_dtype="float32", key_rope="pre") as cache:
        out = model.generate(ids, max_new_tokens=15, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)  # full rank, pre-RoPE through Gemma3's per-layer-type rotary tables


def test_key_norm_model_pre_rope_full_rank_exact():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(6))
    ref = model.generate(ids, max_new_tokens=15, do_sample=False)
    with attach(model, "puzzle", page_size=8, rank_k=8, rank_v=8, storage_dtype="float32", key_rope="pre") as cache:
        out = model.generate(ids, max_new_tokens=15, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    assert cache.kvpack_layers[0].rows[0].n_pages > 0


def test_attach_restores_the_attention_implementation_also_on_errors():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(7))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    before = model.config._attn_implementation
    with attach(model, "full") as cache:
        assert model.config._attn_implementation == "kvpack" and active_cache() is cache
        out = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    assert model.config._attn_implementation == before == "sdpa" and active_cache() is None
    with pytest.raises(RuntimeError, match="raised inside the block"):
        with attach(model, "puzzle", page_size=8):
            raise RuntimeError("raised inside the block")
    assert model.config._attn_implementation == before and active_cache() is None
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), ref)  # plain DynamicCache again


def test_attach_nests_and_reuses_a_cache():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(ids).logits
        cache = KVPackCache(model, "full")
        with attach(model, cache=cache):
            model(ids[:, :30], **cache_kwargs(model, cache))
            with attach(model, "full") as inner:  # an inner block has its own cache and gives the outer one back
                model(ids[:, :5], **cache_kwargs(model, inner))
            assert active_cache() is cache and model.config._attn_implementation == "kvpack"
        assert model.config._attn_implementation == "sdpa"
        with attach(model, cache=cache):  # the same cache, attached again later
            out = model(ids[:, 30:], **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(out, ref[:, 30:], rtol=1e-4, atol=1e-4)


def test_cache_refuses_to_run_unattached():
    model = tiny_llama()
    cache = KVPackCache(model, "full")
    assert model.config._attn_implementation == "sdpa"  # building a cache changes nothing of the model
    ids = torch.randint(0, 128, (1, 10))
    with pytest.raises(RuntimeError, match="not attached.*kvpack.attach"):
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
