"""PuzzleKV: page-wise low-rank decomposition of the KV cache (PuzzleKV paper, §3; INT4 in §4.3).

Each layer's keys and values are split, per KV head, into pages of ``P`` tokens. The first page is a
dense sink, the most recent completed page and the page being filled form a dense local window, and
every other completed page is factorized independently by a truncated SVD, computed in batches
through the ``P×P`` Gram matrix (``kvpack.ops.lowrank``): ``X̂_p = L_p R_p`` with ``L = U_r`` and
``R = Σ_r W_rᵀ``. Attention reads a factorized page from its factors, contracting the query with
the small factors first — ``s = (q Rᵀ) Lᵀ``, ``o = (exp(s − m) L) R`` — and merges pages by online
softmax (``kvpack.attention.pages``). While decoding, a page that fills and leaves the window is
factorized once and its dense slot released; factorized pages are never revisited.

Storage ratio of a factorized page pair (Eq. 3): ``ρ = (r_K + r_V)(P + d) / (2 P d)``. The paper's
``(r_K, r_V) = (16, 14)`` at ``P = 32, d = 128`` gives ρ ≈ 0.586; for another head dimension kvpack
takes the largest total rank ``R`` with ``ρ ≤ 0.6`` and splits it ``r_K = R//2 + 1, r_V = R − r_K``
(keys get the extra rank, as in the paper's choice) — ``(13, 12)`` at ``d = 64`` (ρ = 0.586),
``(16, 14)`` at ``d = 128``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..attention.cpu import DOT_PRECISIONS
from ..attention.pages import PageSet, PuzzlePages, puzzle_pages_partials
from ..attention.triton import KERNEL_CHOICES
from ..attention.triton.puzzle_op import puzzle_partial
from ..config import MethodConfig, boolean, choice, integer, option
from ..ops.accounting import dense_bf16_bytes
from ..ops.int4 import quantize_int4
from ..ops.lowrank import gram_eigh_factors
from ..ops.rope import rope_at, unrope_pages
from .base import LayerLayout
from .segmented import SegmentedStore

DEFAULT_PAGE_RATIO = 0.6  # target factorized-page ratio of the default ranks (paper: ≈ 0.586)


@dataclass(frozen=True)
class PuzzleConfig(MethodConfig):
    """PuzzleKV parameters.

    Attributes:
        page_size: tokens per page ``P`` (default 32).
        rank_k, rank_v: ranks of key and value pages; None = derived (see module doc), or from
            ``budget`` when it is set. Each must be in ``[1, min(P, head_dim)]``.
        sink_pages: dense pages at the start (default 1).
        window_pages: completed pages kept dense besides the page being filled (default 1).
        key_rope: ``"post"`` (default, factorize the cached post-RoPE keys) or ``"pre"``
            (factorize pre-RoPE keys; RoPE is re-applied at attention time at the original positions).
        int4: quantize the factors to symmetric INT4 with Σ^½ absorbed into both (paper §4.3).
        tile_pages: factorized pages processed per attention tile (bounds transient memory).
        attention_backend: attention path for stored tokens: ``auto`` (the Triton kernel for CUDA tensors when
            Triton is installed, the native CPU kernel for CPU tensors where it is built, else PyTorch),
            ``triton`` (always; CPU only under ``TRITON_INTERPRET=1``), ``native`` (the CPU kernel) or
            ``torch`` (the reference).
        dot_precision: how the native CPU kernel rebuilds pre-RoPE keys (``key_rope="pre"``): ``auto``
            (default: bf16 products with fp32 accumulation where the CPU has AVX-512 BF16 and the factors
            are INT4 or bf16, which round by at most 2^-9 of an entry or not at all), ``float32`` (the
            reference numerics) or ``bfloat16`` (also for fp32 factors). Post-RoPE pages, the PyTorch and
            Triton paths compute in fp32 whatever it says.
        budget: when set, the ranks are chosen per input as the largest pair whose total bytes
            (factors and dense regions, for the coming page cycle) stay within ``budget × dense``.
    """

    page_size: int = option(32, integer(minimum=1), "tokens per page P")
    rank_k: int | None = option(None, integer(minimum=1, optional=True), "key rank (none: derived or from budget)")
    rank_v: int | None = option(None, integer(minimum=1, optional=True), "value rank (none: derived or from budget)")
    sink_pages: int = option(1, integer(minimum=0), "dense pages at the start")
    window_pages: int = option(1, integer(minimum=0), "completed pages kept dense besides the filling one")
    key_rope: str = option("post", choice("post", "pre"), "factorize keys after or before RoPE")
    int4: bool = option(False, boolean(), "INT4 factors with Σ^½ absorbed into both (§4.3)")
    tile_pages: int = option(256, integer(minimum=1), "factorized pages per attention tile")
    attention_backend: str = option("auto", choice(*KERNEL_CHOICES), "attention path for stored tokens")
    dot_precision: str = option("auto", choice(*DOT_PRECISIONS), "native pre-RoPE key rebuild: bf16 products or fp32")

    def check(self) -> None:
        for name in ("rank_k", "rank_v"):
            value = getattr(self, name)
            if value is not None and value > self.page_size:
                raise self.error(f"{name} must be <= {self.page_size} (page_size), got {value}")
        if (self.rank_k is None) != (self.rank_v is None):
            raise self.error("rank_k and rank_v must be set together (or both left to be derived)")
        if self.budget is not None and self.rank_k is not None:
            raise self.error("set either budget or rank_k/rank_v, not both: budget picks the ranks")


def split_total_rank(total: int, cap: int) -> tuple[int, int]:
    """Split a total rank (>= 2) between keys and values, keys getting the extra rank (16/14 at 30),
    each capped at ``cap = min(P, d)``."""
    rank_k = min(total // 2 + 1, cap, total - 1)
    return rank_k, total - rank_k


def page_ratio(page_size: int, head_dim: int, rank_k: int, rank_v: int) -> float:
    """Eq. 3: bytes of a factorized key+value page pair over its dense bytes (same dtype)."""
    return (rank_k + rank_v) * (page_size + head_dim) / (2 * page_size * head_dim)


def default_ranks(page_size: int, head_dim: int, target: float = DEFAULT_PAGE_RATIO) -> tuple[int, int]:
    """Largest total rank with page ratio ≤ ``target``, split keys-first."""
    cap = min(page_size, head_dim)
    best = 2
    for total in range(2, 2 * cap + 1):
        if page_ratio(page_size, head_dim, *split_total_rank(total, cap)) <= target:
            best = total
    return split_total_rank(best, cap)


def layout_at(seq_len: int, cfg: PuzzleConfig) -> tuple[int, int]:
    """``(dense_tokens, factorized_pages)`` of one head after ``seq_len`` tokens under ``cfg``'s policy."""
    P = cfg.page_size
    sink = min(seq_len, cfg.sink_pages * P)
    complete = (seq_len - sink) // P
    pages = max(0, complete - cfg.window_pages)
    return seq_len - pages * P, pages


def factor_bytes_per_page(cfg: PuzzleConfig, head_dim: int, rank_k: int, rank_v: int, elem_bytes: int) -> int:
    """Bytes of one factorized key+value page pair of one head, as the store holds it."""
    P = cfg.page_size
    if not cfg.int4:
        return (rank_k + rank_v) * (P + head_dim) * elem_bytes
    packed = lambda rows, cols: rows * ((cols + 1) // 2)  # noqa: E731
    scale = 2  # fp16
    key = packed(P, rank_k) + rank_k * scale + packed(rank_k, head_dim) + head_dim * scale  # L_K, R_K column-wise
    value = packed(P, rank_v) + P * scale + packed(rank_v, head_dim) + head_dim * scale  # L_V row-, R_V column-wise
    return key + value


def expected_bytes(seq_len: int, cfg: PuzzleConfig, kv_heads: int, head_dim: int, rank_k: int, rank_v: int,
                   elem_bytes: int) -> int:
    """Bytes one layer's store holds after ``seq_len`` tokens: dense regions plus factor pages."""
    dense, pages = layout_at(seq_len, cfg)
    per_head = dense * 2 * head_dim * elem_bytes + pages * factor_bytes_per_page(cfg, head_dim, rank_k, rank_v,
                                                                                 elem_bytes)
    return kv_heads * per_head


def ranks_for_budget(seq_len: int, cfg: PuzzleConfig, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    """Largest keys-first rank pair keeping the bytes ≤ budget × dense over the next page cycle.

    The check runs over ``seq_len .. seq_len + P`` so that the decode tokens that wait dense in the
    window before their page is factorized do not push the store over the budget.

    Raises:
        ValueError: even rank (1, 1) exceeds the budget (the dense sink and window alone cost more).
    """
    return _ranks_for_budget(seq_len, cfg, head_dim, elem_bytes)


@functools.lru_cache(maxsize=256)  # every layer and row of one prompt asks the same question (configs are frozen)
def _ranks_for_budget(seq_len: int, cfg: PuzzleConfig, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    cap = min(cfg.page_size, head_dim)
    dense_per_token = dense_bf16_bytes(1, 1, head_dim)
    for total in range(2 * cap, 1, -1):
        rk, rv = split_total_rank(total, cap)
        if all(
            expected_bytes(s, cfg, 1, head_dim, rk, rv, elem_bytes) <= cfg.budget * s * dense_per_token
            for s in range(max(seq_len, 1), seq_len + cfg.page_size + 1)
        ):
            return rk, rv
    dense, pages = layout_at(seq_len, cfg)
    raise ValueError(
        f"puzzle: budget {cfg.budget} is below PuzzleKV's fixed cost at {seq_len} tokens: the dense sink and "
        f"window hold {dense} of {seq_len} tokens ({dense / max(seq_len, 1):.2f} of the dense bytes) with "
        f"{pages} factorizable pages; use a longer input, a larger budget or fewer dense pages"
    )


def fold_threshold(n_pages: int) -> int:
    """Recent pages at which :class:`PuzzleStore` folds its recent factor set into the main one."""
    return max(8, math.isqrt(n_pages))


class PuzzleStore(SegmentedStore):
    """PuzzleKV, one sequence, one layer: dense sink + factorized pages + dense window (see module doc).

    Factor tensors (per KV head ``h`` and factorized page ``n``), float form:
    ``lk [H, N, P, r_K]``, ``rk [H, N, r_K, d]``, ``lv [H, N, P, r_V]``, ``rv [H, N, r_V, d]``.
    INT4 form: the same matrices as packed nibbles (``*_q``, last axis halved) plus fp16 scales
    (``*_s``): column-wise for ``lk``, ``rk`` and ``rv``, row-wise for ``lv``.

    Pages live in two sets of those tensors: :attr:`factors` (pages ``[0, n_main)``) and
    :attr:`recent` (the pages factorized since, while decoding). A page factorized during decoding
    is concatenated onto ``recent`` only, which is folded into ``factors`` once it holds
    ``max(8, √n_pages)`` pages: each page then costs about ``1.5 √n_pages`` page copies instead of
    ``n_pages`` (one concatenation of every factor per page, which at P = 32 would read and write
    about 6% of what attention reads per decode step). No slack is allocated: the bytes held are
    exactly the pages' factors. Attention (both paths) reads the two sets in place.
    """

    Config = PuzzleConfig

    def __init__(self, layout: LayerLayout, config: PuzzleConfig):
        super().__init__(layout, config)
        if config.key_rope == "pre" and layout.rope is None:
            raise ValueError("puzzle: key_rope='pre' needs the model's rotary embedding (none was found)")
        cap = min(config.page_size, layout.head_dim)
        if config.rank_k is not None and (config.rank_k > cap or config.rank_v > cap):
            raise ValueError(
                f"puzzle: ranks must be <= min(page_size, head_dim) = {cap}, got rank_k={config.rank_k}, "
                f"rank_v={config.rank_v}"
            )
        self.ranks: tuple[int, int] | None = None
        if config.budget is None:
            self.ranks = (config.rank_k, config.rank_v) if config.rank_k else default_ranks(config.page_size,
                                                                                            layout.head_dim)
        self.factors: dict[str, torch.Tensor] = {}  # pages [0, n_main)
        self.recent: dict[str, torch.Tensor] = {}  # pages [n_main, n_pages), folded into factors
        self.n_pages = 0
        self.factorizations = 0  # pages factorized so far (each exactly once)

    # -- layout -----------------------------------------------------------------------------

    @property
    def sink_capacity(self) -> int:
        return self.config.sink_pages * self.config.page_size

    def history_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.factors, **{f"{name}_recent": t for name, t in self.recent.items()}}

    @property
    def n_main(self) -> int:
        """Pages held in :attr:`factors` (the rest are in :attr:`recent`)."""
        return next(iter(self.factors.values())).shape[1] if self.factors else 0

    def all_factors(self) -> dict[str, torch.Tensor]:
        """Every page's factors as one tensor per name (a copy when some pages are recent; for
        inspection and tests — attention reads the two sets in place)."""
        if not self.recent:
            return dict(self.factors)
        if not self.factors:
            return dict(self.recent)
        return {name: torch.cat([t, self.recent[name]], dim=1) for name, t in self.factors.items()}

    def resolved_params(self):
        return {} if self.ranks is None else {"rank_k": self.ranks[0], "rank_v": self.ranks[1]}

    # -- compression ------------------------------------------------------------------------

    def compress(self) -> None:
        cfg = self.config
        P = cfg.page_size
        if self.ranks is None:  # budget mode: choose ranks once, on the first (prefill) chunk
            self.ranks = ranks_for_budget(self.seq_len, cfg, self.layout.head_dim, self.storage_dtype.itemsize)
        # Tail = window pages + partial page; every completed page beyond the window is factorized.
        n_new = max(0, self.tail_k.shape[1] // P - cfg.window_pages)
        if n_new == 0:
            return
        start = self.tail_start
        k, v = self.pop_tail(n_new * P)
        H, d = self.layout.kv_heads, self.layout.head_dim
        k = k.float().reshape(H, n_new, P, d)
        v = v.float().reshape(H, n_new, P, d)
        if cfg.key_rope == "pre":
            k = unrope_pages(self.layout.rope, k, start)
        new = self._factorize(k, v)
        self.recent = new if not self.recent else {name: torch.cat([self.recent[name], t], dim=1)
                                                   for name, t in new.items()}
        self.n_pages += n_new
        self.factorizations += n_new
        if self.n_pages - self.n_main >= fold_threshold(self.n_pages):  # fold (a prefill folds at once)
            self.factors = self.all_factors()
            self.recent = {}

    def _factorize(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Factor ``[H, n, P, d]`` key and value pages into the stored form."""
        rank_k, rank_v = self.ranks
        lk, rk, sk = gram_eigh_factors(k, rank_k)
        lv, rv, sv = gram_eigh_factors(v, rank_v)
        if not self.config.int4:
            dt = self.storage_dtype
            return {"lk": lk.to(dt), "rk": rk.to(dt), "lv": lv.to(dt), "rv": rv.to(dt)}
        # §4.3: absorb Σ^½ into both factors, L̃ = U Σ^½, R̃ = Σ^½ Wᵀ = Σ^-½ R (zero where σ = 0).
        out = {}
        for name, left, right, sigma, left_dim in (("k", lk, rk, sk, -2), ("v", lv, rv, sv, -1)):
            root = sigma.sqrt()
            inv_root = torch.where(root > 0, 1.0 / root.clamp_min(1e-30), torch.zeros_like(root))
            left_t = left * root.unsqueeze(-2)
            right_t = right * inv_root.unsqueeze(-1)
            # keys: L̃_K and R̃_K column-wise; values: L̃_V row-wise, R̃_V column-wise.
            out[f"l{name}_q"], out[f"l{name}_s"] = quantize_int4(left_t, dim=left_dim)
            out[f"r{name}_q"], out[f"r{name}_s"] = quantize_int4(right_t, dim=-2)
        return out

    def pages_view(self) -> PuzzlePages:
        """Everything stored, as attention reads it (both factor sets in place, no copies)."""
        cfg = self.config
        rank_k, rank_v = self.ranks if self.ranks else (1, 1)
        sets = tuple(self._page_set(f) for f in (self.factors, self.recent) if f)
        return PuzzlePages(self.sink_k, self.sink_v, self.tail_k, self.tail_v, sets, cfg.page_size, rank_k, rank_v,
                           self.layout.head_dim, self.layout.rope if cfg.key_rope == "pre" else None, cfg.tile_pages)

    def _page_set(self, f: dict[str, torch.Tensor]) -> PageSet:
        if not self.config.int4:
            return PageSet(f["lk"], f["rk"], f["lv"], f["rv"])
        return PageSet(f["lk_q"], f["rk_q"], f["lv_q"], f["rv_q"], scales=(f["lk_s"], f["rk_s"], f["lv_s"], f["rv_s"]))

    def history_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.n_pages:
            return self.empty_history()
        H, d = self.layout.kv_heads, self.layout.head_dim
        lk, rk, lv, rv = self.pages_view().float_factors(0, self.n_pages)
        n = self.n_pages * self.config.page_size
        k = (lk.float() @ rk.float()).reshape(H, n, d)
        if self.config.key_rope == "pre":
            k = rope_at(self.layout.rope, k, self.sink_k.shape[1])
        return k, (lv.float() @ rv.float()).reshape(H, n, d)

    # -- attention --------------------------------------------------------------------------

    def stored_partials(self, qg, scaling):
        backend = self.backend(qg.device)
        if backend == "triton":
            return [puzzle_partial(self.pages_view(), qg, scaling)]
        if backend == "native":
            return [puzzle_partial(self.pages_view(), qg, scaling, native=True,
                                   dot_precision=self.config.dot_precision)]
        return super().stored_partials(qg, scaling)

    def history_partials(self, qg, scaling):
        return puzzle_pages_partials(self.pages_view(), qg, scaling)
