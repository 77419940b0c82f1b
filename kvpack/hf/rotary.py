"""Where a transformers model keeps its rotary embedding."""

from __future__ import annotations

import torch


def find_rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary-embedding module (the first module named ``*rotary_emb``), or None."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    return None
