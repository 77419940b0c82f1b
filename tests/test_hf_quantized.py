"""``hf_quantized``: transformers' own QuantizedCache layers under kvpack's protocol (the invariants every
method is held to are in test_method_matrix.py; here what is particular to the peer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvpack.hf.attach import attach
from kvpack.hf.cache import cache_kwargs
from kvpack.methods import get_method
from kvpack.resident import LayerLayout, get_resident_method

from .helpers import tiny_llama


def _layout(H=2, group=3, d=64):
    return LayerLayout(0, H, H * group, d, model_dtype=torch.bfloat16)


@pytest.mark.parametrize("backend,nbits", [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 8)])
def test_bytes_are_the_packed_codes_scales_zero_points_and_residual(backend, nbits):
    """The prompt is quantized whole: codes of ``nbits`` per value plus one scale and one zero point
    (in the model's dtype) per group of 64, and an empty residual; a decode token waits in the residual."""
    if backend == "hqq" and importlib.util.find_spec("hqq") is None:
        pytest.skip("hqq is not installed (the peers extra)")
    H, d, T = 2, 64, 300
    store = get_resident_method("hf_quantized", backend=backend, nbits=nbits).new_store(_layout(H, 3, d))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(H, T, d, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(H * 3, T, d, generator=g).to(torch.bfloat16)
    store.append(k, v, q, store.attend(q, k, v, d ** -0.5))
    values = 2 * H * T * d  # keys and values
    groups = values // 64
    want = values * nbits // 8 + groups * 2 * 2  # codes + bf16 scale and zero point per group
    assert store.nbytes() == want, (store.nbytes(), want, {n: t.shape for n, t in store.tensors().items()})
    k_hat, v_hat = store.reconstruct()
    err = (k_hat - k.float()).abs().max() / k.float().abs().max()
    assert 0 < err < (0.2 if nbits >= 4 else 0.8)  # lossy, and at 4+ bits close
    k1, v1, q1 = k[:, :1], v[:, :1], q[:, :1]
    store.append(k1, v1, q1, store.attend(q1, k1, v1, d ** -0.5))
    assert store.nbytes() == want + 2 * H * d * 2  # the token in the bf16 residual
    assert store.seq_len == T + 1


def test_generation_matches_transformers_quantized_cache():
    """The same tokens as transformers' own QuantizedCache on the same model and prompt."""
    from transformers import QuantizedCache

    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    ref_cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=16, residual_length=8)
    ref = model.generate(ids, past_key_values=ref_cache, **kwargs)
    with attach(model, "hf_quantized", group_size=16, residual_length=8) as cache:
        out = model.generate(ids, **kwargs, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fields,match", [
    ({"budget": 0.5}, "budget 0.5 is not a setting of hf_quantized"),
    ({"backend": "quanto", "nbits": 3}, "nbits must be one of \\(2, 4\\) for the quanto backend"),
    ({"backend": "hqq", "axis_key": -1}, "axis_key must be one of \\(0, 1\\) for the hqq backend"),
    ({"storage_dtype": "bfloat16"}, "storage_dtype must be auto"),
    ({"backend": "fp8"}, "backend must be one of"),
])
def test_bad_settings_are_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        get_method("hf_quantized", **fields)


def test_a_missing_backend_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("optimum") else real(name))
    with pytest.raises(ImportError, match=r'needs optimum-quanto: pip install "kvpack\[peers\]"'):
        get_resident_method("hf_quantized").new_store(_layout())
