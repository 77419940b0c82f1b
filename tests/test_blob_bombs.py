"""Hostile blobs: a small section that would inflate to hundreds of MB is refused after the size its
header declares (+1 byte), never inflated whole (issue 17, item 1)."""

from __future__ import annotations

import tracemalloc
import zlib

import pytest
import torch
import zstandard

from kvpack.store.format import Blob, BlobError, pack_blob

from .helpers import join_blob, split_blob

BOMB_BYTES = 256 << 20  # what the hostile section would inflate to
PEAK_LIMIT = 16 << 20  # what decoding it may allocate


def _with_section_data(blob: bytes, name: str, data: bytes) -> bytes:
    """``blob`` with section ``name``'s stored bytes replaced by ``data``; offsets and the checksum
    recomputed, the declared raw size kept (a well-formed, correctly checksummed hostile blob)."""
    header, sections = split_blob(blob)
    sections[name] = data
    return join_blob(header, sections)


@pytest.mark.parametrize("backend,bomb", [
    ("zlib", lambda: zlib.compress(bytes(BOMB_BYTES), 9)),
    ("zstd", lambda: zstandard.ZstdCompressor(level=19).compress(bytes(BOMB_BYTES))),  # states its size
    ("zstd", lambda: zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(BOMB_BYTES))),
])
def test_decompression_bomb_is_refused_without_inflating_it(backend, bomb):
    blob = pack_blob({"kind": "test"}, {"x": torch.zeros(1000, dtype=torch.uint8)}, backend=backend)
    data = bomb()
    assert len(data) < 300_000  # small on disk
    hostile = _with_section_data(blob, "x", data)
    parsed = Blob(hostile)  # the checksum and the header are valid
    tracemalloc.start()
    try:
        with pytest.raises(BlobError, match="1000"):
            parsed.section("x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"decoding the hostile section allocated {peak / 1e6:.0f} MB"


@pytest.mark.parametrize("backend", ["zlib", "zstd"])
def test_sections_still_decode_exactly(backend):
    x = torch.arange(5000, dtype=torch.int32)
    blob = Blob(pack_blob({"kind": "test"}, {"x": x}, backend=backend))
    assert torch.equal(blob.section("x"), x)
    short = _with_section_data(pack_blob({}, {"x": x}, backend=backend), "x",
                               zlib.compress(bytes(100)) if backend == "zlib"
                               else zstandard.ZstdCompressor().compress(bytes(100)))
    with pytest.raises(BlobError):
        Blob(short).section("x")
