"""kvtc's view of a KV cache: one feature vector per token, all layers and heads concatenated.

For token ``t`` the key vector is ``[K_{l0}[h0, t, :], K_{l0}[h1, t, :], ..., K_{l1}[h0, t, :], ...]``
over the full-attention layers ``l`` (in order) and KV heads ``h``: ``p = layers · kv_heads ·
head_dim`` features. Keys are taken *pre-RoPE*: the cached (post-RoPE) keys are rotated back at
their positions with the model's own rotary embedding (RoPE distorts the low-rank structure the
PCA relies on), and rotated forward again when a cache is rebuilt. Values are used as they are.
"""

from __future__ import annotations

import torch

from ...hf.rotary import find_rotary
from ...ops.rope import RotaryTable, apply_rope, invert_rope, shared_rotary_tables


def layer_rotaries(model: torch.nn.Module, layers: list[int], head_dim: int) -> dict[int, RotaryTable | None]:
    """The RoPE table of each listed layer (None for every layer of a model without RoPE)."""

    rotary = find_rotary(model)
    text = model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None)
    tables = shared_rotary_tables(rotary, head_dim, [layer_types[i] if layer_types else None for i in layers])
    return dict(zip(layers, tables))


def to_features(per_layer: list[torch.Tensor], rotaries: list[RotaryTable | None] | None,
                positions: torch.Tensor) -> torch.Tensor:
    """``[T, p]`` fp32 features from per-layer ``[kv_heads, T, d]`` tensors.

    Args:
        per_layer: one tensor per full-attention layer, in layer order.
        rotaries: per-layer RoPE tables to undo (keys), or None (values).
        positions: ``[T]`` positions of the tokens (for the RoPE inversion).
    """
    parts = []
    for i, x in enumerate(per_layer):
        x = x.float()
        if rotaries is not None and rotaries[i] is not None:
            cos, sin = rotaries[i].cos_sin(positions.to(x.device))
            x = invert_rope(x, cos, sin)
        parts.append(x.permute(1, 0, 2).reshape(x.shape[1], -1))  # [T, kv_heads * d]
    return torch.cat(parts, dim=1)


def layer_from_features(x: torch.Tensor, kv_heads: int, head_dim: int, rotary: RotaryTable | None,
                        positions: torch.Tensor) -> torch.Tensor:
    """One layer's ``[T, kv_heads·d]`` features back to ``[kv_heads, T, d]`` (RoPE re-applied with
    ``rotary``; None for values)."""
    t = x.shape[0]
    x = x.reshape(t, kv_heads, head_dim).permute(1, 0, 2)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions.to(x.device))
        x = apply_rope(x, cos, sin)
    return x
