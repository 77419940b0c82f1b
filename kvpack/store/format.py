"""A self-describing, checksummed container for compressed caches (kvtc blobs).

Layout (all integers little-endian)::

    magic    8 bytes   b"KVPACK\\x00B"
    version  u16       FORMAT_VERSION
    hlen     u32       length of the header
    header   hlen      UTF-8 JSON: metadata + a table of sections
    payload  ...       the sections, each entropy-coded on its own (so one can be read alone)
    digest   32 bytes  SHA-256 of everything before it

Each section is a tensor stored as raw little-endian bytes of a named dtype, compressed with the
blob's backend (``zlib`` = DEFLATE, the default; ``zstd``; ``none``). The header table gives every
section's dtype, shape, offset and sizes. Nothing is ever unpickled: reading a blob parses JSON and
raw numbers only, and every length is checked before it is used.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
import zlib

import torch
import zstandard

from .schema import BlobError, check_fields, get_int, get_int_list, get_list, get_str, parse_header


def tokens_digest(token_ids: list[int]) -> str:
    """SHA-256 of a token sequence (how blobs and prefix stores identify a prefix)."""
    return hashlib.sha256(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


MAGIC = b"KVPACK\x00B"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")
DIGEST_BYTES = 32
BACKENDS = ("zlib", "zstd", "none")
_DTYPES = {
    "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


SECTION_NAME = r"[A-Za-z0-9_]{1,64}"
MAX_SECTIONS = 4096
MAX_DIMS = 8
SECTION_FIELDS = {"name", "dtype", "shape", "offset", "size", "raw_size"}


def _compress(raw: bytes, backend: str, level: int) -> bytes:
    if backend == "zlib":
        return zlib.compress(raw, level)
    if backend == "zstd":
        # the frame's own checksum: a changed byte fails here even under a recomputed blob digest
        return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)
    if backend == "none":
        return raw
    raise ValueError(f"unknown entropy-coding backend {backend!r}; choose one of {BACKENDS}")


def _decompress(data: bytes, backend: str, raw_size: int) -> bytes:
    """A section's bytes, inflated to at most ``raw_size + 1`` bytes (the header's size, plus one to
    notice more): a small section that would inflate to gigabytes (a decompression bomb) is refused
    after ``raw_size + 1`` bytes, never inflated whole."""
    try:
        if backend == "zlib":
            inflater = zlib.decompressobj()
            out = inflater.decompress(data, raw_size + 1)
            if len(out) == raw_size and not inflater.eof:  # the stream must end exactly here
                out += inflater.decompress(inflater.unconsumed_tail, 1)
        elif backend == "zstd":
            stated = zstandard.frame_content_size(data)
            if stated not in (-1, raw_size):  # -1: the frame does not state its size
                raise BlobError(f"a zstd section states {stated} bytes, the header says {raw_size}")
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
                out = reader.read(raw_size + 1)
        elif backend == "none":
            out = data
        else:
            raise BlobError(f"blob uses unknown backend {backend!r}")
    except zlib.error as exc:
        raise BlobError(f"a section does not decompress ({backend}): {exc}") from None
    except zstandard.ZstdError as exc:
        raise BlobError(f"a section does not decompress (zstd): {exc}") from None
    if len(out) != raw_size:
        more = "more than" if len(out) > raw_size else f"{len(out)} bytes, not"
        raise BlobError(f"a section decompressed to {more} the {raw_size} bytes its header says")
    return out


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor (bf16 through its 16-bit pattern)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def pack_blob(meta: dict, sections: dict[str, torch.Tensor], backend: str = "zlib", level: int = 6) -> bytes:
    """Serialize ``sections`` (tensors) with ``meta`` (JSON-able) into one checksummed blob."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown entropy-coding backend {backend!r}; choose one of {BACKENDS}")
    table, chunks, offset = [], [], 0
    for name, t in sections.items():
        if not re.fullmatch(SECTION_NAME, name):
            raise ValueError(f"section name {name!r} is not of the form {SECTION_NAME}")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"section {name!r}: dtype {t.dtype} cannot be stored")
        raw = tensor_bytes(t)
        data = _compress(raw, backend, level)
        table.append({"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset,
                      "size": len(data), "raw_size": len(raw)})
        chunks.append(data)
        offset += len(data)
    header = json.dumps({**meta, "backend": backend, "sections": table}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(chunks)
    return body + hashlib.sha256(body).digest()


class Blob:
    """A parsed, verified blob: ``meta`` (the header) and lazy access to its sections.

    Raises:
        BlobError: bad magic, unknown version, truncated data, checksum mismatch, malformed header.
    """

    def __init__(self, data: bytes):
        self.data = memoryview(data)
        if len(data) < _PREFIX.size + DIGEST_BYTES:
            raise BlobError(f"blob is truncated: {len(data)} bytes is shorter than the fixed header")
        magic, version, hlen = _PREFIX.unpack_from(data, 0)
        if magic != MAGIC:
            raise BlobError(f"not a kvpack blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise BlobError(f"blob format version {version} is not supported (this kvpack reads {FORMAT_VERSION})")
        body_end = len(data) - DIGEST_BYTES
        if hashlib.sha256(self.data[:body_end]).digest() != bytes(self.data[body_end:]):
            raise BlobError("blob checksum mismatch: the data is truncated or corrupted")
        start = _PREFIX.size
        if start + hlen > body_end:
            raise BlobError("blob header runs past the end of the data")
        self.meta = parse_header(bytes(self.data[start:start + hlen]))
        self.backend = get_str(self.meta, "backend", choices=BACKENDS)
        self.payload_start = start + hlen
        self.payload_end = body_end
        self.sections = {}
        offset = 0
        for i, s in enumerate(get_list(self.meta, "sections", max_len=MAX_SECTIONS)):
            where = f"blob section {i}"
            name = get_str(s, "name", where, pattern=SECTION_NAME)
            where = f"blob section {name!r}"
            check_fields(s, SECTION_FIELDS, where)
            if name in self.sections:
                raise BlobError(f"{where} appears twice")
            get_str(s, "dtype", where, choices=tuple(_DTYPES))
            shape = get_int_list(s, "shape", where, max_len=MAX_DIMS)
            # sections lie back to back in table order, as pack_blob writes them
            get_int(s, "offset", where, minimum=offset, maximum=offset)
            size = get_int(s, "size", where, maximum=body_end - self.payload_start - offset)
            raw_size = get_int(s, "raw_size", where)
            elem = torch.empty(0, dtype=_DTYPES[s["dtype"]]).element_size()
            if math.prod(shape) * elem != raw_size:
                raise BlobError(f"{where}: shape {shape} of {s['dtype']} is not the {raw_size} bytes it declares")
            if self.backend == "none" and size != raw_size:
                raise BlobError(f"{where} is stored uncompressed in {size} bytes, not the {raw_size} it declares")
            self.sections[name] = s
            offset += size
        if self.payload_start + offset != body_end:
            raise BlobError(f"blob payload has {body_end - self.payload_start - offset} bytes no section accounts for")

    def __len__(self) -> int:
        return len(self.data)

    def section(self, name: str) -> torch.Tensor:
        """Decode one section into a tensor of its recorded dtype and shape."""
        if name not in self.sections:
            raise BlobError(f"blob has no section {name!r}")
        s = self.sections[name]
        lo = self.payload_start + s["offset"]
        raw = _decompress(bytes(self.data[lo:lo + s["size"]]), self.backend, s["raw_size"])
        dtype = _DTYPES[s["dtype"]]
        storage = torch.int16 if dtype == torch.bfloat16 else dtype
        t = torch.frombuffer(bytearray(raw), dtype=storage) if raw else torch.empty(0, dtype=storage)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.reshape(s["shape"])
