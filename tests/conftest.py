"""Shared fixtures: tiny random models for mechanics, the packaged SmolLM2 for end-to-end checks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels are checked on CPU tensors by the Triton interpreter; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def tiny_llama(q_heads: int = 6, kv_heads: int = 2, head_dim: int = 16, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=q_heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(seed: int = 0):
    """A random 4-layer Gemma3 with sliding-window layers (window 16) at 0 and 2, full attention at 1 and 3."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the packaged default model, loaded once per session."""
    from kvpack.hf.models import load_model

    return load_model("smollm2")
