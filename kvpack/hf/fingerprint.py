"""A model's identity for artifacts made from it (kvtc calibrations and blobs).

A calibration or a compressed cache only makes sense with the model it came from. The fingerprint
combines the architecture, the attention shapes, a hash of the config (without fields that do not
change the model: dtype, paths, library version) and a hash of the weights' names, shapes and a
bf16-rounded sample of their values, so that a fine-tune with the same shapes differs while the same
model loaded in fp32 or bf16 matches.
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_VOLATILE_CONFIG_KEYS = {"dtype", "torch_dtype", "_name_or_path", "transformers_version", "_attn_implementation",
                         "_attn_implementation_internal", "attn_implementation", "use_cache", "quantization_config",
                         "_commit_hash", "_experts_implementation"}
_SAMPLE = 256  # leading values of each weight tensor hashed (bf16-rounded)


def full_attention_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the layers whose transformers cache is a plain (non-sliding) full-attention layer."""
    layers = DynamicCache(config=model.config).layers
    return [i for i, layer in enumerate(layers) if type(layer) is DynamicLayer]


def cache_layer_count(model: torch.nn.Module) -> int:
    """Layers of the cache transformers builds for ``model`` (full-attention and sliding alike)."""
    return len(DynamicCache(config=model.config).layers)


def attention_shape(model: torch.nn.Module) -> dict:
    text = model.config.get_text_config(decoder=True)
    return {
        "layers": int(text.num_hidden_layers),
        "q_heads": int(text.num_attention_heads),
        "kv_heads": int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        "head_dim": int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
    }


def model_fingerprint(model: torch.nn.Module) -> dict:
    """``{"architecture", "layers", "q_heads", "kv_heads", "head_dim", "full_layers", "hash"}``."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(tensor.shape)}".encode())
            sample = tensor.reshape(-1)[:_SAMPLE].to(torch.bfloat16).view(torch.int16).cpu().numpy()
            h.update(sample.tobytes())
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return {"architecture": archs[0], **attention_shape(model), "full_layers": full_attention_layers(model),
            "hash": h.hexdigest()[:32]}
