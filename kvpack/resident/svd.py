"""Global SVD: one low-rank basis per layer and KV head over the whole compressible region.

The PuzzleKV paper's controlled baseline (§4.1, Appendix A.3): the same dense sink page and local
window as PuzzleKV, and between them a single truncated SVD per KV head for keys and one for
values, ``X ≈ U_r (Σ_r W_rᵀ)``, with the rank chosen per input so that the total — factors plus
dense regions — meets the budget (the paper's ρ_global = r (S + d) / (S d)). Keys post-RoPE.
Compression happens once, at the end of prefill; generated tokens stay in the dense tail.
Attention reads the factors like one long PuzzleKV page (``kvpack.attention.pages``); the native
CPU path is dense attention in rank space: logits ``(q B_Kᵀ) · U_K[t]``, output ``(Σ_t p_t U_V[t]) B_V``
(``kvpack::dense_attention`` over ``U_K``, ``U_V`` with the query projected once per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention.cpu import NATIVE_CHOICES
from ..attention.dense import dense_state
from ..attention.pages import factorized_pages_partial
from ..attention.softmax_merge import PartialAttention
from ..config import MethodConfig, choice, integer, number, option
from ..ops.accounting import dense_bf16_bytes
from .base import LayerLayout
from .segmented import SegmentedStore


@dataclass(frozen=True)
class SVDConfig(MethodConfig):
    """Attributes: budget (default 0.6); page_size: the sink and window unit, as PuzzleKV (32);
    sink_pages, window_pages: dense pages at the start and the end (1 and 1); attention_backend:
    ``auto`` (the native CPU kernel for CPU tensors where it is built), ``native`` or ``torch``."""

    budget: float | None = option(0.6, number(0.0, 1.0, low_open=True),
                                  "fraction of the dense bf16 bytes (picks the rank)")
    page_size: int = option(32, integer(minimum=1), "the sink and window unit, as PuzzleKV")
    sink_pages: int = option(1, integer(minimum=0), "dense pages at the start")
    window_pages: int = option(1, integer(minimum=0), "dense pages at the end")
    attention_backend: str = option("auto", choice(*NATIVE_CHOICES), "attention path for stored tokens")


def svd_rank_for_budget(seq_len: int, compressed: int, head_dim: int, budget: float, elem_bytes: int) -> int:
    """Largest rank whose factors + dense regions fit ``budget`` × dense bf16 bytes (0 if none)."""
    ref = budget * dense_bf16_bytes(seq_len, 1, head_dim)
    dense = (seq_len - compressed) * 2 * head_dim * elem_bytes
    rank = math.floor((ref - dense) / (2 * (compressed + head_dim) * elem_bytes))
    return max(0, min(rank, compressed, head_dim))


class SVDStore(SegmentedStore):
    """Dense sink + global factors ``uk [H, N, r]``, ``bk [H, r, d]``, ``uv``, ``bv`` + dense tail."""

    Config = SVDConfig

    def __init__(self, layout: LayerLayout, config: SVDConfig):
        super().__init__(layout, config)
        self.factors: dict[str, torch.Tensor] = {}
        self.rank: int | None = None
        self.n_compressed = 0

    @property
    def sink_capacity(self) -> int:
        return self.config.sink_pages * self.config.page_size

    budget_covers_decode = False  # factorized once, after the prefill; later tokens stay dense

    def history_tensors(self):
        return dict(self.factors)

    def history_dense(self):
        f = self.factors
        if not f:
            return self.empty_history()
        return f["uk"].float() @ f["bk"].float(), f["uv"].float() @ f["bv"].float()

    def resolved_params(self):
        return {} if self.rank is None else {"rank": self.rank, "compressed_tokens": self.n_compressed}

    def compress(self) -> None:
        if self.rank is not None:
            return  # once, after prefill
        cfg, P = self.config, self.config.page_size
        n = max(0, self.tail_k.shape[1] // P - cfg.window_pages) * P
        d = self.layout.head_dim
        rank = svd_rank_for_budget(self.seq_len, n, d, cfg.budget, self.storage_dtype.itemsize)
        if rank < 1:
            raise ValueError(
                f"svd: budget {cfg.budget} is below the fixed cost of the dense sink and window at {self.seq_len} "
                f"tokens ({self.seq_len - n} dense tokens); use a larger budget or a longer input"
            )
        self.rank, self.n_compressed = rank, n
        k, v = self.pop_tail(n)
        for name, x in (("k", k), ("v", v)):
            u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
            self.factors[f"u{name}"] = u[..., :rank].to(self.storage_dtype)
            self.factors[f"b{name}"] = (s[..., :rank, None] * vh[..., :rank, :]).to(self.storage_dtype)

    def history_partials(self, qg, scaling):
        if not self.factors:
            return []
        f = self.factors
        if qg.dtype != torch.float64 and self.backend(qg.device) == "native":
            q_rank = torch.einsum("hmd,hrd->hmr", qg.float(), f["bk"].float()).contiguous()  # q B_Kᵀ [H, M, r]
            st = dense_state(q_rank, f["uk"], f["uv"], scaling, "native")
            return [PartialAttention(st.m, st.l, torch.einsum("hmr,hrd->hmd", st.o, f["bv"].float()))]
        # The whole compressed region as a single "page" of n tokens.
        return [factorized_pages_partial(qg, f["uk"][:, None], f["bk"][:, None], f["uv"][:, None], f["bv"][:, None],
                                         scaling)]
