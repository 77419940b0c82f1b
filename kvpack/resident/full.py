"""FullKV: the identity codec, the reference every method is compared with.

It keeps every key and value dense and computes attention with PyTorch SDPA the way transformers'
own ``sdpa`` attention does for one sequence, so that generation through kvpack's cache and
attention path reproduces plain transformers token for token. ``storage_dtype`` defaults to
``auto`` (the model's dtype); with an fp32 model its bytes are therefore twice the bf16 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import STORAGE_DTYPE_NAMES, MethodConfig, choice, number, option
from ..registry import register_method
from .base import LayerLayout, LayerStore


@dataclass
class FullConfig(MethodConfig):
    """FullKV has no parameters besides the shared ones; ``budget`` must be None or 1."""

    budget: float | None = option(None, number(1.0, 1.0, optional=True), "full keeps every byte: 1 or unset")
    storage_dtype: str = option("auto", choice(*STORAGE_DTYPE_NAMES), "dtype of the dense cache (auto: the model's)")


@register_method("full")
class FullStore(LayerStore):
    """FullKV, the identity: dense keys/values ``[kv_heads, tokens, d]``."""

    Config = FullConfig
    budgeted = False

    def __init__(self, layout: LayerLayout, config: FullConfig):
        super().__init__(layout, config)
        empty = torch.empty(layout.kv_heads, 0, layout.head_dim, dtype=self.storage_dtype)
        self.k, self.v = empty, empty.clone()

    def tensors(self):
        return {"k": self.k, "v": self.v}

    def attend(self, q, k, v, scaling):
        self.check_chunk(q, k, v)
        n_q = q.shape[1]
        keys = torch.cat([self.k.to(q.dtype), k.to(q.dtype)], dim=1).unsqueeze(0)
        values = torch.cat([self.v.to(q.dtype), v.to(q.dtype)], dim=1).unsqueeze(0)
        mask = None
        if n_q > 1 and self.seq_len > 0:
            # Query i sits at position seq_len + i (SDPA's is_causal aligns top-left, so mask explicitly).
            pos = torch.arange(keys.shape[2], device=q.device)
            mask = pos[None, :] <= (self.seq_len + torch.arange(n_q, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys, values, attn_mask=mask, is_causal=n_q > 1 and mask is None, scale=scaling,
            enable_gqa=self.layout.group > 1,
        )
        return out.squeeze(0)

    def append(self, k, v, q=None, out=None):
        self.check_chunk(q, k, v)
        self.k = torch.cat([self.k, k.to(self.storage_dtype)], dim=1)
        self.v = torch.cat([self.v, v.to(self.storage_dtype)], dim=1)
        self.seq_len += k.shape[1]
