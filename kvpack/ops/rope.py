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


def rope_at(table: RotaryTable, x: torch.Tensor, first: int) -> torch.Tensor:
    """``x [..., n, d]`` (pre-RoPE keys, positions ``first .. first + n - 1`` along the second-last
    axis) rotated by RoPE at those positions, with the table's cos/sin."""
    n = x.shape[-2]
    cos, sin = table.cos_sin(torch.arange(first, first + n, device=x.device))
    return apply_rope(x, cos, sin)


def unrope_at(table: RotaryTable, x: torch.Tensor, first: int) -> torch.Tensor:
    """Post-RoPE keys ``x [..., n, d]`` (positions ``first .. first + n - 1``) rotated back to pre-RoPE:
    the inverse of :func:`rope_at`."""
    n = x.shape[-2]
    cos, sin = table.cos_sin(torch.arange(first, first + n, device=x.device))
    return invert_rope(x, cos, sin)


def unrope_pages(table: RotaryTable, k: torch.Tensor, first: int) -> torch.Tensor:
    """Post-RoPE keys of whole pages ``k [H, n, P, d]`` (the first at position ``first``) rotated back
    to pre-RoPE (:func:`invert_rope`), for the codecs that factorize pre-RoPE keys."""
    n, P, d = k.shape[-3:]
    cos, sin = table.cos_sin(torch.arange(first, first + n * P, device=k.device))
    return invert_rope(k, cos.reshape(n, P, d), sin.reshape(n, P, d))


class RotaryTable:
    """cos/sin of a model's rotary embedding at integer positions, computed once and shared.

    The model's module is called once for a range of positions (grown by doubling when a later
    position needs it); the result is kept in fp32. In the ``rotate_half`` convention the two halves
    of each row are equal (``emb = cat(freqs, freqs)``) for every rotary type transformers ships;
    when the module's output has equal halves only the first half is kept (half the memory), which
    kernels read directly by position (:meth:`table`). One table serves every layer that uses the
    same module and layer type (:func:`shared_rotary_tables`): one per layer would hold the same
    ``positions x head_dim x 8`` bytes again in every layer.

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
        self._cos: torch.Tensor | None = None  # [size, head_dim / 2] if halves_equal else [size, head_dim]
        self._sin: torch.Tensor | None = None
        self.halves_equal = False

    def _ensure(self, need: int, device: torch.device) -> None:
        """Make the cached table cover positions ``[0, need)``."""
        have = self._cos.shape[0] if self._cos is not None else 0
        if have >= need:
            if self._cos.device != torch.device(device):  # built on another device: follow the caller
                self._cos, self._sin = self._cos.to(device), self._sin.to(device)
            return
        size = max(need, 2 * have, 256)
        pos = torch.arange(size, device=device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=device)
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
        cos, sin = cos[0].float(), sin[0].float()
        h = self.head_dim // 2
        self.halves_equal = bool(torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:]))
        if self.halves_equal:
            cos, sin = cos[:, :h].contiguous(), sin[:, :h].contiguous()
        self._cos, self._sin = cos, sin

    def table(self, need: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached fp32 tables ``cos, sin [size >= need, W]``, row = position, no copy: ``W`` is
        ``head_dim / 2`` when :attr:`halves_equal` (the second half of each row is the first),
        ``head_dim`` otherwise."""
        self._ensure(need, device)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), head_dim]`` fp32 for 1-D integer ``positions``."""
        need = int(positions.max().item()) + 1 if positions.numel() else 0
        self._ensure(need, positions.device)
        cos, sin = self._cos[positions], self._sin[positions]
        if self.halves_equal:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos, sin


def shared_rotary_tables(rotary_module: torch.nn.Module | None, head_dim: int,
                         layer_types: list[str | None]) -> list[RotaryTable | None]:
    """One :class:`RotaryTable` per distinct layer type, shared by the layers of that type (all
    None when the model has no rotary module)."""
    tables: dict[str | None, RotaryTable] = {}
    if rotary_module is None:
        return [None] * len(layer_types)
    for t in layer_types:
        if t not in tables:
            tables[t] = RotaryTable(rotary_module, head_dim, t)
    return [tables[t] for t in layer_types]


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
