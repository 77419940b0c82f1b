"""Who is who in the frontier: FullKV (the reference), the peers (what users run today), the storage codecs,
kvpack's own resident methods; and how a cell is named (``method@budget``)."""

from __future__ import annotations

# A peer counts as "at equal or fewer bytes" up to BYTES_TOLERANCE, a relative excess over the bytes a cell holds
# or was asked to hold (budgets are targets; measured ratios of two methods at one target differ in the third
# decimal); the default method's choice of a measured budget uses the same tolerance (kvpack.methods.recommend).
from ...methods.recommend import BYTES_TOLERANCE  # noqa: F401 - re-exported

REFERENCE = "full"
# Method families that are peers (what users run today), not kvpack's own methods or its baselines.
PEER_FAMILIES = ("hf_quantized", "lmcache_quant", "llamacpp", "kvpress")
# Storage codecs: the cache is a blob between turns and is decoded before attention reads it.
STORAGE_FAMILIES = ("kvtc",)
SIGNIFICANCE = 0.05  # McNemar's p and the paired KL interval's level


def is_peer(family: str) -> bool:
    return family in PEER_FAMILIES


def is_storage(cell: dict) -> bool:
    """A storage codec's cell (the cache is a blob between turns, decoded before attention), not resident."""
    return cell["family"] in STORAGE_FAMILIES


def is_resident_kvpack(cell: dict) -> bool:
    """One of kvpack's resident methods (or baselines): not FullKV, not a peer, not a storage codec."""
    return not cell["peer"] and cell["family"] != REFERENCE and cell["family"] not in STORAGE_FAMILIES


def label(c: dict) -> str:
    """``method@budget`` (or the method alone where its bytes follow its own settings)."""
    return c["method"] if c["budget"] is None else f"{c['method']}@{c['budget']:g}"
