"""End to end on SmolLM2: the native CPU kernels generate what the PyTorch reference path generates.

Every method with an ``attention_backend`` runs greedily on a 2K needle prompt twice — once with
``attention_backend="torch"`` (the reference) and once with ``"auto"`` (on CPU: the native kernels where
the method has one) — and must produce the same tokens. FullKV (no backend; SDPA over a growing buffer)
is checked token for token against transformers' own generation in test_smollm2.py.
"""

from __future__ import annotations

import pytest

from kvpack.methods import available_methods, get_method, method_config_class
from kvpack.prompts import needle_prompt
from kvpack.resident import resident_methods

pytestmark = pytest.mark.model

NEW_TOKENS = 8
WITH_BACKEND = [m for m in available_methods() if "attention_backend" in method_config_class(m).__dataclass_fields__]


@pytest.fixture(scope="module")
def needle_ids(smollm2):
    prompt, _ = needle_prompt(smollm2[1], n_tokens=2048, depth=0.5, seed=14)
    return smollm2[1](prompt).input_ids


def test_every_resident_method_but_full_has_a_backend_choice():
    # storage methods (kvtc, lmcache_quant) store bytes; FullKV is SDPA; hf_quantized is transformers' own
    # QuantizedCache code (the peer)
    resident = [m for m in resident_methods() if m not in ("full", "hf_quantized")]
    assert set(resident) <= set(WITH_BACKEND)


@pytest.fixture(scope="module")
def smollm2_kvtc(smollm2, tmp_path_factory):
    """``kvtc_resident``'s config on SmolLM2: a small kvtc calibration (8K tokens, 512 components, 16x) made here."""
    from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate

    settings = CalibrationSettings(tokens=8192, pca_dim=512, dp_samples=2048, ratios=(16.0,))
    directory = tmp_path_factory.mktemp("smollm2-kvtc")
    calibrate(smollm2[0], smollm2[1], settings, progress=False).save(directory)
    return {"calibration": str(directory), "ratio": 16.0}


@pytest.mark.parametrize("method", WITH_BACKEND)
def test_native_kernels_generate_the_reference_tokens(smollm2, needle_ids, method, request):
    model, tok = smollm2
    config = request.getfixturevalue("smollm2_kvtc") if method == "kvtc_resident" else {}
    runs = {backend: get_method(method, attention_backend=backend, **config).generate(model, tok, needle_ids,
                                                                                      NEW_TOKENS, NEW_TOKENS)
            for backend in ("torch", "auto")}
    assert runs["auto"].token_ids == runs["torch"].token_ids, (method, runs["auto"].text, runs["torch"].text)
    assert runs["auto"].kv_bytes == runs["torch"].kv_bytes


def test_bf16_products_keep_puzzle_plus_tokens_and_logits(smollm2, needle_ids):
    """``puzzle_plus``'s default INT4 pre-RoPE pages with ``dot_precision="auto"`` (bf16 products where the
    CPU has AVX-512 BF16) against ``float32``: the same greedy tokens, and at every step (both fed the
    float32 run's tokens) a next-token KL divergence within 1e-3 nats (measured on this prompt: at most
    6.4e-5; 0 at the first token, which the prefill computes without the kernels)."""
    import torch

    from kvpack import attach
    from kvpack.attention import cpu
    from kvpack.hf.cache import cache_kwargs

    if not cpu.bf16_products_available():
        pytest.skip("this CPU has no AVX-512 BF16: both settings compute in fp32")
    model, _ = smollm2
    logits, fed = {}, []  # fed: the float32 run's greedy tokens, fed to both runs
    for precision in ("float32", "auto"):
        steps = []
        with torch.no_grad(), attach(model, "puzzle_plus", dot_precision=precision) as cache:
            out = model(torch.tensor([needle_ids]), **cache_kwargs(model, cache))
            steps.append(out.logits[0, -1].double())
            for i in range(NEW_TOKENS - 1):
                if precision == "float32":
                    fed.append(int(steps[-1].argmax()))
                out = model(torch.tensor([[fed[i]]]), **cache_kwargs(model, cache))
                steps.append(out.logits[0, -1].double())
        logits[precision] = torch.stack(steps)
    ref, got = logits["float32"].log_softmax(-1), logits["auto"].log_softmax(-1)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert kl.max() <= 1e-3, kl
    assert not torch.equal(ref, got)  # the bf16 path ran
