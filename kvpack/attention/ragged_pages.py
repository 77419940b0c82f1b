"""Attention over factorized KV pages whose ranks differ per (KV head, page, side) — ``puzzle_plus``.

Storage (one side, keys or values, of one layer; :class:`RaggedFactors`): every (KV head ``h``,
page ``n``) entry ``e`` holds ``L_e [P, r_e]`` and ``R_e [r_e, d]`` back to back in two flat buffers,
no padding: ``L_e`` starts at element ``o_e · P`` of ``left`` and ``R_e`` at ``o_e · d`` of ``right``,
where the *rank offset* ``o_e`` is the sum of the ranks stored before ``e``. Entries are stored in
*rank buckets* — sorted by (rank, page, head) — so the ``n_r`` entries of rank ``r`` are one
contiguous slab, read as ``L [n_r, P, r]``, ``R [n_r, r, d]`` views. Per position the tables
``rank [N, H]`` and ``offset [N, H]`` give an entry's rank and rank offset (what the Triton kernel
reads page by page); ``order [E]`` lists the entries' positions ``n·H + h`` in storage order (what
the PyTorch path reads bucket by bucket). INT4 form: ``left``/``right`` are packed nibbles (ranks
are even, so an entry's codes fill whole bytes: ``L_e`` at byte ``o_e · P / 2``, ``R_e`` at
``o_e · d / 2``), with fp16 column scales ``left_scale [Σ r]`` (one per column of ``L_e``, at
``o_e``) and ``right_scale [N, H, d]`` (one per column of ``R_e``, by position).

The PyTorch path (:func:`ragged_pages_partials`) scores each key bucket into one logit tensor
``[H, M, N, P]`` (``s = (q R_Kᵀ) L_Kᵀ``, scattered to the bucket's (head, page) slots), takes one
softmax state over it, and adds each value bucket's ``(p L_V) R_V`` back into the output with
``index_add_`` over heads — the dense ``K̂``/``V̂`` of a page never exist (except for pre-RoPE keys,
whose rotation depends on the position inside the page: a bucket's keys are then rebuilt, rotated
and contracted, bucket by bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.int4 import unpack_nibbles
from ..ops.rope import RotaryTable, apply_rope
from .softmax_merge import PartialAttention, state_from_logits

# Logit elements (H x M x N x P) above which the PyTorch path splits the pages into tiles.
MAX_TILE_LOGITS = 1 << 24


@dataclass(frozen=True)
class Bucket:
    """The entries of one rank: ``count`` entries from storage index ``first``, rank offset ``offset``."""

    rank: int
    first: int
    count: int
    offset: int


@dataclass(frozen=True)
class RaggedFactors:
    """One side's factors of a layer's pages at per-(head, page) ranks (layout in the module doc).

    Attributes:
        left: flat ``[Σ P r]`` float, or ``[Σ P r / 2]`` uint8 packed (INT4).
        right: flat ``[Σ r d]`` float, or ``[Σ r d / 2]`` uint8 packed.
        rank: ``[N, H]`` int16, each entry's rank (>= 1).
        offset: ``[N, H]`` int32, each entry's rank offset.
        order: ``[E = N H]`` int32, the positions ``n·H + h`` in storage order.
        buckets: the rank buckets in storage order (plain ints, derived from ``rank`` and ``order``;
            their tensor copy is :attr:`bucket_table`, counted with the store's bytes).
        bucket_table: ``[B, 4]`` int32 rows ``(rank, first, count, offset)``.
        left_scale: INT4 only, ``[Σ r]`` fp16.
        right_scale: INT4 only, ``[N, H, d]`` fp16.
    """

    left: torch.Tensor
    right: torch.Tensor
    rank: torch.Tensor
    offset: torch.Tensor
    order: torch.Tensor
    buckets: tuple[Bucket, ...]
    bucket_table: torch.Tensor
    left_scale: torch.Tensor | None = None
    right_scale: torch.Tensor | None = None

    @property
    def int4(self) -> bool:
        return self.left_scale is not None

    @property
    def n_pages(self) -> int:
        return self.rank.shape[0]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor held, named ``prefix + field``."""
        out = {f"{prefix}left": self.left, f"{prefix}right": self.right, f"{prefix}rank": self.rank,
               f"{prefix}offset": self.offset, f"{prefix}order": self.order, f"{prefix}buckets": self.bucket_table}
        if self.int4:
            out[f"{prefix}left_scale"] = self.left_scale
            out[f"{prefix}right_scale"] = self.right_scale
        return out

    def codes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """INT4 only: every code of ``left`` and ``right`` unpacked at once, as fp32 ``code − 8``
        (flat ``[Σ P r]``, ``[Σ r d]``; the scales are applied per bucket). One unpack per side
        instead of one per bucket; a transient the size of the side's factors in fp32."""
        if not self.int4:
            return None
        return _codes(self.left), _codes(self.right)

    def bucket_factors(self, b: Bucket, page_size: int, head_dim: int,
                       codes: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [count] int64 positions n·H + h, L [count, P, r], R [count, r, d])`` of bucket ``b``:
        views of the flat buffers for float factors, dequantized fp32 for INT4 (from ``codes``, this
        side's :meth:`codes`, when given; else the bucket's codes alone are unpacked)."""
        P, d, r, c, o = page_size, head_dim, b.rank, b.count, b.offset
        ids = self.order[b.first:b.first + c].long()
        if not self.int4:
            return ids, self.left[o * P:(o + c * r) * P].view(c, P, r), self.right[o * d:(o + c * r) * d].view(c, r, d)
        if codes is not None:
            left_codes = codes[0][o * P:(o + c * r) * P]
            right_codes = codes[1][o * d:(o + c * r) * d]
        else:  # this bucket's codes only
            left_codes = _codes(self.left[o * P // 2:(o + c * r) * P // 2])
            right_codes = _codes(self.right[o * d // 2:(o + c * r) * d // 2])
        left = left_codes.view(c, P, r) * self.left_scale[o:o + c * r].view(c, 1, r).float()
        right_scale = self.right_scale.reshape(-1, d)[ids].unsqueeze(1).float()  # [c, 1, d]
        right = right_codes.view(c, r, d) * right_scale
        return ids, left, right


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """Flat packed nibbles → fp32 ``code − 8`` (two per byte)."""
    return unpack_nibbles(packed, 2 * packed.numel()).float().sub_(8)


def make_buckets(rank_in_order: torch.Tensor) -> tuple[tuple[Bucket, ...], torch.Tensor]:
    """Buckets of entries stored in rank order: ``rank_in_order [E]`` (non-decreasing) →
    ``(buckets, bucket_table [B, 4] int32)``."""
    ranks, counts = torch.unique_consecutive(rank_in_order.long(), return_counts=True)
    firsts = torch.cumsum(counts, 0) - counts
    offsets = torch.cumsum(ranks * counts, 0) - ranks * counts
    table = torch.stack([ranks, firsts, counts, offsets], dim=1).to(torch.int32)
    return tuple(Bucket(*row) for row in table.tolist()), table


# The tensors of ``kvpack::puzzle_ragged_attention``'s ``pages`` operand, in order
# (:meth:`RaggedPuzzlePages.operands` flattens a view into them; the Triton launcher reads them by these names
# and the C++ kernel's ``RaggedOperands`` by these positions): the keys' and values' flat factor buffers
# (``lk``, ``rk``, ``lv``, ``rv``) and their INT4 scales (empty in float form), the per-position rank and
# rank-offset tables, the RoPE tables (empty for post-RoPE keys), the dense sink and tail.
RAGGED_OPERANDS = (
    "lk", "rk", "lv", "rv", "lks", "rks", "lvs", "rvs", "k_rank", "k_offset", "v_rank", "v_offset",
    "cos", "sin", "sink_k", "sink_v", "tail_k", "tail_v",
)


@dataclass(frozen=True)
class RaggedPuzzlePages:
    """Everything a ``puzzle_plus`` layer store holds, as attention reads it.

    Attributes:
        sink_k, sink_v, tail_k, tail_v: dense ``[H, T, d]`` tokens before and after the pages.
        keys, values: the pages' factors (None when no page is factorized yet).
        page_size: ``P``; head_dim: ``d``; kv_heads: ``H``.
        rope: the RoPE table when keys were factorized before RoPE, else None.
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    keys: RaggedFactors | None
    values: RaggedFactors | None
    page_size: int
    head_dim: int
    kv_heads: int
    rope: RotaryTable | None = None

    @property
    def n_pages(self) -> int:
        return 0 if self.keys is None else self.keys.n_pages

    @property
    def first_position(self) -> int:
        return self.sink_k.shape[1]

    @property
    def int4(self) -> bool:
        return self.keys is not None and self.keys.int4

    def operands(self, device: torch.device) -> list[torch.Tensor]:
        """This view as ``kvpack::puzzle_ragged_attention``'s ``pages`` operand (:data:`RAGGED_OPERANDS`), with
        the RoPE tables made on ``device`` for pre-RoPE keys. Needs factorized pages."""
        if self.keys is None or self.values is None:
            raise ValueError("the puzzle_plus kernels need factorized pages (the store has none yet)")
        keys, values = self.keys, self.values
        empty = torch.empty(0, device=self.sink_k.device)
        scales = [keys.left_scale, keys.right_scale, values.left_scale, values.right_scale] if self.int4 \
            else [empty] * 4
        cos = sin = empty
        if self.rope is not None:
            cos, sin = self.rope.table(self.first_position + self.n_pages * self.page_size, device)
        return [keys.left, keys.right, values.left, values.right, *scales, keys.rank, keys.offset, values.rank,
                values.offset, cos, sin, self.sink_k, self.sink_v, self.tail_k, self.tail_v]

    def dense_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K̂, V̂)`` ``[H, N·P, d]`` fp32 of the pages (keys as stored: pre-RoPE when factorized
        so). For tests and inspection only; attention never builds them."""
        H, N, P, d = self.kv_heads, self.n_pages, self.page_size, self.head_dim
        out = []
        for side in (self.keys, self.values):
            dense = torch.zeros(N * H, P, d)
            codes = side.codes()
            for b in side.buckets:
                ids, left, right = side.bucket_factors(b, P, d, codes)
                dense[ids] = left.float() @ right.float()
            out.append(dense.view(N, H, P, d).transpose(0, 1).reshape(H, N * P, d))
        return out[0], out[1]


def ragged_pages_partials(pages: RaggedPuzzlePages, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
    """Partial states of grouped queries ``qg [H, M, d]`` over the factorized pages (not the sink or
    tail): one state per tile of pages (one tile unless ``H·M·N·P`` exceeds ``MAX_TILE_LOGITS``).

    Computed in fp32 (fp64 for fp64 queries); returns ``m, l [H, M]``, ``o [H, M, d]`` per tile.
    """
    N = pages.n_pages
    if N == 0:
        return []
    H, M, _ = qg.shape
    per_page = H * M * pages.page_size
    tile = max(1, MAX_TILE_LOGITS // max(per_page, 1))
    return [_tile_partial(pages, qg, scaling, lo, min(lo + tile, N)) for lo in range(0, N, tile)]


def _tile_partial(pages: RaggedPuzzlePages, qg: torch.Tensor, scaling: float, lo: int, hi: int) -> PartialAttention:
    """The state over pages ``[lo, hi)``: key buckets scored into ``[H, M, hi − lo, P]``, value
    buckets contracted and added back per head."""
    dt = torch.float64 if qg.dtype == torch.float64 else torch.float32
    q = qg.to(dt)
    H, M, d = q.shape
    P = pages.page_size
    whole = lo == 0 and hi == pages.n_pages
    # INT4: one unpack of each side when one tile covers every page (a decode step); tiles of a
    # long chunk unpack bucket by bucket, so the transient stays one bucket's codes.
    key_codes, value_codes = (pages.keys.codes(), pages.values.codes()) if whole else (None, None)
    if pages.rope is None:
        s = torch.full((H, M, hi - lo, P), float("-inf"), dtype=dt, device=q.device)
        for b in pages.keys.buckets:
            ids, left, right = _tile_bucket(pages.keys, b, P, d, H, lo, hi, whole, key_codes)
            if ids.numel():
                heads, page = ids % H, ids // H
                s_e = (q[heads] @ right.to(dt).transpose(-1, -2)) @ left.to(dt).transpose(-1, -2)  # (q R_Kᵀ) L_Kᵀ
                s[heads, :, page - lo, :] = s_e * scaling  # [c, M, P] into the (head, page) slots
    else:
        # Pre-RoPE keys: the rotation depends on the position inside the page, so the tile's keys
        # are rebuilt bucket by bucket into one [pages, H, P, d] tensor, rotated once and contracted.
        keys = torch.empty((hi - lo) * H, P, d, dtype=dt, device=q.device)
        for b in pages.keys.buckets:
            ids, left, right = _tile_bucket(pages.keys, b, P, d, H, lo, hi, whole, key_codes)
            if ids.numel():
                keys[ids - lo * H] = left.to(dt) @ right.to(dt)
        first = pages.first_position
        cos, sin = pages.rope.cos_sin(torch.arange(first + lo * P, first + hi * P, device=q.device))
        keys = apply_rope(keys.view(hi - lo, H, P, d), cos.view(hi - lo, 1, P, d).to(dt),
                          sin.view(hi - lo, 1, P, d).to(dt))
        s = torch.einsum("hmd,nhpd->hmnp", q, keys) * scaling

    def contract(p: torch.Tensor) -> torch.Tensor:
        o = torch.zeros(H, M, d, dtype=dt, device=q.device)
        for b in pages.values.buckets:
            ids, left, right = _tile_bucket(pages.values, b, P, d, H, lo, hi, whole, value_codes)
            if ids.numel() == 0:
                continue
            heads, page = ids % H, ids // H
            u = p[heads, :, page - lo, :] @ left.to(dt)  # (p L_V): [c, M, r]
            o.index_add_(0, heads, u @ right.to(dt))  # ... R_V, summed per head
        return o

    return state_from_logits(s, contract)


def _tile_bucket(side: RaggedFactors, b: Bucket, P: int, d: int, H: int, lo: int, hi: int, whole: bool, codes):
    """A bucket's factors restricted to pages ``[lo, hi)`` (the whole bucket when ``whole``)."""
    ids, left, right = side.bucket_factors(b, P, d, codes)
    if whole:
        return ids, left, right
    keep = ((ids // H) >= lo) & ((ids // H) < hi)
    return ids[keep], left[keep], right[keep]
