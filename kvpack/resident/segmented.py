"""Stores laid out as [dense sink] [compressed history] [dense recent tail].

This is the shape most resident methods of kvpack share (README.md, Architecture): the first tokens
stay dense (attention sinks), the most recent tokens stay dense (they are read most and may still be
filling a page), and the method compresses what lies between. Attention over the store merges the
partial softmax states of the sink, of the compressed history, of the tail and of the new chunk
(causal) — one softmax, never a rebuilt dense history.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..attention.dense import dense_state
from ..attention.softmax_merge import PartialAttention
from .base import LayerStore

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def stagger_lag(layer_idx: int, period: int) -> int:
    """Tokens layer ``layer_idx`` keeps dense beyond its method's own tail, in ``[0, period)``: ``frac(i · φ⁻¹)``
    of a period (the golden ratio spreads any number of layers evenly), so layers that compress every
    ``period`` tokens do it at different decode steps rather than all on one (which made that step 2x the
    median)."""
    return int((layer_idx * GOLDEN) % 1.0 * period)


class SegmentedStore(LayerStore):
    """Base for codecs with a dense sink, compressed history and a dense tail.

    Subclasses define :attr:`sink_capacity`, :meth:`history_partials` (attention over their
    compressed history), :meth:`history_tensors` and :meth:`compress` (move tokens from the tail
    into the compressed history, by their own policy).

    Token order: sink tokens are positions ``[0, n_sink)``, the compressed history covers
    ``[n_sink, n_sink + n_history)`` and the tail the rest, up to ``seq_len``.
    """

    def __init__(self, layout, config):
        super().__init__(layout, config)
        empty = torch.empty(layout.kv_heads, 0, layout.head_dim, dtype=self.storage_dtype)
        self.sink_k, self.sink_v = empty, empty.clone()
        self.tail_k, self.tail_v = empty.clone(), empty.clone()

    # -- codec hooks ------------------------------------------------------------------------

    @property
    @abstractmethod
    def sink_capacity(self) -> int:
        """Number of leading tokens kept dense."""

    @abstractmethod
    def history_partials(self, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
        """Partial states of grouped queries ``[kv_heads, rows, d]`` over the compressed history."""

    @abstractmethod
    def history_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the compressed history."""

    @abstractmethod
    def compress(self) -> None:
        """Move tail tokens into the compressed history as the codec's policy says."""

    @abstractmethod
    def history_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed history decoded: keys (post-RoPE) and values fp32 ``[kv_heads, n_history, d]``."""

    # -- shared machinery -------------------------------------------------------------------

    @property
    def tail_start(self) -> int:
        """Position of the first tail token."""
        return self.seq_len - self.tail_k.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "sink_k": self.sink_k,
            "sink_v": self.sink_v,
            "tail_k": self.tail_k,
            "tail_v": self.tail_v,
            **self.history_tensors(),
        }

    def empty_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`history_dense` returns before anything is compressed: fp32 ``[kv_heads, 0, d]``
        twice, on the store's device."""
        empty = torch.empty(self.layout.kv_heads, 0, self.layout.head_dim, device=self.sink_k.device)
        return empty, empty.clone()

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.history_dense()
        return (torch.cat([self.sink_k.float(), k, self.tail_k.float()], dim=1),
                torch.cat([self.sink_v.float(), v, self.tail_v.float()], dim=1))

    def stored_partials(self, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
        """Partial states of grouped queries over everything stored: sink, history, tail (the
        PyTorch path; codecs with a fused kernel override it)."""
        states = []
        if self.sink_k.shape[1]:
            states.append(dense_state(qg, self.sink_k, self.sink_v, scaling, self.backend(qg.device)))
        states.extend(self.history_partials(qg, scaling))
        if self.tail_k.shape[1]:
            states.append(dense_state(qg, self.tail_k, self.tail_v, scaling, self.backend(qg.device)))
        return states

    def append(self, k, v, q=None, out=None) -> None:
        self.check_chunk(q, k, v)
        k = k.to(self.storage_dtype)
        v = v.to(self.storage_dtype)
        # The sink fills first (the tail is empty until it is full).
        n_sink = min(self.sink_capacity - self.sink_k.shape[1], k.shape[1])
        if n_sink > 0:
            self.sink_k = torch.cat([self.sink_k, k[:, :n_sink]], dim=1)
            self.sink_v = torch.cat([self.sink_v, v[:, :n_sink]], dim=1)
        self.tail_k = torch.cat([self.tail_k, k[:, n_sink:]], dim=1)
        self.tail_v = torch.cat([self.tail_v, v[:, n_sink:]], dim=1)
        self.seq_len += k.shape[1]
        self.on_append(q, out, k.shape[1])
        self.compress()

    def on_append(self, q: torch.Tensor | None, out: torch.Tensor | None, n_new: int) -> None:
        """Hook for codecs that keep statistics of the queries/outputs (eviction scores)."""

    def pop_tail(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the ``n`` oldest tail tokens ``([kv_heads, n, d], [kv_heads, n, d])``."""
        k, v = self.tail_k[:, :n], self.tail_v[:, :n]
        # .clone() releases the popped tokens' storage instead of keeping a view of the old buffer.
        self.tail_k = self.tail_k[:, n:].clone()
        self.tail_v = self.tail_v[:, n:].clone()
        return k, v
