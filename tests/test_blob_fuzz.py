"""Fuzzing kvtc blobs (issue 17): truncations, bit flips with and without a recomputed checksum,
header mutations and decompression bombs. Every case ends in ``BlobError`` (or, where a mutation
happens to change nothing that decoding reads, in exactly the original cache); no other exception
type escapes, nothing decodes to a different cache, and decoding a bomb stays within a stated memory
bound. Hypothesis runs derandomized (the same examples every run, no example database), ~20 s.
"""

from __future__ import annotations

import hashlib
import tracemalloc
import zlib

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvpack.storage.kvtc.coder import compress_cache, decompress_cache
from kvpack.storage.kvtc.session import prefill
from kvpack.store.format import BlobError

from .helpers import join_blob, split_blob, tiny_kvtc, token_ids

FUZZ = settings(max_examples=400, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOMB_BYTES = 256 << 20
# Decoding may hold what the header declares a few times over, plus a fixed allowance; a bomb's
# inflated size is never allocated (tracemalloc counts Python buffers, where inflated bytes live).
PEAK_BOUND = lambda declared: 4 * declared + (64 << 20)  # noqa: E731


@pytest.fixture(scope="module")
def original():
    """``(model, calibration, blob, (cache, ids))``: a zlib and a zstd blob of a 40-token cache
    and what each decodes to."""
    model, calib = tiny_kvtc(ratios=(4,))
    ids = token_ids(40)
    cache = prefill(model, ids)
    blobs = {backend: compress_cache(cache, calib, 4, ids, model=model, backend=backend)
             for backend in ("zlib", "zstd")}
    decoded = decompress_cache(blobs["zlib"], calib, model)
    return model, calib, blobs, decoded


def _same(a, b) -> bool:
    (cache_a, ids_a), (cache_b, ids_b) = a, b
    return ids_a == ids_b and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(cache_a.layers, cache_b.layers))


def _refused_or_unchanged(original, data: bytes) -> None:
    model, calib, _, decoded = original
    try:
        result = decompress_cache(data, calib, model)
    except BlobError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("decoded unchanged")
    assert _same(result, decoded), "a changed blob decoded to a different cache"


@FUZZ
@given(data=st.data(), backend=st.sampled_from(["zlib", "zstd"]))
def test_truncated_blobs_are_refused(original, data, backend):
    blob = original[2][backend]
    n = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(BlobError):
        decompress_cache(blob[:n], original[1], original[0])


@FUZZ
@given(data=st.data(), backend=st.sampled_from(["zlib", "zstd"]), fix_checksum=st.booleans())
def test_bit_flips_are_refused(original, data, backend, fix_checksum):
    blob = bytearray(original[2][backend])
    body = len(blob) - 32
    flips = data.draw(st.sets(st.tuples(st.integers(0, body - 1), st.integers(0, 7)), min_size=1, max_size=4))
    for position, bit in flips:  # distinct bits: the blob always changes
        blob[position] ^= 1 << bit
    if fix_checksum:  # a writer who recomputes the digest: the header schema and the sections must catch it
        body_bytes = bytes(blob[:body])
        _refused_or_unchanged(original, body_bytes + hashlib.sha256(body_bytes).digest())
    else:
        with pytest.raises(BlobError):
            decompress_cache(bytes(blob), original[1], original[0])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _paths(node, prefix=()):
    """Every (container path, key) in a parsed header."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, child in items:
        yield prefix, key
        if isinstance(child, dict | list):
            yield from _paths(child, prefix + (key,))


@FUZZ
@given(data=st.data())
def test_header_mutations_are_refused(original, data):
    header, sections = split_blob(original[2]["zlib"])
    container_path, key = data.draw(st.sampled_from(list(_paths(header))))
    container = header
    for step in container_path:
        container = container[step]
    if data.draw(st.booleans()) and isinstance(container, dict):
        del container[key]
    else:
        container[key] = data.draw(JSON_VALUES)
    _refused_or_unchanged(original, join_blob(header, sections, fix_offsets=False))


@pytest.fixture(scope="module")
def bombs():
    return {"zlib": zlib.compress(bytes(BOMB_BYTES), 9),
            "zstd": zstandard.ZstdCompressor(level=19).compress(bytes(BOMB_BYTES))}


@settings(FUZZ, max_examples=24)
@given(data=st.data(), backend=st.sampled_from(["zlib", "zstd"]))
def test_bomb_sections_are_refused_within_the_memory_bound(original, bombs, data, backend):
    header, sections = split_blob(original[2][backend])
    name = data.draw(st.sampled_from(sorted(sections)))
    declared = sum(s["raw_size"] for s in header["sections"])
    sections[name] = bombs[backend]
    hostile = join_blob(header, sections)
    tracemalloc.start()
    try:
        with pytest.raises(BlobError):
            decompress_cache(hostile, original[1], original[0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND(declared), f"{peak / 1e6:.0f} MB for a blob declaring {declared} bytes"
