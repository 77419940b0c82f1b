"""StreamingLLM (Xiao et al., 2024): attention sinks plus a rolling window of recent tokens (eviction.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import integer, option
from .eviction import EvictionConfig, EvictionStore


@dataclass(frozen=True)
class StreamingConfig(EvictionConfig):
    """Attributes: sink_tokens: leading tokens always kept (default 4, as the paper)."""

    sink_tokens: int = option(4, integer(minimum=0), "leading tokens always kept")


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
