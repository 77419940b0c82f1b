"""Token eviction baselines: StreamingLLM, H2O and SnapKV, with real storage (evicted tokens freed).

Each keeps, per KV head, a subset of the prompt's tokens dense and discards the rest for good.
The selection runs once, on the prefill chunk, from attention statistics computed inside kvpack's
attention path in query chunks (``kvpack.attention.scores``; no eager attention, no ``S × S``
matrix). The kept tokens are stored in position order as ``k, v [kv_heads, n_kept, d]``; keys stay
post-RoPE at their original positions, so no position tensor is needed.

Budgets: ``budget`` is the fraction of the prompt's dense bf16 bytes the store may hold after
prefill; it becomes a token count ``n_keep = floor(budget × S × ref_bytes / stored_bytes_per_token)``.
After the prefill:

* ``streaming`` keeps a rolling window (sinks + most recent), a fixed number of tokens;
* ``h2o`` with ``update_scores=True`` keeps a fixed number of tokens too, evicting the
  lowest-scored non-recent token each step (the H2O paper's decode policy);
* ``snapkv`` and ``h2o`` (default, as the PuzzleKV paper runs it) append generated tokens dense,
  as their papers do, so after ``t`` new tokens the ratio is ``(n_keep + t) / (S + t)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention.cpu import NATIVE_CHOICES
from ..attention.dense import dense_state
from ..config import MethodConfig, choice, integer, number, option
from ..ops.accounting import dense_bf16_bytes
from .base import LayerLayout, LayerStore


@dataclass(frozen=True)
class EvictionConfig(MethodConfig):
    """Shared eviction fields.

    Attributes:
        budget: fraction of the prompt's dense bytes kept (required; default 0.25).
        score_chunk: query rows per chunk when computing attention statistics.
        attention_backend: ``auto`` (the native CPU kernel for CPU tensors where it is built, else
            PyTorch), ``native`` or ``torch``.
    """

    budget: float | None = option(0.25, number(0.0, 1.0, low_open=True), "fraction of the prompt's dense bytes kept")
    score_chunk: int = option(256, integer(minimum=1), "query rows per chunk of attention statistics")
    attention_backend: str = option("auto", choice(*NATIVE_CHOICES), "attention path for the kept tokens")


class EvictionStore(LayerStore):
    """Kept tokens ``k, v [kv_heads, n, d]`` of one sequence and layer; subclasses pick them."""

    def __init__(self, layout: LayerLayout, config: EvictionConfig):
        super().__init__(layout, config)
        empty = torch.empty(layout.kv_heads, 0, layout.head_dim, dtype=self.storage_dtype)
        self.k, self.v = empty, empty.clone()
        self.n_keep: int | None = None  # token budget decided at prefill

    def tensors(self):
        return {"k": self.k, "v": self.v}

    def reconstruct(self):
        return self.k.float(), self.v.float()

    def bytes_per_token(self) -> int:
        """Bytes one kept token costs per KV head (keys + values + any per-token statistic)."""
        return 2 * self.layout.head_dim * self.storage_dtype.itemsize

    def resolved_params(self):
        return {} if self.n_keep is None else {"kept_tokens": self.n_keep}

    def token_budget(self, seq_len: int) -> int:
        ref = dense_bf16_bytes(1, 1, self.layout.head_dim)
        return math.floor(self.config.budget * seq_len * ref / self.bytes_per_token())

    # -- attention: dense over what is kept -----------------------------------------------------

    def stored_partials(self, qg, scaling):
        return [dense_state(qg, self.k, self.v, scaling, self.backend(qg.device))]

    def append(self, k, v, q=None, out=None):
        self.check_chunk(q, k, v)
        if self.seq_len == 0:
            n = k.shape[1]
            n_keep = self.token_budget(n)
            if n_keep < self.min_tokens():
                raise ValueError(
                    f"{self.name}: budget {self.config.budget} keeps {n_keep} of {n} tokens, fewer than the "
                    f"{self.min_tokens()} this configuration needs; use a larger budget or a longer input"
                )
            self.n_keep = min(n_keep, n)
            if q is None:
                raise ValueError(f"{self.name} needs the prefill queries to select tokens")
            idx = self.select(q, k, self.n_keep).sort(dim=-1).values  # [H, n_keep], position order
            gather = idx[..., None].expand(-1, -1, k.shape[-1])
            self.k = torch.gather(k, 1, gather).to(self.storage_dtype)
            self.v = torch.gather(v, 1, gather).to(self.storage_dtype)
            self.seq_len = n
            self.on_prefill_selected(q, k, idx)
            return
        self.k = torch.cat([self.k, k.to(self.storage_dtype)], dim=1)
        self.v = torch.cat([self.v, v.to(self.storage_dtype)], dim=1)
        self.seq_len += k.shape[1]
        self.after_append(q, k.shape[1])

    def drop(self, keep_mask: torch.Tensor) -> None:
        """Keep tokens where ``keep_mask [H, n]`` is True (the same count in every head)."""
        n = int(keep_mask[0].sum())
        idx = keep_mask.nonzero()[:, 1].reshape(keep_mask.shape[0], n)
        gather = idx[..., None].expand(-1, -1, self.k.shape[-1])
        self.k = torch.gather(self.k, 1, gather)
        self.v = torch.gather(self.v, 1, gather)

    # -- policy hooks -----------------------------------------------------------------------

    def min_tokens(self) -> int:
        return 1

    def select(self, q: torch.Tensor, k: torch.Tensor, n_keep: int) -> torch.Tensor:
        """Indices ``[kv_heads, n_keep]`` of the prefill tokens to keep."""
        raise NotImplementedError

    def on_prefill_selected(self, q, k, idx) -> None:
        pass

    def after_append(self, q, n_new: int) -> None:
        pass


# ------------------------------------------------------------------------------------------------
# StreamingLLM (Xiao et al., 2024): attention sinks + a recent window.
# ------------------------------------------------------------------------------------------------
