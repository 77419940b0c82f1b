"""Every method kvpack ships, registered explicitly in one list (no method exists by an import's side effect).

Names are the registry's (``kvpack methods``, ``--method``); a preset (:mod:`kvpack.presets`) is one of these
with some fields fixed. A new method of kvpack's is its module plus one line here; a user's own method
registers with :func:`kvpack.register_method` on its class.
"""

from __future__ import annotations

from ..hf.quantized import HFQuantizedStore
from ..registry import register
from ..resident.anchor.store import AnchorPlusStore, AnchorStore
from ..resident.full import FullStore
from ..resident.h2o import H2OStore
from ..resident.kivi import KIVIStore
from ..resident.pca_quant import PCAQuantStore
from ..resident.puzzle import PuzzleStore
from ..resident.puzzle_plus.store import PuzzlePlusStore
from ..resident.snapkv import SnapKVStore
from ..resident.streaming import StreamingStore
from ..resident.svd import SVDStore
from ..storage.kvtc.codec import KvtcCodec
from ..storage.kvtc.resident import KvtcResidentStore
from ..storage.lmcache_quant import LMCacheQuantCodec

KVPACK_METHODS: tuple[tuple[str, type], ...] = (
    ("full", FullStore),
    ("puzzle", PuzzleStore),
    ("puzzle_plus", PuzzlePlusStore),
    ("anchor", AnchorStore),
    ("anchor_plus", AnchorPlusStore),
    ("pca_quant", PCAQuantStore),
    ("kvtc_resident", KvtcResidentStore),
    ("svd", SVDStore),
    ("kivi", KIVIStore),
    ("streaming", StreamingStore),
    ("h2o", H2OStore),
    ("snapkv", SnapKVStore),
    ("hf_quantized", HFQuantizedStore),
    ("kvtc", KvtcCodec),
    ("lmcache_quant", LMCacheQuantCodec),
)


def register_kvpack_methods() -> None:
    """Register every method of :data:`KVPACK_METHODS` (idempotent)."""
    for name, cls in KVPACK_METHODS:
        register(name, cls)
