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
from ..attention.scores import accumulated_attention, observation_scores
from ..config import MethodConfig, boolean, choice, integer, number, option
from ..ops.accounting import dense_bf16_bytes
from ..registry import register_method
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
        return [dense_state(qg, self.k, self.v, scaling, self.config.attention_backend)]

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


@dataclass(frozen=True)
class StreamingConfig(EvictionConfig):
    """Attributes: sink_tokens: leading tokens always kept (default 4, as the paper)."""

    sink_tokens: int = option(4, integer(minimum=0), "leading tokens always kept")


@register_method("streaming")
class StreamingStore(EvictionStore):
    """StreamingLLM: sinks + recent window, everything else evicted."""

    Config = StreamingConfig

    def min_tokens(self) -> int:
        return self.config.sink_tokens + 1

    def select(self, q, k, n_keep):
        S, sinks = k.shape[1], self.config.sink_tokens
        idx = torch.cat([torch.arange(sinks), torch.arange(S - (n_keep - sinks), S)]) if n_keep < S else \
            torch.arange(S)
        return idx[None].expand(k.shape[0], -1).to(k.device)

    def after_append(self, q, n_new):
        excess = self.k.shape[1] - self.n_keep
        if excess > 0:  # roll the window: drop the oldest non-sink tokens
            sinks = self.config.sink_tokens
            self.k = torch.cat([self.k[:, :sinks], self.k[:, sinks + excess:]], dim=1)
            self.v = torch.cat([self.v[:, :sinks], self.v[:, sinks + excess:]], dim=1)



# ------------------------------------------------------------------------------------------------
# H2O (Zhang et al., 2023): heavy hitters by accumulated attention + recent tokens, half and half.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class H2OConfig(EvictionConfig):
    """Attributes:
        recent_fraction: share of the kept tokens that are the most recent (default 0.5, the
            PuzzleKV paper's equal split); the rest are heavy hitters.
        update_scores: keep accumulating attention mass during decode and evict the lowest-scored
            non-recent token each step (fixed cache size, the H2O paper's decode); default False
            (evict once after prefill, as the PuzzleKV paper configures H2O).
    """

    recent_fraction: float = option(0.5, number(0.0, 1.0), "share of the kept tokens that are the most recent")
    update_scores: bool = option(False, boolean(), "keep scoring and evicting during decode")


def h2o_select(scores: torch.Tensor, n_keep: int, n_recent: int) -> torch.Tensor:
    """Indices ``[H, n_keep]``: the last ``n_recent`` positions plus the top-scored earlier ones."""
    H, S = scores.shape
    n_recent = min(n_recent, n_keep)
    heavy = torch.topk(scores[:, : S - n_recent], n_keep - n_recent, dim=-1).indices
    recent = torch.arange(S - n_recent, S, device=scores.device)[None].expand(H, -1)
    return torch.cat([heavy, recent], dim=-1)


@register_method("h2o")
class H2OStore(EvictionStore):
    """H2O: heavy hitters (accumulated attention mass) + recent tokens."""

    Config = H2OConfig

    def __init__(self, layout, config):
        super().__init__(layout, config)
        self.scores: torch.Tensor | None = None  # [H, n] fp32, only with update_scores

    def tensors(self):
        out = super().tensors()
        if self.scores is not None:
            out["scores"] = self.scores
        return out

    def bytes_per_token(self) -> int:
        return super().bytes_per_token() + (4 if self.config.update_scores else 0)

    @property
    def budget_covers_decode(self) -> bool:
        return self.config.update_scores  # without score updates generated tokens are all kept

    def n_recent(self) -> int:
        return int(round(self.n_keep * self.config.recent_fraction))

    def select(self, q, k, n_keep):
        scores = accumulated_attention(q, k, self.scaling, self.config.score_chunk)
        self._prefill_scores = scores
        return h2o_select(scores, n_keep, self.n_recent())

    def on_prefill_selected(self, q, k, idx):
        if self.config.update_scores:
            self.scores = torch.gather(self._prefill_scores, 1, idx)
        del self._prefill_scores

    def after_append(self, q, n_new):
        if not self.config.update_scores:
            return
        # Attention mass of the new queries over every kept token (new ones included, causally).
        keys = self.k.float()  # the new tokens are already appended, last
        hkv, n_old = keys.shape[0], keys.shape[1] - n_new
        qg = q.float().reshape(hkv, q.shape[0] // hkv, n_new, -1)
        s = torch.einsum("hgnd,htd->hgnt", qg, keys) * self.scaling
        dev = keys.device
        visible = torch.arange(keys.shape[1], device=dev)[None, :] <= n_old + torch.arange(n_new, device=dev)[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=(1, 2))
        self.scores = torch.cat([self.scores, torch.zeros(hkv, n_new, device=dev)], dim=1) + p
        excess = self.k.shape[1] - self.n_keep
        if excess > 0:
            n = self.k.shape[1]
            recent = self.n_recent()
            keep = torch.ones(hkv, n, dtype=torch.bool, device=dev)
            drop = torch.topk(-self.scores[:, : n - recent], excess, dim=-1).indices
            keep.scatter_(1, drop, False)
            self.drop(keep)
            self.scores = self.scores[keep].reshape(hkv, -1)



# ------------------------------------------------------------------------------------------------
# SnapKV (Li et al., 2024): votes of an observation window, pooled, top tokens + the window.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapKVConfig(EvictionConfig):
    """Attributes: window: observation window of the last prompt queries, kept (default 32);
    kernel: average-pooling kernel over the votes (default 7)."""

    window: int = option(32, integer(minimum=1), "observation window of the last prompt queries, kept")
    kernel: int = option(7, integer(minimum=1), "average-pooling kernel over the votes")


def snapkv_select(votes: torch.Tensor, n_keep: int, window: int) -> torch.Tensor:
    """Indices ``[H, n_keep]``: top ``n_keep - window`` prefix tokens by pooled votes + the window."""
    H, n_prefix = votes.shape
    top = torch.topk(votes, n_keep - window, dim=-1).indices
    win = torch.arange(n_prefix, n_prefix + window, device=votes.device)[None].expand(H, -1)
    return torch.cat([top, win], dim=-1)


@register_method("snapkv")
class SnapKVStore(EvictionStore):
    """SnapKV: observation-window votes, pooled, top tokens kept plus the window."""

    Config = SnapKVConfig

    budget_covers_decode = False  # SnapKV compresses the prompt; generated tokens are all kept

    def min_tokens(self) -> int:
        return self.config.window

    def select(self, q, k, n_keep):
        S, W = k.shape[1], self.config.window
        if n_keep >= S or S <= W:
            return torch.arange(S, device=k.device)[None].expand(k.shape[0], -1)[:, :n_keep]
        votes = observation_scores(q, k, self.scaling, W, self.config.kernel)
        return snapkv_select(votes, n_keep, W)
