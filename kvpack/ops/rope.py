"""Rotary position embedding (RoPE) through the model's own rotary module.

Cached keys are post-RoPE. Codecs that work on pre-RoPE keys rotate them back with the negative
angle and rotate reconstructed keys forward at attention time, with the same cos/sin the model
uses (``rotate_half`` convention of Llama, Qwen, Mistral, Gemma; models with a key norm apply it
before RoPE, so the inversion holds for them too).
"""

from __future__ import annotations

import inspect

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last axis (the Llama/NeoX RoPE convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, d]`` by the angles whose cos/sin are ``[T, d]``.

    Computes ``x * cos + rotate_half(x) * sin`` half by half (the same products and sums, so the
    same bits), without materialising ``rotate_half(x)``: several times faster on CPU.
    """
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos[..., :h] - x2 * sin[..., :h], x2 * cos[..., h:] + x1 * sin[..., h:]], dim=-1)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope`: rotation by the negative angle, divided by ``cos² + sin²`` (which is
    1 unless the model folds an attention scaling into cos/sin, as YaRN-style RoPE does)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


class RotaryTable:
    """cos/sin of a model's rotary embedding at integer positions, for one layer.

    Args:
        rotary_module: the model's rotary embedding (``model.model.rotary_emb``); called as
            ``module(x, position_ids)`` or ``module(x, position_ids, layer_type)``.
        head_dim: the attention head dimension; the module must produce cos/sin of that width
            (full-width rotary; partial-rotary models are refused).
        layer_type: passed to modules that take one (Gemma3 keeps one table per layer type).
    """

    def __init__(self, rotary_module: torch.nn.Module, head_dim: int, layer_type: str | None = None):
        self.module = rotary_module
        self.head_dim = head_dim
        self.layer_type = layer_type
        self._takes_layer_type = "layer_type" in inspect.signature(rotary_module.forward).parameters
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), head_dim]`` fp32 for 1-D integer ``positions``."""
        need = int(positions.max().item()) + 1 if positions.numel() else 0
        if self._cache is None or self._cache[0].shape[0] < need:
            size = max(need, 2 * (self._cache[0].shape[0] if self._cache else 0), 256)
            pos = torch.arange(size, device=positions.device)[None]
            probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
            with torch.no_grad():
                if self._takes_layer_type:
                    cos, sin = self.module(probe, pos, self.layer_type)
                else:
                    cos, sin = self.module(probe, pos)
            if cos.shape[-1] != self.head_dim:
                raise ValueError(
                    f"pre-RoPE keys need full-width rotary embeddings: the model's rotary width is "
                    f"{cos.shape[-1]}, head_dim is {self.head_dim}"
                )
            self._cache = (cos[0].float(), sin[0].float())
        cos, sin = self._cache
        return cos[positions], sin[positions]


class LlamaRotary(torch.nn.Module):
    """A stand-alone Llama-style rotary module (``cos, sin = module(x, position_ids)``) for synthetic
    layers in tests and benchmarks, where there is no model to take one from."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()
