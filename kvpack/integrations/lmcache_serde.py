"""LMCache serde ``"kvtc"``: each LMCache chunk (all layers of 256 tokens) coded with kvtc's PCA basis
and bit allocation, for LMCache's L2 adapters (Redis, disk, ...).

Configure an L2 adapter with ``"serde": {"type": "kvtc", "calibration": DIR, "ratio": 16}``.
Registration happens when this module is imported (LMCache has no entry points): run the LMCache
server through ``python -m kvpack.integrations.lmcache_server`` (same arguments as ``lmcache
server``), which imports it first.

* Layouts: LMCache hands a chunk as ``[2, layers, tokens, kv_heads·head_dim]`` (separate K and V) or,
  from vLLM's CPU backend, ``[1, layers, tokens, 2·kv_heads·head_dim]``: rows of vLLM's paged blocks,
  keys transposed (``"fused_order": "vllm_cpu"``, the default; ``"halves"`` reads token-major
  ``[all K | all V]`` rows); see :mod:`kvpack.storage.kvtc.chunk`. vLLM's AMX kernels (bf16 caches on
  CPUs with AMX) lay blocks out otherwise: such chunks are refused (a failed store, a miss).
* Positions: the serde sees chunk keys (content hashes), not token positions, so this path uses a
  calibration of keys as cached (``kvpack calibrate --key-rope post``); a pre-RoPE calibration is
  refused when the serde is built.
* Attention sinks: a chunk does not know whether it starts the sequence, so each keeps its
  ``exact_tokens`` worst-coded tokens exactly (default 4, the paper's sink count); in a first chunk
  that is the attention sink, without which retrieval fails (docs/methods/kvtc.md).
* Fixed size: LMCache's multiprocess path wants the serialized size to equal the estimate; kvtc's
  chunk size depends only on the token count and the allocation, so the estimate is exact. It is
  rounded up to ``align`` bytes (default 4096, which the native Redis ``resp`` adapter needs) and
  the remainder zero-filled; no entropy coder (its size would vary).
* A chunk whose checksum, calibration id, ratio or geometry does not match raises in
  ``deserialize``: LMCache then reports the load as failed (a miss), never garbage.
* Trust: the checksum catches accidents, not a hostile writer to the shared store. With
  ``KVPACK_STORE_KEY`` set (16+ bytes, the same in every process), chunks carry an HMAC-SHA256 over
  LMCache's key for the chunk (model, rank, group, salt, chunk hash), header and payload, and only
  chunks whose MAC verifies are loaded — a chunk can be neither forged nor served under another
  chunk's key. ``"require_mac": true`` makes the key mandatory (the serde refuses to start without it).
* Loads before stores (``"loads_first"``, default true): a request's prefetch does not queue behind
  the chunks other requests are storing (:mod:`kvpack.integrations.serde_processor`).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage telemetry from anything kvpack starts

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from ..storage.kvtc.chunk import ChunkCodec, ChunkError
from ..storage.kvtc.codec import load_calibration
from ..store.mac import KEY_ENV, store_key
from .serde_processor import LoadsFirstSerdeProcessor

SERDE_NAME = "kvtc"
DEFAULT_ALIGN = 4096
# A variable-size object: this magic, the DEFLATE stream's length, then the DEFLATE'd chunk (whose own
# digest or MAC, checked after inflating, covers it). A fixed-size chunk starts with the chunk magic.
DEFLATED_MAGIC = b"KVTCZ\x00\x00\x00"
_DEFLATED_HEAD = struct.Struct("<8sI")


def _deflate_bound(n: int) -> int:
    """zlib's compressBound: the most bytes DEFLATE can turn ``n`` bytes into."""
    return n + (n >> 12) + (n >> 14) + (n >> 25) + 13


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def mac_context(key: ObjectKey) -> bytes:
    """What a chunk's MAC binds it to: LMCache's whole key for it ('@' cannot occur in its fields)."""
    return f"{key.model_name}@{key.kv_rank}@{key.object_group_id}@{key.cache_salt}@".encode() + bytes(key.chunk_hash)


class KvtcChunkSerializer(Serializer):
    """Codes a chunk with :class:`ChunkCodec` into exactly :meth:`estimate_serialized_size` bytes, or
    with ``deflate_level`` set, DEFLATEs the coded chunk and returns its smaller size (a variable-size
    object, for adapters that store and load what the serializer reports)."""

    def __init__(self, codec: ChunkCodec, align: int = DEFAULT_ALIGN, deflate_level: int | None = None):
        self.codec, self.align, self.deflate_level = codec, align, deflate_level

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        if len(layout_desc.shapes) != 1:
            raise ValueError(f"the kvtc serde codes one KV tensor per chunk, got {len(layout_desc.shapes)}")
        shape = self.codec.shape_of(tuple(layout_desc.shapes[0]))
        self.codec.check_shape(shape)
        size = self.codec.serialized_size(shape, layout_desc.dtypes[0])
        if self.deflate_level is not None:  # an upper bound: DEFLATE can grow incompressible data a little
            size = _DEFLATED_HEAD.size + _deflate_bound(size)
        return _aligned(size, self.align)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        if src.tensor is None or dst.tensor is None:
            raise ValueError("the kvtc serde needs src and dst to have tensors")
        data = self.codec.encode(src.tensor, context=mac_context(key))
        if self.deflate_level is not None:
            stream = zlib.compress(data, self.deflate_level)
            data = _DEFLATED_HEAD.pack(DEFLATED_MAGIC, len(stream)) + stream
        size = _aligned(len(data), self.align)
        out = dst.tensor.view(torch.uint8).flatten()
        if out.numel() < size:
            raise ValueError(f"serialize buffer of {out.numel()} bytes, {size} needed")
        out[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out[len(data):size].zero_()
        return size


class KvtcChunkDeserializer(Deserializer):
    """Decodes a chunk into the caller's KV buffer (its shape and dtype); refuses a foreign or corrupted one."""

    def __init__(self, codec: ChunkCodec):
        self.codec = codec

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        if src.tensor is None or dst.tensor is None:
            raise ValueError("the kvtc serde needs src and dst to have tensors")
        shape = self.codec.shape_of(tuple(dst.tensor.shape))
        n = self.codec.serialized_size(shape, dst.tensor.dtype)
        raw = src.tensor.view(torch.uint8).flatten()
        if bytes(raw[:len(DEFLATED_MAGIC)].cpu().numpy()) == DEFLATED_MAGIC:
            data = _inflate(raw, n)
        else:
            data = raw[:n].cpu().numpy().tobytes()
        dst.tensor.copy_(self.codec.decode(data, shape, dtype=dst.tensor.dtype, context=mac_context(key)))


def _inflate(raw: torch.Tensor, chunk_bytes: int) -> bytes:
    """The coded chunk inside a variable-size object (at most ``chunk_bytes``: a stream that inflates to
    more is refused, not followed)."""
    if raw.numel() < _DEFLATED_HEAD.size:
        raise ChunkError("a DEFLATE'd kvtc object is shorter than its header")
    _, length = _DEFLATED_HEAD.unpack(bytes(raw[:_DEFLATED_HEAD.size].cpu().numpy()))
    if _DEFLATED_HEAD.size + length > raw.numel():
        raise ChunkError(f"a DEFLATE'd kvtc object states {length} bytes, {raw.numel() - _DEFLATED_HEAD.size} "
                         "are there")
    stream = raw[_DEFLATED_HEAD.size:_DEFLATED_HEAD.size + length].cpu().numpy().tobytes()
    try:
        inflater = zlib.decompressobj()
        data = inflater.decompress(stream, chunk_bytes + 1)
    except zlib.error as exc:
        raise ChunkError(f"a DEFLATE'd kvtc object does not inflate: {exc}") from None
    if len(data) > chunk_bytes or inflater.unconsumed_tail:
        raise ChunkError(f"a DEFLATE'd kvtc object inflates past the {chunk_bytes} bytes of its chunk")
    return data


def _flag(kwargs: dict[str, object], name: str, default: bool) -> bool:
    """The serde option ``name``, which must be true or false (JSON booleans) when given."""
    value = kwargs.get(name, default)
    if value not in (True, False):
        raise ValueError(f'kvtc serde: "{name}" must be true or false, got {value!r}')
    return bool(value)


def build_kvtc_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: ``calibration`` (directory, required), ``ratio`` (default 16),
    ``fused_order`` (``vllm_cpu``, default; or ``halves``), ``exact_tokens`` (default 4),
    ``align`` (bytes, default 4096), ``max_workers`` (default 1), ``require_mac`` (default false:
    refuse to start unless ``KVPACK_STORE_KEY`` is set), ``precision`` (the inverse PCA's: ``auto``,
    default; ``float32``, ``bfloat16``), ``deflate_level`` (default none: fixed-size objects; 0-9:
    DEFLATE'd variable-size objects, for adapters that keep the size the serializer reports),
    ``loads_first`` (default true: loads and stores on separate pools, a store's chunk held while a load
    is pending, :mod:`kvpack.integrations.serde_processor`; false: LMCache's one first-in-first-out pool)."""
    known = {"calibration", "ratio", "fused_order", "exact_tokens", "align", "max_workers", "require_mac", "precision",
             "deflate_level", "loads_first"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"kvtc serde: unknown option(s) {unknown}; known: {', '.join(sorted(known))}")
    if not isinstance(kwargs.get("calibration"), str):
        raise ValueError('kvtc serde: "calibration" (a directory written by `kvpack calibrate --key-rope post`) '
                         "is required")
    fused_order = str(kwargs.get("fused_order", "vllm_cpu"))
    key = store_key()
    if _flag(kwargs, "require_mac", False) and key is None:
        raise ValueError(f'kvtc serde: "require_mac" is set but {KEY_ENV} is not (the MAC key, 16+ bytes, the same '
                         "in every process sharing the store)")
    codec = ChunkCodec(load_calibration(kwargs["calibration"]), float(kwargs.get("ratio", 16)),
                       fused_order=fused_order, exact_tokens=int(kwargs.get("exact_tokens", 4)), mac_key=key,
                       precision=str(kwargs.get("precision", "auto")))
    align = int(kwargs.get("align", DEFAULT_ALIGN))
    if align < 1:
        raise ValueError(f"kvtc serde: align must be >= 1, got {align}")
    level = kwargs.get("deflate_level")
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 9):
        raise ValueError(f"kvtc serde: deflate_level must be an integer 0-9 (or absent: fixed size), got {level!r}")
    loads_first = _flag(kwargs, "loads_first", True)
    halves = (KvtcChunkSerializer(codec, align, level), KvtcChunkDeserializer(codec))
    workers = int(kwargs.get("max_workers", 1))
    if loads_first:
        return LoadsFirstSerdeProcessor(*halves, max_workers=workers)
    return AsyncSerdeProcessor(*halves, max_workers=workers)


_REGISTERED = threading.Lock()


def register() -> None:
    """Register the ``"kvtc"`` serde with LMCache (idempotent; done on import)."""
    with _REGISTERED:
        if SERDE_NAME not in get_registered_serde_types():
            register_serde_factory(SERDE_NAME, build_kvtc_serde)


register()
