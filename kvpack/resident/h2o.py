"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus recent tokens (eviction.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.scores import accumulated_attention
from ..config import boolean, number, option
from .eviction import EvictionConfig, EvictionStore


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
