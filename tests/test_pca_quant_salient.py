"""``pca_quant``'s salient tokens: the ghost trick leaves the other tokens' codes as they were, the tokens the
last queries read are the ones kept, they are exact in the cache, attention on every backend equals attention
over the reconstruction, and the bytes are the tensors held and within the budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpack.attention.softmax_merge import dense_partial, finalize, merge_partials
from kvpack.ops.accounting import dense_bf16_bytes
from kvpack.ops.minmax import quantize_minmax
from kvpack.ops.rope import rope_at
from kvpack.resident.pca_quant import PCAQuantConfig, PCAQuantStore
from kvpack.resident.pca_quant.salient import ghost_codes, ghost_coefficients

from .helpers import anchor_layout, correlated_kv

H, GROUP, D, T = 2, 3, 64, 2000
NEEDLE = (700, 706)  # positions the last queries are made to read


def _prompt(seed=0):
    """Post-RoPE keys and values ``[H, T, D]`` and queries ``[H * GROUP, T, D]`` whose last 32 rows point at the
    needle's keys (they read the needle: the ranking must find it)."""
    layout = anchor_layout(H=H, group=GROUP, d=D, rope=True)
    k, v = correlated_kv(H, T, D, seed=seed)
    k = rope_at(layout.rope, k, 0)
    g = torch.Generator().manual_seed(seed + 1)
    q = 0.3 * torch.randn(H * GROUP, T, D, generator=g)
    u = torch.randn(H, 1, D, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)  # [H, 1, D] a direction only the needle's keys take
    k[:, NEEDLE[0]:NEEDLE[1]] += 12.0 * u
    q[:, -32:] += 2.0 * D ** 0.5 * u.repeat_interleave(GROUP, dim=0)
    return layout, k, v, q


def _store(budget=0.1, salient=0.01, **cfg):
    layout, k, v, q = _prompt()
    store = PCAQuantStore(layout, PCAQuantConfig(budget=budget, salient=salient, **cfg))
    store.append(k, v, q)
    return store, k, v


def test_a_ghost_leaves_the_other_tokens_codes_as_they_were_and_decodes_near_the_mean():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(4, 64, 5, generator=g) + torch.tensor([-3.0, 0.0, 0.5, 1.0, 3.0])  # [blocks, block, comps]
    salient = torch.zeros(4, 64, dtype=torch.bool)
    salient[0, [3, 40]] = True
    salient[2, 0] = True
    salient[3] = True  # a block of salient tokens only
    c[0, 3] += 50.0  # an outlier that would have stretched the block's range
    bits = torch.tensor([8, 6, 4, 3, 2])
    codes, scale, zero = quantize_minmax(ghost_coefficients(c, salient), dim=1, bits=bits)
    ghost = ghost_codes(scale, zero, bits)  # [blocks, 1, C]
    for b in range(3):  # the others' codes, scale and zero point as if the salient rows were not there
        keep = ~salient[b]
        codes_alone, scale_alone, zero_alone = quantize_minmax(c[b, keep], dim=0, bits=bits)
        assert torch.equal(codes[b, keep], codes_alone)
        assert torch.equal(scale[b, 0], scale_alone[0]) and torch.equal(zero[b, 0], zero_alone[0])
    # the ghost: the grid's level nearest 0, inside the range (0 where 0 is inside it, else the nearest end)
    recon = ghost.float() * scale.float() + zero.float()  # [blocks, 1, C]
    top = zero.float() + ((1 << bits) - 1) * scale.float()
    inside = (zero.float() <= 0) & (top >= 0)
    assert torch.all(recon[inside].abs() <= scale.float()[inside] / 2 + 1e-6)
    nearest_end = torch.where(zero.float() > 0, zero.float(), top)
    torch.testing.assert_close(recon[~inside], nearest_end[~inside])
    assert torch.all(ghost[3] == 0)  # an all-salient block: range 0, code 0

def test_the_tokens_the_last_queries_read_are_kept_exact():
    store, k, v = _store()
    assert store.n_salient == 20  # ceil(1% of the 1,920 tokens coded at the first coding)
    pos = store.salient_pos.long()
    for h in range(H):
        assert set(range(*NEEDLE)) <= set(pos[h].tolist())
    k_hat, v_hat = store.reconstruct()
    bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731 - the exact copies' storage dtype
    for h in range(H):
        torch.testing.assert_close(k_hat[h, pos[h]], bf16(k[h, pos[h]]), rtol=0, atol=0)
        torch.testing.assert_close(v_hat[h, pos[h]], bf16(v[h, pos[h]]), rtol=0, atol=0)
    plain, _, _ = _store(salient=0.0)
    err = lambda x: (x - k[:, NEEDLE[0]:NEEDLE[1]]).norm()  # noqa: E731
    assert err(k_hat[:, NEEDLE[0]:NEEDLE[1]]) < 0.05 * err(plain.reconstruct()[0][:, NEEDLE[0]:NEEDLE[1]])


@pytest.mark.parametrize("key_rope", ["auto", "block"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_attention_with_salient_tokens_equals_attention_over_the_reconstruction(backend, key_rope):
    store, _, _ = _store(attention_backend=backend, key_rope=key_rope)
    if backend == "native":
        from kvpack.attention.cpu import native

        if native() is None:
            pytest.skip("the native CPU kernels cannot be built here")
    qg = torch.randn(H, GROUP, D, generator=torch.Generator().manual_seed(3)) * 2
    k_hat, v_hat = store.reconstruct()
    want = finalize(dense_partial(qg.double(), k_hat.double(), v_hat.double(), D ** -0.5))
    got = finalize(merge_partials(store.stored_partials(qg, D ** -0.5)))
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)
    if backend == "torch":  # and in fp64, to the last bits
        got64 = finalize(merge_partials(store.stored_partials(qg.double(), D ** -0.5)))
        torch.testing.assert_close(got64, want, rtol=1e-9, atol=1e-10)


def test_queries_that_read_the_needle_see_it_better_with_salient_tokens():
    _, k, v, q = _prompt()
    exact = finalize(dense_partial(q[::GROUP, -1:].reshape(H, 1, D), k, v, D ** -0.5))
    errors = {}
    for salient in (0.0, 0.01):
        store, _, _ = _store(budget=0.08, salient=salient)
        got = finalize(merge_partials(store.stored_partials(q[::GROUP, -1:].reshape(H, 1, D), D ** -0.5)))
        errors[salient] = float((got - exact).norm() / exact.norm())
    assert errors[0.01] < 0.5 * errors[0.0], errors


@pytest.mark.parametrize("budget", [0.28, 0.15, 0.1])
def test_bytes_with_salient_tokens_are_the_tensors_held_and_within_the_budget(budget):
    store, _, _ = _store(budget=budget, salient=0.02)
    assert store.n_salient > 0 and store.salient_k.shape == (H, store.n_salient, D)
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == store._bytes(store.seq_len, store.widths)
    assert store.nbytes() <= budget * dense_bf16_bytes(store.seq_len, H, D)
    for t in range(150):  # decoding: later blocks code no salient token and the bytes stay within budget
        k, v = correlated_kv(H, 1, D, seed=100 + t)
        q = torch.randn(H * GROUP, 1, D, generator=torch.Generator().manual_seed(t))
        store.append(rope_at(store.layout.rope, k, store.seq_len), v, q)
        assert store.nbytes() <= budget * dense_bf16_bytes(store.seq_len, H, D), t
    assert store.n_blocks > 30 and store.salient_k.shape[1] == store.n_salient


def test_salient_tokens_need_the_prompts_queries_and_a_valid_share():
    layout, k, v, _ = _prompt()
    store = PCAQuantStore(layout, PCAQuantConfig(salient=0.01))
    with pytest.raises(ValueError, match="salient tokens need the prompt's queries"):
        store.append(k, v)
    with pytest.raises(ValueError, match="salient"):
        PCAQuantConfig(salient=0.9)
    with pytest.raises(ValueError, match="salient_pooling"):
        PCAQuantConfig(salient=0.01, salient_pooling=4)
    plain = dataclasses.replace(PCAQuantConfig(), salient=0.0)
    store = PCAQuantStore(layout, plain)
    store.append(k, v)  # no salient tokens: no queries needed
    assert store.n_salient == 0 and "salient_k" not in store.tensors()


@pytest.mark.parametrize("make_model", ["tiny_qwen2", "tiny_llama"])
@torch.no_grad()
def test_salient_tokens_on_a_model_live_and_from_one_exact_prefill(make_model):
    """On a tiny Qwen2 (GQA, attention biases) and Llama: the live cache keeps its salient tokens within the
    budget over decoding, attends as over its reconstruction, and the harness's cache built from one exact
    prefill holds the same tensors and predicts the same next token distribution."""
    from kvpack.attention.reference import reference_attention
    from kvpack.hf.attach import attach
    from kvpack.hf.cache import cache_kwargs
    from kvpack.hf.prefill import exact_prefill
    from kvpack.methods import get_method

    from . import helpers

    model = getattr(helpers, make_model)()
    cfg = dict(budget=0.6, sinks=4, residual=8, block=16, salient=0.05, window=8)
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(11))
    step = lambda cache, x: model(x, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]  # noqa: E731
    with attach(model, "pca_quant", **cfg) as live:
        step(live, ids[:, :-1])
        stores = [layer.rows[0] for layer in live.kvpack_layers]
        assert all(s.n_salient == 7 for s in stores)  # ceil(5% of the 128 prompt tokens coded at the first coding)
        tensors = [{n: t.clone() for n, t in s.tensors().items()} for s in stores]
        for s in stores:  # a chunk after compression attends over what reconstruct returns
            k_hat, v_hat = s.reconstruct()
            g = torch.Generator().manual_seed(s.layout.layer_idx)
            d = s.layout.head_dim
            q = torch.randn(s.layout.q_heads, 3, d, generator=g)
            k_new, v_new = torch.randn(s.layout.kv_heads, 3, d, generator=g), torch.randn(s.layout.kv_heads, 3, d,
                                                                                           generator=g)
            ref = reference_attention(q.double(), torch.cat([k_hat, k_new], 1).double(),
                                      torch.cat([v_hat, v_new], 1).double(), d ** -0.5, causal_offset=k_hat.shape[1])
            got = s.attend(q, k_new, v_new, d ** -0.5)
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    with attach(model, "pca_quant", **cfg) as live:
        logits = step(live, ids[:, :-1])
        live_next = step(live, ids[:, -1:])
        for _ in range(40):
            logits = step(live, logits.argmax(-1, keepdim=True))
            assert live.kv_bytes() <= 0.6 * live.dense_kv_bytes()
    prepared = get_method("pca_quant", **cfg).from_prefill(model, exact_prefill(model, ids[0, :-1].tolist()))
    for layer, want in zip(prepared.cache.kvpack_layers, tensors, strict=True):
        got = layer.rows[0].tensors()
        assert got.keys() == want.keys() and "salient_k" in got
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=name)
    with prepared.active(model) as cache:
        torch.testing.assert_close(step(cache, ids[:, -1:]), live_next, rtol=1e-4, atol=1e-4)
