"""Parameters of ``puzzle_plus`` (PuzzleKV's pages with byte-budgeted adaptive ranks)."""

from __future__ import annotations

from dataclasses import dataclass

from ...attention.cpu import DOT_PRECISIONS
from ...attention.triton import KERNEL_CHOICES
from ...config import MethodConfig, boolean, choice, integer, number, option


@dataclass(frozen=True)
class PuzzlePlusConfig(MethodConfig):
    """``puzzle_plus`` parameters.

    Attributes:
        budget: the whole cache's bytes (every compressed layer: dense sink and window, factors,
            rank tables) ≤ ``budget`` × the same tokens' dense bf16 bytes, at every step (default 0.5).
        page_size: tokens per page ``P`` (default 64; the faithful ``puzzle`` uses 32).
        rank_step: ranks are multiples of this (default 4): the water-filling buys ranks in steps of
            ``rank_step``, which bounds the number of rank buckets (≤ 16 at P = 64) and so the
            per-bucket work of the PyTorch attention path. INT4 needs it even (a byte holds two
            ranks' codes).
        rank_floor: the smallest rank of a page side (default 1, rounded up to ``rank_step``).
        rank_cap: the largest (default None = ``min(P, head_dim)``).
        sink_pages: dense pages at the start (default 1).
        window_pages: completed pages kept dense besides the page being filled (default 1).
        stagger: each layer keeps ``lag`` more recent tokens dense (``lag`` in ``[0, P)``, spread over the
            layers by the golden ratio), so the layers complete their pages at different decode steps, and a
            page completed while decoding is ranked by its own layer's round (default True; False: every
            layer completes its page on the same token, whose rounds then follow one another on that step).
        key_rope: ``"pre"`` (factorize keys before RoPE, which is re-applied at attention time; a
            page's pre-RoPE keys need far fewer ranks), ``"post"`` (the cached keys) or ``"auto"``
            (default: ``pre`` where the layer has a rotary embedding, else ``post``).
        int4: INT4 factors (default; Σ^½ absorbed into both factors, fp16 column scales): a rank
            costs ``(P + d) / 2 + 2`` bytes instead of ``2 (P + d)``. Both defaults were chosen by
            measurement (``kvpack eval --set puzzle_plus.KEY=VALUE`` on NIAH; docs/methods/puzzlekv.md says why).
        attention_weight: ``a`` in [0, 1]: a prefill page's marginal gains are multiplied by
            ``(1 − a) + a · N · mass`` where ``mass`` is the share of the observation window's
            attention that falls on the page (``N`` pages; mean weight 1). 0 = energy only.
        observation_window: last prefill queries whose attention weighs the pages (with ``a > 0``).
        attention_backend: ``auto`` / ``triton`` / ``native`` / ``torch`` (as for ``puzzle``).
        dot_precision: ``auto`` / ``float32`` / ``bfloat16``: the native CPU kernel's rebuild of
            pre-RoPE keys (as for ``puzzle``; ``auto``: bf16 products for the default INT4 factors
            where the CPU has AVX-512 BF16).
    """

    budget: float | None = option(0.5, number(0.0, 1.0, low_open=True), "whole-cache bytes / dense bf16 bytes")
    page_size: int = option(64, integer(minimum=2), "tokens per page P")
    rank_step: int = option(4, integer(minimum=1), "ranks are multiples of this")
    rank_floor: int = option(1, integer(minimum=1), "smallest rank of a page side")
    rank_cap: int | None = option(None, integer(minimum=1, optional=True), "largest rank (none: min(P, head_dim))")
    sink_pages: int = option(1, integer(minimum=0), "dense pages at the start")
    window_pages: int = option(1, integer(minimum=0), "completed pages kept dense besides the filling one")
    stagger: bool = option(True, boolean(), "spread the layers' page completions over the decode steps")
    key_rope: str = option("auto", choice("auto", "post", "pre"), "factorize keys after or before RoPE")
    int4: bool = option(True, boolean(), "INT4 factors (Σ^½ in both factors)")
    attention_weight: float = option(0.0, number(0.0, 1.0), "weight of the observation window's attention")
    observation_window: int = option(32, integer(minimum=1), "prefill queries that weigh the pages")
    attention_backend: str = option("auto", choice(*KERNEL_CHOICES), "attention path for stored tokens")
    dot_precision: str = option("auto", choice(*DOT_PRECISIONS), "native pre-RoPE key rebuild: bf16 products or fp32")

    def check(self) -> None:
        if self.rank_cap is not None and self.rank_cap > self.page_size:
            raise self.error(f"rank_cap must be <= page_size ({self.page_size}), got {self.rank_cap}")
        if self.rank_cap is not None and self.rank_floor > self.rank_cap:
            raise self.error(f"rank_floor ({self.rank_floor}) must be <= rank_cap ({self.rank_cap})")
        if self.int4 and self.rank_step % 2:
            raise self.error(f"int4 needs an even rank_step (a byte holds two ranks' codes), got {self.rank_step}")
        if self.rank_step > self.page_size or (self.rank_cap is not None and self.rank_step > self.rank_cap):
            raise self.error(f"rank_step ({self.rank_step}) must be <= page_size and rank_cap")
