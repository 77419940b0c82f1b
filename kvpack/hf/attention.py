"""The ``"kvpack"`` attention function, registered through transformers' ``AttentionInterface``.

For a layer whose cache is a :class:`kvpack.hf.cache.KVPackLayer` (it says so by putting itself in
the attention kwargs during ``cache.update``), attention is computed over the layer's compressed
stores. For every other layer — sliding-window layers, or the model run with an ordinary cache —
it is transformers' own SDPA attention, so switching a model to ``"kvpack"`` changes nothing else.
Registration happens on first use (nothing is patched at import time) and
:func:`restore_attention` puts the model's previous implementation back.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "kvpack"
_PREVIOUS_IMPL = "_kvpack_previous_attn_implementation"


def kvpack_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs):
    """transformers attention-function signature; returns ``(out [B, Q, H, d], None)``."""
    layer = kwargs.pop("kvpack_layer", None) or getattr(key, "_kvpack_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for unsupported in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvpack attention does not support {unsupported!r} (layer {layer.layout.layer_idx})")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(query, key, value, attention_mask, scaling), None


def register_kvpack_attention() -> None:
    """Register ``"kvpack"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, kvpack_attention)
        # Same boolean masks as SDPA: padding information reaches the stores through them.
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_kvpack_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ``"kvpack"`` attention function (remembering the previous one)."""
    register_kvpack_attention()
    current = model.config._attn_implementation
    if current != ATTENTION_NAME:
        setattr(model, _PREVIOUS_IMPL, current)
        model.set_attn_implementation(ATTENTION_NAME)


def restore_attention(model: torch.nn.Module) -> None:
    """Undo :func:`use_kvpack_attention`."""
    previous = getattr(model, _PREVIOUS_IMPL, None)
    if previous is not None:
        model.set_attn_implementation(previous)
        delattr(model, _PREVIOUS_IMPL)
