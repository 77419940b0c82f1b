"""A budget over the whole cache: the sliding-window layers' bytes charged to the full-attention layers.

A model that interleaves sliding-window layers (Gemma 2 / 3, Cohere 2, ...) keeps them in transformers' own
cache layers: each holds the last ``sliding_window - 1`` tokens, dense, in the model's dtype. kvpack compresses
the full-attention layers. ``budget`` is the fraction of the dense bf16 bytes of the *whole* cache — every
layer's held tokens (``budget_scope="whole"``, the default), so the full-attention layers are given the
smaller budget ``b'`` that makes the whole cache fit::

    b · (F s + S) · 2  =  b' · F s · 2  +  S · e        →        b' = (b · (F s + S) · 2 − S · e) / (F s · 2)

with ``F`` the full-attention layers, ``s`` the tokens, ``S = Σ min(s, window − 1)`` over the sliding layers, ``e``
the model dtype's bytes (2 for bf16, 4 for fp32) and each count in units of one token's key and value of one
layer. ``b'`` is fixed per sequence (each row of a batch: its own real tokens, so a padded row is compressed as
the prompt alone) from the length of its first chunk, the prompt; as decoding adds tokens ``F s`` grows while
``S`` stops at the windows, so the whole cache's share only falls from there. Where the windows
alone hold more than ``b`` of the whole cache (short prompts: a 3K prompt of Gemma 3 1B's shape), no ``b'``
exists and the cache refuses, naming that share.

Why charge the windows rather than compress them: the windows are small, the model keeps them exactly
(attention over a window is unchanged), and charging works for every method alike. Compressing them would need
each method to evict and mask by position inside its stores.

``budget_scope="full_layers"`` keeps the earlier meaning: the budget over the full-attention layers alone.
Every reported ratio (``KVPackCache.kv_bytes() / dense_kv_bytes()``) is over the whole cache either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT as DENSE_REFERENCE_BYTES  # the budget's reference: bf16

BUDGET_SCOPES = ("whole", "full_layers")


@dataclass(frozen=True)
class CacheShape:
    """What the charge needs of a cache: its compressed full-attention layers and its other layers.

    Attributes:
        full_layers: layers kvpack compresses.
        windows: per other layer, the tokens it keeps at most (``sliding_window - 1``), or None where it keeps
            every token (a layer kvpack does not compress and that does not slide).
        model_bytes: bytes of one element of the model's own layers (its dtype).
    """

    full_layers: int
    windows: tuple[int | None, ...]
    model_bytes: int

    def other_tokens(self, tokens: int) -> int:
        """Σ over the other layers of the tokens each holds at ``tokens`` tokens."""
        return sum(tokens if w is None else min(tokens, w) for w in self.windows)

    def window_share(self, tokens: int) -> float:
        """The other layers' bytes as a share of the whole cache's dense bf16 bytes at ``tokens`` tokens."""
        held = self.other_tokens(tokens)
        return held * self.model_bytes / ((self.full_layers * tokens + held) * DENSE_REFERENCE_BYTES)


def full_layers_budget(budget: float, tokens: int, shape: CacheShape) -> float:
    """The budget ``b'`` of the full-attention layers that keeps the whole cache at ``budget`` of its dense bf16
    bytes at ``tokens`` tokens (the module doc's formula); ``budget`` itself where there is no other layer.

    Raises:
        ValueError: when the other layers alone hold ``budget`` of the whole cache or more (or leave the full
            layers less than 1% of their bytes), naming their share.
    """
    if not shape.windows or tokens <= 0:
        return budget
    held = shape.other_tokens(tokens)
    full = shape.full_layers * tokens
    charged = (budget * (full + held) * DENSE_REFERENCE_BYTES - held * shape.model_bytes) / (
        full * DENSE_REFERENCE_BYTES)
    if charged < 0.01:
        share = shape.window_share(tokens)
        sliding = sum(w is not None for w in shape.windows)
        raise ValueError(
            f"budget={budget} of the whole cache cannot be met at {tokens} tokens: the model's "
            f"{len(shape.windows)} uncompressed layers ({sliding} sliding-window) hold {share:.3f} of its dense bf16 "
            f"bytes as the model keeps them ({shape.model_bytes} bytes an element), leaving the "
            f"{shape.full_layers} full-attention layers {max(charged, 0.0):.4f} of theirs; ask for a budget above "
            f"{share:.3f} (the share falls as the prompt grows), or pass budget_scope='full_layers' (the budget over "
            "the full-attention layers alone)")
    return min(charged, budget)
