"""The invariants every method is held to, driven by the registry.

:data:`MATRIX` has one row per registered method: a small config that compresses on the tiny models
(a random Llama-like model, the tiny Gemma3 with sliding-window layers and a tiny Qwen2 with
Qwen2.5-0.5B's GQA 7:1 and attention biases). A method registered
without a row fails :func:`test_matrix_covers_every_registered_method`, so a new method cannot skip
the invariants below:

* resident methods, on the three tiny models: bytes ≤ budget × dense bf16 after the prefill and after
  every decode step; a left-padded batch decodes what each prompt decodes alone; a chunk after
  compression attends exactly as fp64 attention over :meth:`LayerStore.reconstruct`; the cache
  built from one exact prefill (``Method.from_prefill``, the harness's path) equals the one
  compressed live;
* storage methods, on the three tiny models (calibrated in the test): the cache built from one exact
  prefill (``from_prefill``) equals the one ``compress`` + ``resume`` restore — the same bytes and the
  same next token — and a copy of it is independent (a storage method has no resident bytes to hold
  to a budget, nor a batch: its blob is one sequence);
* every method: its config survives a JSON round trip and is hashable (frozen); a budget out of
  range is refused with a message naming the field.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvpack.attention.reference import reference_attention
from kvpack.hf.attach import attach
from kvpack.hf.cache import cache_kwargs
from kvpack.hf.fingerprint import full_attention_layers
from kvpack.hf.prefill import exact_prefill
from kvpack.methods import available_methods, get_method, method_config_class, method_takes_budget
from kvpack.resident import get_resident_method, resident_methods

from .helpers import (
    TINY_KVTC_SETTINGS,
    check_padded_batch_decodes_as_each_prompt_alone,
    tiny_gemma3,
    tiny_kvtc_chunks,
    tiny_llama,
    tiny_qwen2,
)

# method: a small config on the tiny models (head_dim 16, prompts of PROMPT tokens).
MATRIX: dict[str, dict] = {
    "full": {},
    "puzzle": {"page_size": 8, "budget": 0.7},
    # 0.7: on the Gemma 3 model the sliding windows charged to its two full layers leave them 0.57 at 150 tokens
    "puzzle_plus": {"page_size": 8, "budget": 0.7, "observation_window": 8},
    "anchor": {"window": 8, "anchors": 8, "budget": 0.6},
    "anchor_plus": {"window": 8, "anchors": 8, "budget": 0.6},
    "svd": {"page_size": 8, "budget": 0.6},
    "kivi": {"budget": 0.6},
    "pca_quant": {"budget": 0.6, "sinks": 4, "residual": 8, "block": 16},
    "streaming": {"budget": 0.5},
    "h2o": {"budget": 0.5},
    "snapkv": {"budget": 0.5, "window": 8},
    "hf_quantized": {"group_size": 16, "residual_length": 16},  # transformers' QuantizedCache (quanto)
    "kvtc": {"ratio": 4.0},  # storage: compressed on demand (its calibration comes with the call)
    # LMCache's TurboQuant serde (storage); the tiny models' 2 layers all coded (LMCache keeps 2 + 2 raw)
    "lmcache_quant": {"preset": "turboquant_4bit_nc", "skip_first_layers": 0, "skip_last_layers": 0},
    # + the model's kvtc calibration (_config). fp32 GEMMs: decoding contracts the values on the coefficients,
    # reconstruct rebuilds them, and in bf16 the two round different products (test_kvtc_resident bounds that)
    "kvtc_resident": {"ratio": 4.0, "block": 8, "decode_precision": "float32"},
}
CALIBRATED = {"kvtc_resident"}  # resident methods that need the model's kvtc calibration

PROMPT, DECODE = 150, 12
RESIDENT = sorted(m for m in MATRIX if m in resident_methods())
MODELS = {"llama": tiny_llama, "gemma3": tiny_gemma3, "qwen2": tiny_qwen2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def prompt_ids(n: int = PROMPT, seed: int = 11) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_matrix_covers_every_registered_method():
    assert set(MATRIX) == set(available_methods()), "every registered method needs a row in MATRIX"


# -- every method: its config ------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(MATRIX))
def test_config_survives_json_and_is_hashable(method):
    cls = method_config_class(method)
    cfg = cls(**MATRIX[method])
    back = cls.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and hash(back) == hash(cfg)
    with pytest.raises(AttributeError):  # frozen: a config never changes under a store that holds it
        cfg.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize("method", sorted(MATRIX))
@pytest.mark.parametrize("budget", [0.0, -0.25, 1.5, math.nan, math.inf])
def test_a_budget_out_of_range_is_refused_naming_the_field(method, budget):
    with pytest.raises(ValueError, match="budget"):
        get_method(method, **{**MATRIX[method], "budget": budget})
    if method_takes_budget(method) and method != "kvtc":  # kvtc: ratio and budget are exclusive (below)
        get_method(method, **{**MATRIX[method], "budget": 0.75})  # in range: accepted


def test_kvtc_takes_a_ratio_or_a_budget_not_both():
    with pytest.raises(ValueError, match="ratio .* or budget .*not both"):
        get_method("kvtc", ratio=8.0, budget=0.125)
    assert get_method("kvtc", budget=0.125).config.target_ratio == 8.0
    assert get_method("kvtc", ratio=32.0).config.target_ratio == 32.0


# -- resident methods on the tiny models -------------------------------------------------------


def _budget(method: str) -> float | None:
    return get_resident_method(method, **MATRIX[method]).config.budget


def _config(method: str, request) -> dict:
    """``MATRIX[method]``, with the tiny model's kvtc calibration for a method that needs one."""
    if method in CALIBRATED:
        return {**MATRIX[method], "calibration": request.getfixturevalue("calibration_dir")}
    return MATRIX[method]


def _step(model, cache, ids):
    return model(ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]


@pytest.mark.parametrize("method", RESIDENT)
@torch.no_grad()
def test_bytes_within_budget_after_prefill_and_every_decode_step(model, method, request):
    """Over the layers kvpack holds (sliding-window layers are the model's): bytes ≤ budget × dense
    bf16 — of every token where the budget covers decoding, else of the prompt plus the generated
    tokens kept dense."""
    budget = _budget(method)
    with attach(model, method, **_config(method, request)) as cache:
        logits = _step(model, cache, prompt_ids())
        stores = [s for layer in cache.kvpack_layers for s in layer.rows]
        prompt_dense = sum(s.dense_reference_bytes() for s in stores)
        for step in range(DECODE + 1):
            held = sum(layer.nbytes() for layer in cache.kvpack_layers)
            assert held == sum(t.numel() * t.element_size() for s in stores for t in s.tensors().values())
            # nothing outside tensors() is kept: the chunk a store checked is let go after append
            # (holding it would keep the prefill's queries alive, uncounted)
            assert all(s._checked is None for s in stores)
            if budget is not None:
                bound = sum(budget * s.dense_reference_bytes() if s.budget_covers_decode else
                            budget * prompt_dense / len(stores)
                            + step * 2 * s.layout.kv_heads * s.layout.head_dim * s.storage_dtype.itemsize
                            for s in stores)
                assert held <= bound, f"step {step}: {held} > {bound:.0f} (budget {budget})"
            logits = _step(model, cache, logits.argmax(-1, keepdim=True))
        assert cache.get_seq_length() == PROMPT + DECODE + 1


@pytest.mark.parametrize("method", RESIDENT)
@torch.no_grad()
def test_padded_batch_decodes_as_each_prompt_alone(model, method, request):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=g) for n in (PROMPT, PROMPT - 27, PROMPT - 12)]
    check_padded_batch_decodes_as_each_prompt_alone(model, method, _config(method, request), prompts, 8)


@pytest.mark.parametrize("method", RESIDENT)
@torch.no_grad()
def test_a_chunk_after_compression_attends_over_what_reconstruct_returns(model, method, request):
    with attach(model, method, **_config(method, request)) as cache:
        _step(model, cache, prompt_ids())
    compressed = 0
    for layer in cache.kvpack_layers:
        store = layer.rows[0]
        k_hat, v_hat = store.reconstruct()
        H, n, d = k_hat.shape
        assert v_hat.shape == k_hat.shape and H == store.layout.kv_heads and d == store.layout.head_dim
        assert n == store.seq_len or not store.budgeted or n < store.seq_len  # evicting methods keep fewer
        compressed += n < store.seq_len or store.nbytes() < 2 * n * H * d * store.storage_dtype.itemsize
        g = torch.Generator().manual_seed(store.layout.layer_idx)
        q = torch.randn(store.layout.q_heads, 3, d, generator=g)
        k_new, v_new = torch.randn(H, 3, d, generator=g), torch.randn(H, 3, d, generator=g)
        scaling = d ** -0.5
        out = store.attend(q, k_new, v_new, scaling)
        ref = reference_attention(q.double(), torch.cat([k_hat, k_new], 1).double(),
                                  torch.cat([v_hat, v_new], 1).double(), scaling, causal_offset=n)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert method == "full" or compressed, "the store compressed nothing: the check would be vacuous"


@pytest.mark.parametrize("method", RESIDENT)
@torch.no_grad()
def test_cache_from_one_exact_prefill_equals_the_live_one(model, method, request):
    ids = prompt_ids()
    with attach(model, method, **_config(method, request)) as live:
        _step(model, live, ids[:, :-1])
        live_tensors = [{n: t.clone() for n, t in layer.rows[0].tensors().items()} for layer in live.kvpack_layers]
        live_bytes = live.kv_bytes()
        live_next = _step(model, live, ids[:, -1:])
    prepared = get_method(method, **_config(method, request)).from_prefill(model,
                                                                          exact_prefill(model, ids[0, :-1].tolist()))
    assert prepared.kv_bytes == live_bytes
    for layer, want in zip(prepared.cache.kvpack_layers, live_tensors, strict=True):
        got = layer.rows[0].tensors()
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=name)
    twin = prepared.copy()  # the harness decodes twice from one compressed state
    with prepared.active(model) as cache:
        next_logits = _step(model, cache, ids[:, -1:])
    torch.testing.assert_close(next_logits, live_next, rtol=1e-4, atol=1e-4)
    with twin.active(model) as cache:  # the copy is independent: the step above did not touch it
        torch.testing.assert_close(_step(model, cache, ids[:, -1:]), live_next, rtol=1e-4, atol=1e-4)


# -- storage methods on the tiny models ---------------------------------------------------------

STORAGE = sorted(m for m in MATRIX if m not in resident_methods())


class _IdsTokenizer:
    """What generation needs of a tokenizer on a random model: a pad id and a decode."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def calibration_dir(model, tmp_path_factory):
    from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate

    calib = calibrate(model, None, CalibrationSettings(ratios=(MATRIX["kvtc"]["ratio"],), **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(), progress=False)
    directory = tmp_path_factory.mktemp("calibration")
    calib.save(directory)
    return str(directory)


@pytest.mark.parametrize("method", STORAGE)
@torch.no_grad()
def test_storage_cache_from_one_exact_prefill_equals_compress_and_resume(model, request, method):
    assert method in ("kvtc", "lmcache_quant"), "a new storage method needs its own calibration (or none) here"
    ids = prompt_ids(120)[0].tolist()
    config = {**MATRIX[method], "calibration": request.getfixturevalue("calibration_dir")} if method == "kvtc" \
        else MATRIX[method]
    storage = get_method(method, **config)
    if method == "lmcache_quant" and len(full_attention_layers(model)) < model.config.num_hidden_layers:
        with pytest.raises(ValueError, match="sliding-window layers"):  # LMCache's chunks hold every layer alike
            storage.compress(model, ids[:-1])
        return
    blob = storage.compress(model, ids[:-1])
    resumed = storage.resume(model, _IdsTokenizer(), blob, ids[-1:], max_new_tokens=1)
    assert resumed.restored_tokens == len(ids) - 1 and resumed.kv_bytes == len(blob)
    prepared = storage.from_prefill(model, exact_prefill(model, ids[:-1]))
    assert prepared.kv_bytes == len(blob) and prepared.dense_kv_bytes == resumed.dense_kv_bytes
    twin = prepared.copy()
    for cache_of in (prepared, twin):
        with cache_of.active(model) as cache:
            assert _step(model, cache, torch.tensor([ids[-1:]])).argmax(-1).item() == resumed.token_ids[0]
