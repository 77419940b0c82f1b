"""KIVI-style asymmetric KV quantization (Liu et al., 2024), bit-packed.

Keys are quantized per channel over groups of ``group_size`` tokens, values per token over groups
of ``min(group_size, head_dim)`` channels, each group with an fp16 scale and zero point
(asymmetric min/max, ``2**bits`` levels). The most recent tokens — the residual, at least
``residual`` of them — stay in full precision; whenever the residual holds ``group_size`` tokens
beyond ``residual``, the oldest ``group_size`` are quantized as one block. Codes are bit-packed
(2 bits: four per byte; 4 bits: two per byte); scales and zero points are counted in the bytes.

``budget`` picks ``bits`` and ``group_size`` (highest fidelity first: 4-bit before 2-bit, small
groups before large) and then the largest residual that keeps the bytes within the budget over
the next block cycle; a budget below 2-bit with 128-token groups is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..attention.cpu import NATIVE_CHOICES
from ..attention.quantized import QuantizedBlocks, kivi_partial, quantized_blocks_partials
from ..config import MethodConfig, choice, integer, option
from ..ops.accounting import dense_bf16_bytes
from ..ops.bitpack import pack_bits
from ..ops.minmax import quantize_minmax
from .base import LayerLayout
from .segmented import SegmentedStore

CANDIDATES = [(4, 32), (4, 64), (4, 128), (2, 32), (2, 64), (2, 128)]  # (bits, group), best quality first
PARAM_BYTES = 2  # fp16 scale and zero point


@dataclass(frozen=True)
class KIVIConfig(MethodConfig):
    """Attributes:
        bits: 2 or 4 (None: from ``budget``, else 2).
        group_size: tokens per key group / channels per value group (None: from ``budget``, else 32).
        residual: full-precision recent tokens (None: from ``budget``, else 128, KIVI's default).
        tile_blocks: quantized blocks dequantized per attention tile (the PyTorch path).
        attention_backend: ``auto`` (the native CPU kernel for CPU tensors where it is built, else
            PyTorch), ``native`` or ``torch`` (the reference path).
    """

    bits: int | None = option(None, choice(2, 4, optional=True), "bits per code (none: from budget, else 2)")
    group_size: int | None = option(None, integer(minimum=1, optional=True), "group size (none: from budget, else 32)")
    residual: int | None = option(None, integer(minimum=0, optional=True),
                                  "full-precision recent tokens (none: from budget, else 128)")
    tile_blocks: int = option(64, integer(minimum=1), "quantized blocks dequantized per attention tile")
    attention_backend: str = option("auto", choice(*NATIVE_CHOICES), "attention path for stored tokens")


def kivi_bytes_per_head(seq_len: int, bits: int, group: int, residual: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one KV head holds after ``seq_len`` tokens (codes, scales, zeros, residual)."""
    blocks = max(0, (seq_len - residual) // group)
    n_q = blocks * group
    v_group = min(group, head_dim)
    codes = n_q * 2 * ((head_dim * bits + 7) // 8)
    key_params = blocks * head_dim * 2 * PARAM_BYTES
    value_params = n_q * (head_dim // v_group) * 2 * PARAM_BYTES
    return codes + key_params + value_params + (seq_len - n_q) * 2 * head_dim * elem_bytes


def kivi_params_for_budget(seq_len: int, cfg: KIVIConfig, head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """``(bits, group, residual)`` for ``cfg.budget`` at ``seq_len`` tokens (see module doc)."""
    return _params_for_budget(seq_len, cfg, head_dim, elem_bytes)


@functools.lru_cache(maxsize=256)  # every layer and row of one prompt asks the same question (configs are frozen)
def _params_for_budget(seq_len: int, cfg: KIVIConfig, head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    budget, fixed_bits, fixed_group, fixed_residual = cfg.budget, cfg.bits, cfg.group_size, cfg.residual
    ref = lambda s: budget * dense_bf16_bytes(s, 1, head_dim)  # noqa: E731

    def fits(bits, group, residual):
        return all(kivi_bytes_per_head(s, bits, group, residual, head_dim, elem_bytes) <= ref(s)
                   for s in range(max(seq_len, 1), seq_len + group))

    for bits, group in CANDIDATES:
        if (fixed_bits is not None and bits != fixed_bits) or (fixed_group is not None and group != fixed_group):
            continue
        if fixed_residual is not None:
            if fits(bits, group, fixed_residual):
                return bits, group, fixed_residual
            continue
        if not fits(bits, group, 0):
            continue
        # Bytes grow with the residual: binary search for the largest residual that fits.
        lo, hi = 0, seq_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(bits, group, mid) else (lo, mid - 1)
        return bits, group, lo
    smallest = min(
        max(kivi_bytes_per_head(s, bits, group, 0, head_dim, elem_bytes) / (s * 2 * head_dim * 2)
            for s in range(max(seq_len, 1), seq_len + group))
        for bits, group in CANDIDATES
    )
    raise ValueError(
        f"kivi: budget {budget} cannot be reached at {seq_len} tokens: the smallest 2-bit configuration "
        f"without residual needs {smallest:.3f} of the dense bytes over a block cycle"
    )


class KIVIStore(SegmentedStore):
    """Quantized blocks (``kq [H, B, G, packed d]``, ``ks/kz [H, B, 1, d]``, ``vq [H, B, G, d/Gv, packed Gv]``,
    ``vs/vz [H, B, G, d/Gv, 1]``) followed by the full-precision residual (the tail)."""

    Config = KIVIConfig

    def __init__(self, layout: LayerLayout, config: KIVIConfig):
        super().__init__(layout, config)
        if layout.head_dim % min(config.group_size or 1, layout.head_dim):
            raise ValueError(f"kivi: head_dim {layout.head_dim} must be a multiple of the value group size")
        self.params: tuple[int, int, int] | None = None
        if config.budget is None:
            self.params = (config.bits or 2, config.group_size or 32,
                           config.residual if config.residual is not None else 128)
        self.blocks: dict[str, torch.Tensor] = {}
        self.n_blocks = 0

    @property
    def sink_capacity(self) -> int:
        return 0

    def history_tensors(self):
        return dict(self.blocks)

    def history_dense(self):
        if not self.n_blocks:
            return self.empty_history()
        return self.dequantized(0, self.n_blocks)

    def resolved_params(self):
        if self.params is None:
            return {}
        return dict(zip(("bits", "group_size", "residual"), self.params))

    def compress(self) -> None:
        d = self.layout.head_dim
        if self.params is None:
            self.params = kivi_params_for_budget(self.seq_len, self.config, d, self.storage_dtype.itemsize)
        bits, group, residual = self.params
        n_new = max(0, (self.tail_k.shape[1] - residual) // group)
        if n_new == 0:
            return
        k, v = self.pop_tail(n_new * group)
        H, vg = self.layout.kv_heads, min(group, d)
        k = k.reshape(H, n_new, group, d)
        v = v.reshape(H, n_new, group, d // vg, vg)
        kq, ks, kz = quantize_minmax(k, dim=-2, bits=bits)  # per channel over the group's tokens
        vq, vs, vz = quantize_minmax(v, dim=-1, bits=bits)  # per token over channel groups
        new = {"kq": pack_bits(kq, bits), "ks": ks, "kz": kz, "vq": pack_bits(vq, bits), "vs": vs, "vz": vz}
        for name, t in new.items():
            self.blocks[name] = t if name not in self.blocks else torch.cat([self.blocks[name], t], dim=1)
        self.n_blocks += n_new

    def blocks_view(self) -> QuantizedBlocks:
        """The quantized history as attention reads it (the store's tensors, in place)."""
        bits, group, _ = self.params
        b = self.blocks
        empty = torch.empty(0, dtype=torch.uint8)
        parts = [b[n] for n in ("kq", "ks", "kz", "vq", "vs", "vz")] if b else [empty] * 6
        return QuantizedBlocks(*parts, bits=bits, group=group, value_group=min(group, self.layout.head_dim),
                               head_dim=self.layout.head_dim, tile_blocks=self.config.tile_blocks)

    def dequantized(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of blocks ``[lo, hi)`` as ``[H, (hi - lo) * group, d]`` fp32."""
        return self.blocks_view().dequantized(lo, hi)

    def stored_partials(self, qg, scaling):
        if self.params is not None and self.backend(qg.device) == "native":
            return [kivi_partial(self.blocks_view(), qg, scaling, (self.tail_k, self.tail_v))]
        return super().stored_partials(qg, scaling)

    def history_partials(self, qg, scaling):
        return quantized_blocks_partials(self.blocks_view(), qg, scaling) if self.n_blocks else []
