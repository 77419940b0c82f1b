"""fp32 products for a half-precision model's linear layers (kvpack.hf.half_linear)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpack.hf import half_linear
from kvpack.hf.half_linear import (
    MIN_ROWS,
    Fp32ProductsLinear,
    use_fp32_products,
    use_native_products,
    wants_fp32_products,
)


def _layer(dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(96, 53, bias=bias).to(dtype)
    return lin, Fp32ProductsLinear.sharing(lin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_long_inputs_are_the_exact_product_rounded_once(dtype, bias):
    """Each output is the fp64 product (plus bias) rounded to the dtype, or its neighbour where the fp32 sum
    lands across a rounding boundary; almost all are the correctly rounded value."""
    lin, fast = _layer(dtype, bias)
    x = torch.randn(3, 37, 96).to(dtype)  # 111 rows
    exact = x.double() @ lin.weight.double().T
    if bias:
        exact = exact + lin.bias.double()
    rounded = exact.to(dtype)
    out = fast(x)
    assert out.dtype == dtype and out.shape == (3, 37, 53)
    up, down = torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), \
        torch.nextafter(rounded, torch.full_like(rounded, float("-inf")))
    assert ((out == rounded) | (out == up) | (out == down)).all()
    assert (out == rounded).double().mean() > 0.99
    # torch's own half-precision kernel keeps the same contract, so the two agree to a unit in the last place
    native = lin(x)
    assert ((native.double() - out.double()).abs() <= (up.double() - down.double())).all()


def test_short_and_full_precision_inputs_take_torchs_own_kernel():
    lin, fast = _layer(torch.bfloat16)
    short = torch.randn(MIN_ROWS - 1, 96).to(torch.bfloat16)
    assert torch.equal(fast(short), F.linear(short, lin.weight, lin.bias))
    lin32, fast32 = _layer(torch.float32)
    x = torch.randn(40, 96)
    assert torch.equal(fast32(x), lin32(x))


def _tied_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_a_model_keeps_its_parameters_ties_and_keys_and_is_undone():
    model = _tied_llama(torch.bfloat16)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    params = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        native = model(ids).logits.float()
        assert use_fp32_products(model) == linears and linears == 2 * 7 + 1
        assert use_fp32_products(model) == 0  # idempotent
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == params  # same tensors, same keys
        fast = model(ids).logits.float()
    # bf16 rounding differences through two layers: a few bf16 steps of the logits' scale at most
    assert (fast - native).abs().max() <= 4 * 2.0 ** -7 * native.abs().max()
    assert use_native_products(model) == linears
    assert all(type(m) is not Fp32ProductsLinear for m in model.modules())
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == params
    with torch.no_grad():
        assert torch.equal(model(ids).logits.float(), native)


def test_auto_follows_what_the_cpu_multiplies(monkeypatch):
    monkeypatch.setattr(half_linear, "has_bf16_gemm", lambda: False)
    monkeypatch.setattr(half_linear, "has_fp16_gemm", lambda: True)
    assert wants_fp32_products(torch.bfloat16, "cpu")
    assert not wants_fp32_products(torch.float16, "cpu")
    assert not wants_fp32_products(torch.float32, "cpu")
    assert not wants_fp32_products(torch.bfloat16, "cuda")
    assert not wants_fp32_products(torch.bfloat16, "cpu", "native")
    monkeypatch.setattr(half_linear, "has_bf16_gemm", lambda: True)
    assert not wants_fp32_products(torch.bfloat16, "cpu")
    assert wants_fp32_products(torch.bfloat16, "cpu", "float32")
    assert wants_fp32_products(torch.float16, "cpu", "float32")
    with pytest.raises(ValueError, match="half_products must be one of"):
        wants_fp32_products(torch.bfloat16, "cpu", "fast")


@pytest.mark.model
def test_smollm2_in_bf16_predicts_as_with_torchs_kernels():
    """The packaged model in bf16, its linear layers with fp32 products vs torch's bf16 kernels: the same
    next token after a 200-token prompt and a KL far below what any cache method is measured at."""
    from kvpack.hf.models import load_model

    model, tok = load_model("smollm2", torch.bfloat16, half_products="float32")
    assert sum(type(m) is Fp32ProductsLinear for m in model.modules()) == 30 * 7 + 1
    ids = tok(" ".join(["The river runs past the old mill, and the miller counts his sacks."] * 14),
              return_tensors="pt").input_ids[:, :200]
    with torch.no_grad():
        fast = torch.log_softmax(model(ids, logits_to_keep=1).logits[0, -1].float(), -1)
        use_native_products(model)
        native = torch.log_softmax(model(ids, logits_to_keep=1).logits[0, -1].float(), -1)
    assert fast.argmax() == native.argmax()
    assert float((native.exp() * (native - fast)).sum()) < 1e-2
