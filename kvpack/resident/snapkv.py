"""SnapKV (Li et al., 2024): tokens voted for by an observation window of the prompt's last queries (eviction.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.scores import observation_scores
from ..config import integer, option
from .eviction import EvictionConfig, EvictionStore


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
