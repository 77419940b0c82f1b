"""Building and growing :class:`~kvpack.attention.ragged_pages.RaggedFactors` (one side of a layer).

New pages always follow the stored ones, so merging keeps the storage order (rank, page, head) by
concatenating, rank by rank, the stored bucket and the new entries of that rank; the position
tables are then rebuilt (one copy of the side's factors per round — at P = 64 once every 64
decode steps).
"""

from __future__ import annotations

import torch

from ...attention.ragged_pages import RaggedFactors, make_buckets
from ...ops.int4 import quantize_int4

RANK_DTYPE = torch.int16
INDEX_DTYPE = torch.int32


def table_bytes_per_entry() -> int:
    """Bytes of an entry's rank, offset and order rows."""
    return RANK_DTYPE.itemsize + 2 * INDEX_DTYPE.itemsize


def bucket_table_bytes(n_buckets: int) -> int:
    return n_buckets * 4 * INDEX_DTYPE.itemsize


def factor_bytes(ranks: torch.Tensor, page_size: int, head_dim: int, elem_bytes: int, int4: bool) -> int:
    """Bytes of the factors (and INT4 scales) of entries of ``ranks``."""
    total_rank = int(ranks.sum())
    if not int4:
        return total_rank * (page_size + head_dim) * elem_bytes
    # packed codes (two per byte; ranks even) + fp16 scales: one per column of L, d per entry for R
    return total_rank * (page_size + head_dim) // 2 + total_rank * 2 + ranks.numel() * head_dim * 2


def encode_entries(left: torch.Tensor, right: torch.Tensor, sigma: torch.Tensor, ranks: torch.Tensor,
                   dtype: torch.dtype, int4: bool) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's entries, truncated and encoded.

    Args:
        left: ``[E, P, C]`` full-rank left factors (descending components); right: ``[E, C, d]``;
            sigma: ``[E, C]`` singular values (used by INT4: Σ^½ goes into both factors).
        ranks: ``[E]`` each entry's rank (in storage order within a rank: ascending position).
        dtype: float factors' dtype.

    Returns:
        ``{rank: {"ids": [c] int64 entry indices, "left": flat, "right": flat, ("left_scale": [c·r],
        "right_scale": [c, d])}}`` in ascending rank.
    """
    out = {}
    for r in torch.unique(ranks).tolist():
        ids = (ranks == r).nonzero().squeeze(-1)
        lf, rf = left[ids, :, :r], right[ids, :r, :]
        if not int4:
            out[r] = {"ids": ids, "left": lf.to(dtype).reshape(-1), "right": rf.to(dtype).reshape(-1)}
            continue
        # Σ^½ absorbed into both factors (PuzzleKV §4.3): L̃ = U Σ^½, R̃ = Σ^-½ R (zero where σ = 0).
        root = sigma[ids, :r].sqrt()
        inv_root = torch.where(root > 0, 1.0 / root.clamp_min(1e-30), torch.zeros_like(root))
        lq, ls = quantize_int4(lf * root.unsqueeze(-2), dim=-2)  # [c, P, r/2], scales [c, 1, r]
        rq, rs = quantize_int4(rf * inv_root.unsqueeze(-1), dim=-2)  # [c, r, d/2], scales [c, 1, d]
        out[r] = {"ids": ids, "left": lq.reshape(-1), "right": rq.reshape(-1), "left_scale": ls.reshape(-1),
                  "right_scale": rs.reshape(len(ids), -1)}
    return out


def merge(old: RaggedFactors | None, new_ranks: torch.Tensor, encoded: dict[int, dict[str, torch.Tensor]],
          page_size: int, head_dim: int) -> RaggedFactors:
    """``old`` (N pages) followed by ``n`` new pages: ``new_ranks [n, H]`` and their encoded entries
    (entry index ``i`` = new page ``i // H``, head ``i % H``)."""
    P, d = page_size, head_dim
    n_new, H = new_ranks.shape
    n_old = 0 if old is None else old.n_pages
    old_buckets = {} if old is None else {b.rank: b for b in old.buckets}
    int4 = any("left_scale" in e for e in encoded.values())
    pieces = {"left": [], "right": [], "order": [], "left_scale": []}
    for r in sorted(set(old_buckets) | set(encoded)):
        if r in old_buckets:
            b = old_buckets[r]
            o, c = b.offset, b.count
            scale = 2 if int4 else 1
            pieces["left"].append(old.left[o * P // scale:(o + c * r) * P // scale])
            pieces["right"].append(old.right[o * d // scale:(o + c * r) * d // scale])
            pieces["order"].append(old.order[b.first:b.first + c])
            if int4:
                pieces["left_scale"].append(old.left_scale[o:o + c * r])
        if r in encoded:
            e = encoded[r]
            pieces["left"].append(e["left"])
            pieces["right"].append(e["right"])
            pieces["order"].append((e["ids"] + n_old * H).to(INDEX_DTYPE))
            if int4:
                pieces["left_scale"].append(e["left_scale"])
    rank = new_ranks.to(RANK_DTYPE) if old is None else torch.cat([old.rank, new_ranks.to(RANK_DTYPE)])
    order = torch.cat(pieces["order"])
    rank_in_order = rank.reshape(-1)[order.long()]
    buckets, table = make_buckets(rank_in_order)
    offset = torch.empty_like(rank, dtype=INDEX_DTYPE)
    offset.view(-1)[order.long()] = (torch.cumsum(rank_in_order.long(), 0) - rank_in_order.long()).to(INDEX_DTYPE)
    right_scale = None
    if int4:
        new_scale = torch.empty(n_new * H, d, dtype=torch.float16)
        for e in encoded.values():
            new_scale[e["ids"]] = e["right_scale"]
        new_scale = new_scale.view(n_new, H, d)
        right_scale = new_scale if old is None else torch.cat([old.right_scale, new_scale])
    return RaggedFactors(
        left=torch.cat(pieces["left"]), right=torch.cat(pieces["right"]), rank=rank, offset=offset, order=order,
        buckets=buckets, bucket_table=table,
        left_scale=torch.cat(pieces["left_scale"]) if int4 else None, right_scale=right_scale,
    )
