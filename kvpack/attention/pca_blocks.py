"""Attention over blocks coded in a per-head principal-component basis (``kvpack::pca_quant_attention``).

:class:`PCABlocks` is what a ``pca_quant`` store hands to attention. Per (side, KV head) the coded
components ``j`` (the leading ones of a basis, widths non-increasing) hold, per block of ``G`` tokens, a
``w_j``-bit code per token with an fp16 scale and zero point per component; a token's vector is
``mean + Σ_j (code_tj · scale_j + zero_j) · basis_j``, keys then rotated by RoPE as the op's ``rope`` mode
says: :data:`ROPE_NONE` (the basis is post-RoPE, or the layer has none), :data:`ROPE_TOKEN` (a pre-RoPE
basis: each key rotated at its own position) or :data:`ROPE_BLOCK` (each key rotated by its block's first
position: the basis holds keys rotated by their offset within the block, so a block's keys share one
rotation and a query can be rotated back once per block and scored in the basis).

The op's default implementation is the PyTorch path (a tile of blocks decoded to fp32, attended densely).
Its CPU kernel (``cpu/csrc/pca_quant.cpp``) reads the codes into registers and never rebuilds a value:
``Σ_t p_t v_t = mean · Σ_t p_t + Σ_j (Σ_t p_t c_tj) basis_j``; keys it rebuilds where the basis is pre-RoPE
(``C`` multiply-adds a key channel) and otherwise scores in the basis: ``q · k_t = q' · mean + Σ_j (q' ·
basis_j) c_tj`` with ``q'`` the query (rotated back by the block's rotation for :data:`ROPE_BLOCK`),
``C`` multiply-adds a key and query row.

Layouts (``S = 2`` sides, keys first; ``C`` = coded components over every (side, head), in the order
side, head, component; ``R`` = code bytes of one block over every (side, head)):

* ``codes [blocks, R]`` uint8: per (side, head) a run of ``G · Σ_j w_j / 8`` bytes, and within it one
  bit stream per width (widest first) of the ``n_w × G`` codes of that width's components,
  component-major (a component's ``G`` tokens together: the kernel widens a stream straight into
  coefficient rows), little-endian within each byte (:func:`~kvpack.ops.bitpack.pack_bitstream`); ``G`` is
  a multiple of 8, so every stream is whole bytes.
* ``scale, zero [blocks, C]`` fp16; ``basis [C, d]`` fp16 (a row per coded component); ``mean [S, H, d]``
  fp32; ``widths [S, H, d]`` uint8 (per component in basis order, non-increasing, 0 = not coded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.bitpack import unpack_bitstream_fast
from ..ops.rope import RotaryTable, apply_rope
from .softmax_merge import PartialAttention, dense_partial, merge_partials

BLOCKS_PER_SPLIT = 16  # coded blocks per (head, split) job of the native kernel
ROPE_NONE, ROPE_TOKEN, ROPE_BLOCK = 0, 1, 2  # the op's ``rope``: where each key's RoPE rotation is taken


def width_groups(widths: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per (side, head), in layout order, the ``(width, count)`` runs of its coded components, widest
    first, from ``widths [S, H, d]`` (non-increasing along the last axis).

    Raises:
        ValueError: widths that increase along a component axis (codes would not be grouped).
    """
    out = []
    for row in widths.reshape(-1, widths.shape[-1]).tolist():
        if any(a < b for a, b in zip(row, row[1:])):
            raise ValueError(f"pca blocks: component widths must be non-increasing, got {row}")
        runs: list[tuple[int, int]] = []
        for w in row:
            if w == 0:
                break
            if runs and runs[-1][0] == w:
                runs[-1] = (w, runs[-1][1] + 1)
            else:
                runs.append((w, 1))
        out.append(runs)
    return out


def component_columns(groups: list[list[tuple[int, int]]]) -> list[slice]:
    """Per (side, head), in layout order, the columns of its coded components in the ``[C, ...]`` tensors
    (``basis`` rows, ``scale`` / ``zero`` columns), from :func:`width_groups`' runs."""
    out, col = [], 0
    for runs in groups:
        coded = sum(count for _, count in runs)
        out.append(slice(col, col + coded))
        col += coded
    return out


@dataclass(frozen=True)
class PCABlocks:
    """A layer's coded history (layouts in the module doc).

    Attributes:
        codes, scale, zero, basis, mean, widths: the tensors, as the store holds them.
        block: tokens per block ``G``.
        rope: the layer's rotary table where the keys' basis is pre-RoPE (or block-relative), else None.
        first_position: position of the first coded token.
        tile_blocks: blocks decoded per tile on the PyTorch path.
        rope_at_block: keys rotated by their block's first position, not their own (:data:`ROPE_BLOCK`).
        skip: ``[H, n]`` int32, ascending per KV head: tokens (counted from the first coded one) attention leaves
            out — a store's exact copies stand for them (``pca_quant``'s salient tokens); None: none.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    basis: torch.Tensor
    mean: torch.Tensor
    widths: torch.Tensor
    block: int
    rope: RotaryTable | None
    first_position: int
    tile_blocks: int = 64
    rope_at_block: bool = False
    skip: torch.Tensor | None = None

    @property
    def n_blocks(self) -> int:
        return self.codes.shape[0]

    @property
    def rope_mode(self) -> int:
        """The op's ``rope`` argument: :data:`ROPE_NONE`, :data:`ROPE_TOKEN` or :data:`ROPE_BLOCK`."""
        if self.rope is None:
            return ROPE_NONE
        return ROPE_BLOCK if self.rope_at_block else ROPE_TOKEN

    def rotation_positions(self, lo: int, hi: int, device) -> torch.Tensor:
        """The position each key of blocks ``[lo, hi)`` is rotated at: its own, or its block's first."""
        G = self.block
        offset = torch.arange((hi - lo) * G, device=device)
        if self.rope_at_block:
            offset = offset // G * G
        return self.first_position + lo * G + offset

    def decoded(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values of blocks ``[lo, hi)`` as ``[H, (hi - lo) · G, d]`` fp32."""
        S, H, d = self.mean.shape
        n, G = hi - lo, self.block
        out = self.mean.new_empty(S, H, n * G, d)
        byte = 0
        groups = width_groups(self.widths)
        for i, (runs, cols) in enumerate(zip(groups, component_columns(groups))):
            side, h = divmod(i, H)
            coded = cols.stop - cols.start
            coef = self.mean.new_empty(n, G, coded)
            j = 0
            for w, count in runs:
                run = G * count * w // 8  # bytes of this width's stream in one block
                stream = self.codes[lo:hi, byte:byte + run].reshape(-1)
                codes = unpack_bitstream_fast(stream, w, n * G * count).reshape(n, count, G)  # component-major
                coef[:, :, j:j + count] = codes.transpose(1, 2).float()
                byte, j = byte + run, j + count
            scale = self.scale[lo:hi, cols].float()[:, None]
            zero = self.zero[lo:hi, cols].float()[:, None]
            basis = self.basis[cols].float()  # [coded, d]
            out[side, h] = (coef * scale + zero).reshape(n * G, coded) @ basis + self.mean[side, h]
        k, v = out[0], out[1]
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(self.rotation_positions(lo, hi, k.device))
            k = apply_rope(k, cos, sin)
        return k, v


def pca_blocks_partials(blocks: PCABlocks, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
    """The PyTorch path: states of ``qg [H, M, d]`` over the blocks, one per tile of decoded blocks."""
    tile = blocks.tile_blocks
    out = []
    for lo in range(0, blocks.n_blocks, tile):
        hi = min(lo + tile, blocks.n_blocks)
        k, v = blocks.decoded(lo, hi)
        mask = None
        if blocks.skip is not None and blocks.skip.numel():
            G, H = blocks.block, k.shape[0]
            rel = blocks.skip.long() - lo * G  # [H, n]
            inside = (rel >= 0) & (rel < (hi - lo) * G)
            mask = torch.ones(H, 1, (hi - lo) * G, dtype=torch.bool, device=k.device)
            heads = torch.arange(H, device=k.device)[:, None].expand_as(rel)
            mask[heads[inside], 0, rel[inside]] = False
        out.append(dense_partial(qg, k.to(qg.dtype), v.to(qg.dtype), scaling, mask))
    return out


def _reference(q, codes, scale, zero, basis, mean, widths, cos, sin, skip, block, rope, first_position, scaling):
    if rope not in (ROPE_NONE, ROPE_TOKEN, ROPE_BLOCK):
        raise ValueError(f"pca_quant_attention: rope must be {ROPE_NONE}, {ROPE_TOKEN} or {ROPE_BLOCK}, got {rope}")
    table = _TableView(cos, sin, q.shape[-1]) if rope != ROPE_NONE else None
    blocks = PCABlocks(codes, scale, zero, basis, mean, widths, block, table, first_position,
                       rope_at_block=rope == ROPE_BLOCK, skip=skip if skip.numel() else None)
    states = pca_blocks_partials(blocks, q, scaling) if blocks.n_blocks else []
    if not states:
        H, M, D = q.shape
        return q.new_full((H, M), float("-inf")), q.new_zeros(H, M), q.new_zeros(H, M, D)
    st = merge_partials(states)
    return st.m, st.l, st.o


class _TableView:
    """``cos_sin`` over the raw tables ``cos, sin [positions, W]`` the op receives (``W = d / 2`` where the
    two halves of a row are equal, as :meth:`~kvpack.ops.rope.RotaryTable.table` keeps them)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
        self.cos, self.sin, self.halves = cos, sin, cos.shape[-1] != head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]
        if self.halves:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos, sin


@torch.library.custom_op("kvpack::pca_quant_attention", mutates_args=())
def pca_quant_attention(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        basis: torch.Tensor, mean: torch.Tensor, widths: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, skip: torch.Tensor, block: int, rope: int, first_position: int,
                        scaling: float, blocks_per_split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]`` fp32 over
    the coded blocks (layouts in the module doc); ``cos, sin [positions, W]`` fp32 are the rotary table, read
    at ``first_position + token`` (``rope`` = :data:`ROPE_TOKEN`) or at each block's first position
    (:data:`ROPE_BLOCK`); empty for :data:`ROPE_NONE`. ``skip [H, n]`` int32 (ascending per head; empty: none): tokens,
    counted from the first coded one, left out. Default implementation: the PyTorch path."""
    return _reference(q, codes, scale, zero, basis, mean, widths, cos, sin, skip, block, rope, first_position,
                      scaling)


@pca_quant_attention.register_fake
def _(q, codes, scale, zero, basis, mean, widths, cos, sin, skip, block, rope, first_position, scaling,
      blocks_per_split):
    H, M, D = q.shape
    return q.new_empty(H, M), q.new_empty(H, M), q.new_empty(H, M, D)


def pca_blocks_partial(blocks: PCABlocks, qg: torch.Tensor, scaling: float, op=None) -> PartialAttention:
    """State of ``qg [H, M, d]`` over the coded blocks in one call of ``kvpack::pca_quant_attention`` (or of
    ``op``, a function with its signature: the Triton launcher under the interpreter)."""
    if blocks.rope is not None:
        cos, sin = blocks.rope.table(blocks.first_position + blocks.n_blocks * blocks.block, qg.device)
    else:
        cos = sin = torch.empty(0, device=qg.device)
    skip = (blocks.skip.to(torch.int32).contiguous() if blocks.skip is not None
            else torch.empty(0, 0, dtype=torch.int32, device=qg.device))
    m, l, o = (op or pca_quant_attention)(qg.float().contiguous(), blocks.codes, blocks.scale, blocks.zero,
                                          blocks.basis, blocks.mean, blocks.widths, cos, sin, skip, blocks.block,
                                          blocks.rope_mode, blocks.first_position, float(scaling),
                                          BLOCKS_PER_SPLIT)
    return PartialAttention(m, l, o)
