"""kvtc for fixed-size KV chunks, as serving engines store them (LMCache: all layers of 256 tokens).

A chunk is ``[2, L, T, W]`` (keys and values separate) or ``[1, L, T, 2W]`` (K and V fused in the last
dimension), with ``L`` layers, ``T`` tokens and ``W = kv_heads · head_dim``. The shape of a fused
chunk does not say how its elements are laid out, so the codec is told (``fused_order``):

* ``vllm_cpu`` (default): what LMCache hands over from vLLM's CPU backend. vLLM's paged cache is
  ``NL x [NB, NH, BS, 2·head_size]``, and its CPU kernels (the ``vec`` ISA: AVX-512 without AMX, as
  on kvpack's machines) keep, per block and head, the keys transposed ``[head_size, BS]`` and then the
  values ``[BS, head_size]`` (read off vLLM's own ``cpu_attn_reshape_and_cache``). LMCache copies
  row ``o`` of head ``h`` of a block — which holds elements ``o·2d ..`` of that region, not token
  ``o`` — to chunk row ``block·BS + o``, columns ``h·2d ..``. A chunk is whole blocks (``BS = 128``).
  vLLM's ``amx`` ISA lays blocks out otherwise: vLLM picks it for bf16 caches on CPUs with AMX, so
  a bf16 ``vllm_cpu`` chunk is refused on such a CPU (:func:`check_vllm_cpu_layout`; fp32 and fp16
  caches keep the ``vec`` layout there too; docs/methods/kvtc.md);
* ``halves``: a row ``[K of every head | V of every head]`` (a token-major fused layout). Every token of the chunk
is coded — a chunk has no attention sinks or recent window of its own — with the calibration's PCA
basis and the bit allocation of one calibrated ratio: ``D = (X − μ) V``, each coded group of
coefficients quantized at its width with an fp16 shift and scale per token, bit-packed
(:func:`kvpack.storage.kvtc.coder.encode_coefficients`). The paper keeps the first 4 tokens (attention
sinks) and the last 128 lossless by position; a chunk knows neither, so it keeps ``exact_tokens``
tokens (default 4) exactly — those the coding reconstructs worst, which in a sequence's first chunk
is the attention sink (coding it breaks needle retrieval at every ratio on SmolLM2; keeping it
restores it: docs/methods/kvtc.md).

Positions: an engine hands over chunks by content hash, without their positions in the sequence, so
keys cannot be rotated back to pre-RoPE. This path therefore needs a calibration made on keys as
cached (``CalibrationSettings(key_rope="post")``, ``kvpack calibrate --key-rope post``); a pre-RoPE
calibration is refused. ``benchmarks/bench_kvtc_chunks.py`` measures the two side by side on
kvpack's own path, where positions are known.

Size: the serialized size depends only on ``T``, the dtype and the allocation (bit streams, fp16
side information and the exact tokens have fixed lengths), never on the data:
:meth:`ChunkCodec.serialized_size` is exact, as LMCache's multiprocess path requires. There is no
entropy coder here (its output size would vary); ``deflate_size`` reports what DEFLATE would give a
variable-size store.

Format: a fixed header — magic, version, layout, dtype, layers, tokens, width, the calibration id,
the ratio, the payload length — and a digest of header and payload, then the sections in a fixed
order. The digest is a SHA-256 (format version 1), or with a MAC key (``kvpack.store.mac``) an
HMAC-SHA256 over the caller's context (an engine's key for the chunk), header and payload (version
2): a writer without the key can neither forge a chunk nor pass one chunk off as another's.
:meth:`ChunkCodec.decode` refuses (``ChunkError``) a chunk whose digest, calibration id, ratio or
geometry does not match: never garbage.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

import torch

from ...ops.cpu_features import has_amx
from ...ops.finite import all_finite
from ...store.format import BlobError
from ...store.mac import KEY_ENV, mac
from .calibration import Calibration, ratio_key
from .coder import decode_coefficients, encode_coefficients, inverse_dtype

MAGIC = b"KVTCCHK\x00"
VERSION, KEYED_VERSION = 1, 2  # the digest: SHA-256 | HMAC-SHA256 under a key
LAYOUTS = ("separate", "fused_halves", "fused_vllm_cpu")  # [2, L, T, W] | [1, L, T, 2W] two ways
FUSED_ORDERS = ("vllm_cpu", "halves")
VLLM_CPU_BLOCK = 128  # vLLM's CPU block size: a vllm_cpu chunk is whole blocks
DTYPES = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
# magic, version, layout, dtype, layers, tokens, width, exact tokens, calibration id (ascii), ratio key (ascii),
# payload bytes
_HEAD = struct.Struct("<8sHBBHIIH32s8sI")
HEADER_BYTES = _HEAD.size
DIGEST_BYTES = 32
SECTIONS = ("keys_codes", "keys_shift", "keys_scale", "values_codes", "values_shift", "values_scale")


def check_vllm_cpu_layout(shape: ChunkShape, dtype: torch.dtype) -> None:
    """Refuse a ``vllm_cpu`` chunk whose blocks vLLM lays out with its ``amx`` kernels: vLLM chooses
    them for bf16 caches on CPUs with AMX tiles (``_get_attn_isa`` in vllm/v1/attention/backends/
    cpu_attn.py; every block is 128 tokens, a multiple of 32), whose layout this codec does not read."""
    if shape.layout == "fused_vllm_cpu" and dtype == torch.bfloat16 and has_amx():
        raise ValueError("a bf16 vllm_cpu chunk on a CPU with AMX: vLLM's amx kernels lay these KV blocks out in a "
                         "way the vllm_cpu order does not describe (it is the AVX-512 'vec' layout, which vLLM "
                         "uses here for fp32 and fp16 caches); run vLLM with dtype float32 or float16")


class ChunkError(BlobError):
    """A serialized chunk that is corrupted, truncated or made with another calibration or ratio."""


@dataclass(frozen=True)
class ChunkShape:
    """Geometry of one chunk: ``layout`` (one of :data:`LAYOUTS`), layers, tokens, per-layer width."""

    layout: str
    layers: int
    tokens: int
    width: int

    @classmethod
    def of(cls, shape: tuple[int, ...] | torch.Size, fused_order: str = "vllm_cpu") -> ChunkShape:
        """The geometry of a KV chunk tensor shape, a fused one read in ``fused_order`` (``ValueError``
        for anything else)."""
        if len(shape) != 4 or shape[0] not in (1, 2):
            raise ValueError(f"a KV chunk is [2, layers, tokens, width] or [1, layers, tokens, 2*width], "
                             f"got {list(shape)}")
        if shape[0] == 2:
            return cls("separate", shape[1], shape[2], shape[3])
        if shape[3] % 2:
            raise ValueError(f"a fused K|V chunk has an even last dimension, got {list(shape)}")
        if fused_order not in FUSED_ORDERS:
            raise ValueError(f"fused_order must be one of {FUSED_ORDERS}, got {fused_order!r}")
        if fused_order == "vllm_cpu" and shape[2] % VLLM_CPU_BLOCK:
            raise ValueError(f"a vllm_cpu chunk is whole {VLLM_CPU_BLOCK}-token blocks, got {shape[2]} tokens")
        return cls(f"fused_{fused_order}", shape[1], shape[2], shape[3] // 2)

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        if self.layout == "separate":
            return 2, self.layers, self.tokens, self.width
        return 1, self.layers, self.tokens, 2 * self.width


class ChunkCodec:
    """kvtc coding of fixed-geometry KV chunks with one calibration at one calibrated ratio.

    Args:
        calibration: a calibration with post-RoPE key features that covers every layer of a chunk.
        ratio: one of the calibration's ratios.
        fused_order: how a fused ``[1, L, T, 2W]`` chunk is laid out: ``vllm_cpu`` (default) or
            ``halves`` (see the module doc).
        exact_tokens: tokens of each chunk kept exactly, in the chunk's dtype (default 4, the
            paper's count of attention sinks; 0 = none). A chunk does not know its position, so they
            are the tokens that PCA coding reconstructs worst (largest squared error over all layers'
            keys and values): in a sequence's first chunk the attention sink, whose coding alone
            breaks retrieval (``benchmarks/bench_kvtc_chunks.py`` measures it).
        mac_key: with a key (``kvpack.store.mac.store_key``), chunks are written with an
            HMAC-SHA256 digest and only chunks whose MAC verifies are decoded.
        precision: the inverse PCA's arithmetic (:func:`kvpack.storage.kvtc.coder.inverse_dtype`:
            ``auto``, ``float32``, ``bfloat16``), for decoding and for choosing the exact tokens.
    """

    def __init__(self, calibration: Calibration, ratio: float, fused_order: str = "vllm_cpu", exact_tokens: int = 4,
                 mac_key: bytes | None = None, precision: str = "auto"):
        if fused_order not in FUSED_ORDERS:
            raise ValueError(f"fused_order must be one of {FUSED_ORDERS}, got {fused_order!r}")
        if isinstance(exact_tokens, bool) or not isinstance(exact_tokens, int) or not 0 <= exact_tokens <= 4096:
            raise ValueError(f"exact_tokens must be an integer in [0, 4096], got {exact_tokens!r}")
        if calibration.key_rope != "post":
            raise ValueError(
                "chunks come without their token positions, so their keys cannot be rotated back before RoPE: "
                "this calibration codes pre-RoPE keys. Make one on keys as cached: "
                "`kvpack calibrate --key-rope post --out DIR`")
        if calibration.layers != list(range(len(calibration.layers))):
            raise ValueError(f"kvtc chunks need every layer to be a full-attention layer the calibration covers; "
                             f"it covers layers {calibration.layers}")
        self.fused_order, self.exact_tokens = fused_order, exact_tokens
        self.mm_dtype = inverse_dtype(precision)
        self.mac_key = mac_key
        self.calibration = calibration
        self.ratio = float(ratio)
        self.alloc = calibration.allocation(ratio)
        self.width = calibration.kv_heads * calibration.head_dim
        self.layers = len(calibration.layers)
        self._ids = (calibration.calibration_id.encode("ascii")[:32], ratio_key(ratio).encode("ascii")[:8])

    # -- geometry ------------------------------------------------------------------------------

    def shape_of(self, shape: tuple[int, ...] | torch.Size) -> ChunkShape:
        """The geometry of a chunk tensor shape as this codec reads it."""
        return ChunkShape.of(shape, self.fused_order)

    def check_shape(self, shape: ChunkShape) -> None:
        if shape.layers != self.layers or shape.width != self.width:
            raise ValueError(
                f"a chunk of {shape.layers} layers x {shape.width} per token does not fit the calibration "
                f"({self.layers} layers x {self.calibration.kv_heads} KV heads x {self.calibration.head_dim})")

    def _exact(self, tokens: int) -> int:
        return min(self.exact_tokens, tokens)

    def coded_size(self, tokens: int) -> int:
        """Bytes of the PCA-coded sections for ``tokens`` tokens (exact, data-independent)."""
        total = 0
        for kind in ("keys", "values"):
            coded = self.alloc[kind].coded_groups()
            total += sum((tokens * size * width + 7) // 8 for _, size, width in coded)
            total += 2 * tokens * len(coded) * 2  # fp16 shift and scale per token and group
        return total

    def payload_size(self, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes after the header: the coded sections, then the exact tokens (int16 index, keys and
        values of every layer in ``dtype``)."""
        exact = self._exact(tokens)
        return self.coded_size(tokens) + exact * (2 + 2 * self.layers * self.width * dtype.itemsize)

    def serialized_size(self, shape: ChunkShape, dtype: torch.dtype = torch.bfloat16) -> int:
        """The exact serialized size of a chunk of this geometry and dtype."""
        return _HEAD.size + DIGEST_BYTES + self.payload_size(shape.tokens, dtype)

    # -- coding --------------------------------------------------------------------------------

    def _digest(self, context: bytes, head: bytes, payload: bytes) -> bytes:
        if self.mac_key is None:
            return hashlib.sha256(head + payload).digest()
        return mac(self.mac_key, len(context).to_bytes(4, "little") + context + head + payload)

    def encode(self, chunk: torch.Tensor, context: bytes = b"") -> bytes:
        """``chunk`` (see the module doc; bf16, fp16 or fp32) → exactly :meth:`serialized_size` bytes.
        ``context``: what the MAC binds the chunk to besides its bytes (an engine's key for it)."""
        shape = self.shape_of(chunk.shape)
        self.check_shape(shape)
        check_vllm_cpu_layout(shape, chunk.dtype)
        if chunk.dtype not in DTYPE_CODES:
            raise ValueError(f"a KV chunk must be bfloat16, float16 or float32, got {chunk.dtype}")
        chunk = chunk.detach().to("cpu")
        keys, values = _split(chunk, shape, self.calibration.head_dim)  # [T, L*W] fp32
        if not (all_finite(keys) and all_finite(values)):
            raise ValueError("the chunk contains NaN or Inf")
        cal = self.calibration
        sections = {**encode_coefficients(keys, cal.key_mean, cal.key_basis, self.alloc["keys"], "keys"),
                    **encode_coefficients(values, cal.value_mean, cal.value_basis, self.alloc["values"], "values")}
        parts = [sections[name].contiguous().view(torch.uint8).numpy().tobytes() for name in SECTIONS]
        exact = self._exact(shape.tokens)
        if exact:  # the tokens the coding reconstructs worst, kept as they are (in the chunk's dtype)
            k_hat, v_hat = self._reconstruct(sections, shape.tokens)
            error = (k_hat - keys).square().sum(-1) + (v_hat - values).square().sum(-1)
            rows = error.topk(exact).indices.sort().values
            raw_k, raw_v = _split_raw(chunk, shape, self.calibration.head_dim)
            parts += [rows.to(torch.int16).numpy().tobytes(),
                      raw_k[rows].contiguous().view(torch.uint8).numpy().tobytes(),
                      raw_v[rows].contiguous().view(torch.uint8).numpy().tobytes()]
        payload = b"".join(parts)
        if len(payload) != self.payload_size(shape.tokens, chunk.dtype):  # the fixed size is the contract
            raise AssertionError(f"payload of {len(payload)} bytes, expected {self.payload_size(shape.tokens)}")
        version = VERSION if self.mac_key is None else KEYED_VERSION
        head = _HEAD.pack(MAGIC, version, LAYOUTS.index(shape.layout), DTYPE_CODES[chunk.dtype], shape.layers,
                          shape.tokens, shape.width, exact, *self._ids, len(payload))
        return head + self._digest(context, head, payload) + payload

    def decode(self, data: bytes | bytearray | memoryview, shape: ChunkShape | None = None,
               dtype: torch.dtype | None = None, context: bytes = b"") -> torch.Tensor:
        """The chunk back (in ``dtype``, default the dtype it was encoded from) in its layout.

        Args:
            shape: the geometry the caller expects (refused when the chunk's differs).
            context: what the chunk was encoded with (checked by the MAC when there is a key).

        Raises:
            ChunkError: truncated, corrupted, or made with another calibration, ratio or geometry.
        """
        data = bytes(data)
        if len(data) < _HEAD.size + DIGEST_BYTES:
            raise ChunkError(f"kvtc chunk of {len(data)} bytes is shorter than its header")
        head, digest = data[:_HEAD.size], data[_HEAD.size:_HEAD.size + DIGEST_BYTES]
        magic, version, layout, dtype_code, layers, tokens, width, exact, cal_id, ratio, n = _HEAD.unpack(head)
        if magic != MAGIC:
            raise ChunkError("not a kvtc chunk (bad magic)")
        expected = VERSION if self.mac_key is None else KEYED_VERSION
        if version == KEYED_VERSION and self.mac_key is None:
            raise ChunkError(f"kvtc chunk carries a MAC; set {KEY_ENV} to check it")
        if version == VERSION and self.mac_key is not None:
            raise ChunkError("kvtc chunk has no MAC, and this codec requires one on every chunk")
        if version != expected:
            raise ChunkError(f"kvtc chunk format version {version} is not supported (expected {expected})")
        start = _HEAD.size + DIGEST_BYTES
        if len(data) < start + n:
            raise ChunkError(f"kvtc chunk is truncated: {len(data) - start} payload bytes of {n}")
        payload = data[start:start + n]
        if not hmac.compare_digest(self._digest(context, head, payload), digest):
            raise ChunkError("kvtc chunk is corrupted (checksum mismatch)" if self.mac_key is None else
                             "kvtc chunk's MAC does not verify (corrupted, forged, another chunk's, or another key)")
        if (cal_id.rstrip(b"\x00"), ratio.rstrip(b"\x00")) != tuple(x.rstrip(b"\x00") for x in self._ids):
            raise ChunkError(f"kvtc chunk was made with calibration {cal_id.rstrip(bytes(1)).decode(errors='replace')} "
                             f"at ratio {ratio.rstrip(bytes(1)).decode(errors='replace')}, not "
                             f"{self.calibration.calibration_id} at {ratio_key(self.ratio)}")
        if layout >= len(LAYOUTS) or dtype_code not in DTYPES:
            raise ChunkError(f"kvtc chunk has an unknown layout {layout} or dtype {dtype_code}")
        found = ChunkShape(LAYOUTS[layout], layers, tokens, width)
        if shape is not None and found != shape:
            raise ChunkError(f"kvtc chunk holds {found}, the caller expects {shape}")
        self.check_shape(found)
        stored_dtype = DTYPES[dtype_code]
        check_vllm_cpu_layout(found, dtype or stored_dtype)
        if exact != self._exact(tokens) or n != self.payload_size(tokens, stored_dtype):
            raise ChunkError(f"kvtc chunk has {exact} exact tokens and {n} payload bytes; this codec expects "
                             f"{self._exact(tokens)} and {self.payload_size(tokens, stored_dtype)}")
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        keys, values = self._reconstruct(self._sections(buf, tokens), tokens)
        if exact:
            offset = self.coded_size(tokens)
            rows = buf[offset:offset + 2 * exact].view(torch.int16).long()
            if bool((rows < 0).any() or (rows >= tokens).any()) or rows.unique().numel() != exact:
                raise ChunkError("kvtc chunk's exact-token indices are out of range or repeated")
            offset += 2 * exact
            size = exact * self.layers * self.width * stored_dtype.itemsize
            for target, lo in ((keys, offset), (values, offset + size)):
                target[rows] = buf[lo:lo + size].view(stored_dtype).reshape(exact, -1).float()
        return _join(keys, values, found, self.calibration.head_dim).to(dtype or stored_dtype)

    def _reconstruct(self, sections, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``X = D V_rᵀ + μ`` ``[T, p]`` for keys and values, from the coded sections."""
        cal, get = self.calibration, sections.__getitem__
        out = []
        for kind, mean in (("keys", cal.key_mean), ("values", cal.value_mean)):
            alloc = self.alloc[kind]
            coeffs = decode_coefficients(get, alloc, kind, tokens, self.mm_dtype)
            x = (coeffs @ cal.inverse_basis(kind, None, alloc.coded_extent, self.mm_dtype)).float()
            out.append(x.add_(mean))
        return out[0], out[1]

    def _sections(self, buf: torch.Tensor, tokens: int) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for kind in ("keys", "values"):
            coded = self.alloc[kind].coded_groups()
            n_codes = sum((tokens * size * width + 7) // 8 for _, size, width in coded)
            side = tokens * len(coded) * 2
            out[f"{kind}_codes"] = buf[offset:offset + n_codes]
            offset += n_codes
            for name in ("shift", "scale"):
                out[f"{kind}_{name}"] = buf[offset:offset + side].view(torch.float16).reshape(tokens, len(coded))
                offset += side
        return out

    def deflate_size(self, data: bytes, level: int = 6) -> int:
        """Bytes the chunk would take with its payload DEFLATE-d (for variable-size stores; not used here)."""
        start = _HEAD.size + DIGEST_BYTES
        return start + len(zlib.compress(data[start:], level))


def _split_raw(chunk: torch.Tensor, shape: ChunkShape, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` as ``[T, L·W]`` in the chunk's own dtype (the exact tokens' bytes)."""
    if shape.layout == "separate":
        k, v = chunk[0], chunk[1]
    elif shape.layout == "fused_halves":
        k, v = chunk[0, ..., :shape.width], chunk[0, ..., shape.width:]
    else:  # vllm_cpu: per layer, block and head, K [d, BS] then V [BS, d] (see the module doc)
        L, heads, bs, nb = shape.layers, shape.width // head_dim, VLLM_CPU_BLOCK, shape.tokens // VLLM_CPU_BLOCK
        regions = chunk[0].reshape(L, nb, bs, heads, 2 * head_dim).permute(0, 1, 3, 2, 4)
        regions = regions.reshape(L, nb, heads, bs * 2 * head_dim)
        k = regions[..., :bs * head_dim].reshape(L, nb, heads, head_dim, bs).permute(0, 1, 4, 2, 3)
        v = regions[..., bs * head_dim:].reshape(L, nb, heads, bs, head_dim).permute(0, 1, 3, 2, 4)
        k, v = (x.reshape(L, shape.tokens, shape.width) for x in (k, v))
    flat = lambda x: x.permute(1, 0, 2).reshape(shape.tokens, shape.layers * shape.width)  # noqa: E731
    return flat(k), flat(v)


def _split(chunk: torch.Tensor, shape: ChunkShape, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` as ``[T, L·W]`` fp32 features (layer-major, then head-major, as the calibration's)."""
    k, v = _split_raw(chunk, shape, head_dim)
    return k.float(), v.float()


def _join(keys: torch.Tensor, values: torch.Tensor, shape: ChunkShape, head_dim: int) -> torch.Tensor:
    per_layer = lambda x: x.reshape(shape.tokens, shape.layers, shape.width).permute(1, 0, 2)  # noqa: E731
    k, v = per_layer(keys), per_layer(values)
    if shape.layout == "separate":
        return torch.stack([k, v])
    if shape.layout == "fused_halves":
        return torch.cat([k, v], dim=-1)[None]
    L, heads, bs, nb = shape.layers, shape.width // head_dim, VLLM_CPU_BLOCK, shape.tokens // VLLM_CPU_BLOCK
    blocks = lambda x: x.reshape(L, nb, bs, heads, head_dim)  # noqa: E731
    k_raw = blocks(k).permute(0, 1, 3, 4, 2).reshape(L, nb, heads, head_dim * bs)  # K [d, BS]
    v_raw = blocks(v).permute(0, 1, 3, 2, 4).reshape(L, nb, heads, bs * head_dim)  # V [BS, d]
    regions = torch.cat([k_raw, v_raw], dim=-1)  # vLLM's memory of each (block, head)
    rows = regions.reshape(L, nb, heads, bs, 2 * head_dim).permute(0, 1, 3, 2, 4)  # LMCache's rows
    return rows.reshape(1, L, shape.tokens, 2 * shape.width)
