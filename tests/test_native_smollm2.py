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

pytestmark = pytest.mark.model

NEW_TOKENS = 8
WITH_BACKEND = [m for m in available_methods() if "attention_backend" in method_config_class(m).__dataclass_fields__]


@pytest.fixture(scope="module")
def needle_ids(smollm2):
    prompt, _ = needle_prompt(smollm2[1], n_tokens=2048, depth=0.5, seed=14)
    return smollm2[1](prompt).input_ids


def test_every_resident_method_but_full_has_a_backend_choice():
    # kvtc stores bytes; FullKV is SDPA; hf_quantized is transformers' own QuantizedCache code (the peer)
    resident = [m for m in available_methods() if m not in ("kvtc", "full", "hf_quantized")]
    assert set(resident) <= set(WITH_BACKEND)


@pytest.mark.parametrize("method", WITH_BACKEND)
def test_native_kernels_generate_the_reference_tokens(smollm2, needle_ids, method):
    model, tok = smollm2
    runs = {backend: get_method(method, attention_backend=backend).generate(model, tok, needle_ids, NEW_TOKENS,
                                                                            NEW_TOKENS)
            for backend in ("torch", "auto")}
    assert runs["auto"].token_ids == runs["torch"].token_ids, (method, runs["auto"].text, runs["torch"].text)
    assert runs["auto"].kv_bytes == runs["torch"].kv_bytes
