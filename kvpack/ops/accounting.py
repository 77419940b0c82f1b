"""The dense reference every byte budget and ratio in kvpack is measured against."""

from __future__ import annotations

DENSE_REFERENCE_BYTES_PER_ELEMENT = 2  # bf16, as in the papers


def dense_bf16_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of ``tokens`` tokens' keys and values in bf16 (the reference every budget is a fraction of)."""
    return tokens * kv_heads * head_dim * 2 * DENSE_REFERENCE_BYTES_PER_ELEMENT
