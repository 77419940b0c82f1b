"""FullKV: the identity codec, the reference every method is compared with.

It keeps every key and value dense and computes attention with PyTorch SDPA the way transformers'
own ``sdpa`` attention does for one sequence, so that generation through kvpack's cache and
attention path reproduces plain transformers token for token. ``storage_dtype`` defaults to
``auto`` (the model's dtype); with an fp32 model its bytes are therefore twice the bf16 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.dense import dense_state, sdpa_chunk
from ..config import STORAGE_DTYPE_NAMES, MethodConfig, choice, number, option
from .base import LayerLayout, LayerStore


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """FullKV has no parameters besides the shared ones; ``budget`` must be None or 1."""

    budget: float | None = option(None, number(1.0, 1.0, optional=True), "full keeps every byte: 1 or unset")
    storage_dtype: str = option("auto", choice(*STORAGE_DTYPE_NAMES), "dtype of the dense cache (auto: the model's)")


GROW_TOKENS = 128  # the dense buffer grows by whole multiples of this many tokens


class FullStore(LayerStore):
    """FullKV, the identity: dense keys/values ``[kv_heads, tokens, d]``.

    The tokens live in a buffer ``[kv_heads, capacity, d]`` that grows ``GROW_TOKENS`` at a time, so a
    decode step writes its token in place instead of copying the whole cache (transformers'
    ``DynamicCache`` concatenates every step; the first FullKV did it twice, in ``attend`` and in
    ``append``, and decoded 1.2-1.4x slower). ``attend`` writes the chunk into the buffer and reads a
    view of it; the ``append`` that follows for the same chunk only counts it. The bytes reported
    are the whole buffer's: exactly the stored tokens after the first chunk (a prefill), then at most
    ``GROW_TOKENS - 1`` reserved tokens beyond them while decoding.
    """

    Config = FullConfig
    budgeted = False

    def __init__(self, layout: LayerLayout, config: FullConfig):
        super().__init__(layout, config)
        empty = torch.empty(layout.kv_heads, 0, layout.head_dim, dtype=self.storage_dtype)
        self.k_buf, self.v_buf = empty, empty.clone()

    @property
    def k(self) -> torch.Tensor:
        """The stored keys ``[kv_heads, seq_len, d]`` (a view of the buffer)."""
        return self.k_buf[:, : self.seq_len]

    @property
    def v(self) -> torch.Tensor:
        return self.v_buf[:, : self.seq_len]

    def tensors(self):
        return {"k": self.k_buf, "v": self.v_buf}

    def reconstruct(self):
        return self.k.float(), self.v.float()

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the chunk at ``[seq_len, seq_len + n)`` of the buffer, growing it when full."""
        end = self.seq_len + k.shape[1]
        if end > self.k_buf.shape[1]:
            # The first chunk (a prefill) gets exactly its size; later growth rounds up to GROW_TOKENS.
            capacity = end if not self.seq_len else -(-end // GROW_TOKENS) * GROW_TOKENS
            shape = (self.layout.kv_heads, capacity, self.layout.head_dim)
            k_buf = torch.empty(shape, dtype=self.storage_dtype, device=k.device)
            v_buf = torch.empty(shape, dtype=self.storage_dtype, device=k.device)
            k_buf[:, : self.seq_len] = self.k
            v_buf[:, : self.seq_len] = self.v
            self.k_buf, self.v_buf = k_buf, v_buf
        self.k_buf[:, self.seq_len:end] = k
        self.v_buf[:, self.seq_len:end] = v

    @property
    def attention_backend(self) -> str:
        return "auto"  # its stored partial states (attend itself is SDPA): the native kernel where built

    def stored_partials(self, qg, scaling):
        return [dense_state(qg, self.k, self.v, scaling, self.backend(qg.device))]

    def attend(self, q, k, v, scaling):
        """The template's exception: SDPA over the buffer, as transformers computes it (the fastest
        path for dense tokens, and FullKV is the reference the other methods are measured against)."""
        self.check_chunk(q, k, v)
        self.scaling = scaling
        n_q = q.shape[1]
        self._write(k, v)
        self._staged = (k, v)
        end = self.seq_len + n_q
        # views of the buffer: no copy when the model's dtype is the storage dtype
        return sdpa_chunk(q, self.k_buf[None, :, :end], self.v_buf[None, :, :end], scaling, self.layout.group)

    def append(self, k, v, q=None, out=None):
        if not self.stored_by_attend(q, k, v):
            self._write(k, v)
        self.seq_len += k.shape[1]
