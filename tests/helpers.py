"""Helpers the test modules share: tiny random models and synthetic keys/values (no fixtures here)."""

from __future__ import annotations

import torch

from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout


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


def correlated_kv(H, T, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Correlated tokens (low-rank-ish), like real KV.
    base = torch.randn(H, T, 6, generator=g, dtype=dtype) @ torch.randn(H, 6, d, generator=g, dtype=dtype)
    k = base + 0.3 * torch.randn(H, T, d, generator=g, dtype=dtype)
    v = torch.randn(H, T, 4, generator=g, dtype=dtype) @ torch.randn(H, 4, d, generator=g, dtype=dtype)
    v = v + 0.3 * torch.randn(H, T, d, generator=g, dtype=dtype)
    return k, v


def clustered_kv(H, S, d, seed=0, clusters=6, noise=0.1):
    """Tokens near a few directions (scaled), as real KV heads are: anchors can cover them."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(H, clusters, d, generator=g)
    pick = torch.randint(0, clusters, (H, S), generator=g)
    scale = 0.5 + torch.rand(H, S, 1, generator=g)
    x = torch.gather(centers, 1, pick[..., None].expand(-1, -1, d)) * scale
    return x + noise * torch.randn(H, S, d, generator=g)


def anchor_layout(H=2, group=3, d=64, rope=True):
    return LayerLayout(layer_idx=1, kv_heads=H, q_heads=H * group, head_dim=d,
                       rope=RotaryTable(LlamaRotary(d), d) if rope else None)
