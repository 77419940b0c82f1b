"""``lmcache_quant``: LMCache's own quantizing serdes — TurboQuant and fp8 — as a storage peer in kvpack's harness.

LMCache (``pip install "kvpack[lmcache]"``) compresses KV caches on their way to its L2 stores with a *serde*:
``fp8`` casts every value to fp8; ``turboquant`` (a port of vLLM's TurboQuant cache: a random-sign Hadamard
rotation of each normalized key, Lloyd–Max scalar codes of its coordinates and the key's norm, min/max codes of
the values; ICLR 2026) in four presets. This codec runs the serde's own ``Serializer.serialize`` and
``Deserializer.deserialize`` over the cache, chunk by chunk, as LMCache does between a prefill and the next
request that reuses it; attention then reads the decoded cache, and the bytes are what the serde emitted.

* **Chunks.** LMCache stores a sequence in chunks of ``chunk_tokens`` (its ``chunk_size``, 256), each
  ``[2, layers, tokens, kv_heads·head_dim]`` in the cache's dtype; each is serialized on its own (TurboQuant pads a
  chunk's tokens to its ``block_size``, so only the last, partial chunk pays padding).
* **Layers kept raw.** TurboQuant keeps its ``skip_first_layers`` and ``skip_last_layers`` (LMCache's default: 2
  and 2) as raw bytes of the cache's dtype; they count.
* **Kernels.** TurboQuant's store and load are Triton kernels. ``kernels="torch"`` (the default) swaps those three
  kernels — only them — for :mod:`.kernels`' vectorized PyTorch ports, which write the same bytes (checked
  against LMCache's kernels under Triton's interpreter in the tests); ``kernels="triton"`` runs LMCache's
  kernels: compiled on a GPU (the cache is moved there), interpreted on a CPU under ``TRITON_INTERPRET=1`` (about
  22 ms per token and KV head, so only for checking). fp8 has no kernels. On a CPU, LMCache's CUDA staging
  device is bypassed: the serde runs on the tensors' own device.
* **The container** is kvpack's blob (:mod:`kvpack.store.format`, no entropy coder: ``none``): a JSON header (the
  serde's settings, the model's fingerprint, the token count and digest, LMCache's version) and two sections,
  the token ids and the serde's bytes of every chunk back to back. The blob's length — the serde's bytes plus
  about 4 bytes a token of ids and a header of ~1 kB — is what the harness charges.

Models whose layers differ in what they hold (sliding windows, per-layer head counts) are refused: LMCache's
layout needs every layer to hold every token in one shape.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import threading
import time
from dataclasses import dataclass

import torch

from ...config import MethodConfig, choice, integer, number, option
from ...hf.dense import to_dynamic_cache
from ...hf.fingerprint import model_fingerprint
from ...hf.generation import GenerationResult, ProgressStreamer, check_context, context_limit, greedy_generate
from ...ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ...ops.finite import all_finite
from ...store.format import Blob, pack_blob, tokens_digest
from ...store.schema import BlobError, ForeignBlobError, check_fields, get_int, get_object, get_str
from ..base import DenseKV, DenseLayer, StorageCodec
from . import kernels

CODEC = "lmcache_quant"
SERDES = ("turboquant", "fp8")
TURBOQUANT_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FIELDS = {"codec", "serde", "preset", "fp8_dtype", "block_size", "skip_first_layers", "skip_last_layers",
          "chunk_tokens", "model", "tokens", "tokens_sha256", "num_layers", "kv_heads", "head_dim", "cache_dtype",
          "dense_bf16_bytes", "lmcache", "backend", "sections"}
SETTINGS = ("serde", "preset", "fp8_dtype", "block_size", "skip_first_layers", "skip_last_layers", "chunk_tokens")

_PATCH_LOCK = threading.Lock()  # the kernel swap below changes LMCache's module attributes: one serde call at a time


@dataclass(frozen=True)
class LMCacheQuantConfig(MethodConfig):
    """One of LMCache's quantizing serdes, with LMCache's defaults.

    Attributes:
        serde: ``turboquant`` or ``fp8``.
        preset: TurboQuant's preset (``turboquant_k8v4``: fp8 keys, 4-bit values; ``turboquant_4bit_nc`` /
            ``turboquant_k3v4_nc`` / ``turboquant_3bit_nc``: 4- / 3-bit Lloyd–Max keys with norm correction, 4- /
            4- / 3-bit values). Ignored by fp8.
        fp8_dtype: fp8's format (``float8_e4m3fn``, LMCache's default, or ``float8_e5m2``). Ignored by TurboQuant.
        block_size, skip_first_layers, skip_last_layers: TurboQuant's token block and the leading / trailing
            layers it keeps raw (LMCache's defaults 16, 2, 2).
        chunk_tokens: tokens per LMCache chunk (its ``chunk_size``, 256), each serialized on its own.
        kernels: TurboQuant's kernels: ``torch`` (vectorized ports, same bytes) or ``triton`` (LMCache's).
        budget: none — the bytes follow the serde (a budget is refused).
    """

    budget: float | None = option(None, number(0.0, 1.0, low_open=True, optional=True),
                                  "none: the bytes follow the serde")
    storage_dtype: str = option("auto", choice("auto"), "auto: the serde sees the model's dtype, as in LMCache")
    serde: str = option("turboquant", choice(*SERDES), "LMCache's serde")
    preset: str = option("turboquant_k8v4", choice(*TURBOQUANT_PRESETS), "TurboQuant's preset")
    fp8_dtype: str = option("float8_e4m3fn", choice(*FP8_DTYPES), "fp8's format")
    block_size: int = option(16, integer(minimum=1, maximum=4096), "TurboQuant's token block")
    skip_first_layers: int = option(2, integer(minimum=0), "leading layers TurboQuant keeps raw")
    skip_last_layers: int = option(2, integer(minimum=0), "trailing layers TurboQuant keeps raw")
    chunk_tokens: int = option(256, integer(minimum=1, maximum=1 << 20), "tokens per LMCache chunk")
    kernels: str = option("torch", choice("torch", "triton"), "TurboQuant's kernels: PyTorch ports or LMCache's")

    def check(self) -> None:
        if self.budget is not None:
            raise self.error(f"budget {self.budget:g} is not a setting of lmcache_quant: its bytes follow the serde")


def _lmcache_version() -> str:
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


class _Obj:
    """The one field of LMCache's ``MemoryObj`` its serdes read: ``tensor``."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class LMCacheQuantCodec(StorageCodec):
    """LMCache's fp8 / TurboQuant serde round trip (see the module doc)."""

    Config = LMCacheQuantConfig
    budgeted = False

    # -- the serde -----------------------------------------------------------------------------

    def _serde(self, head_dim: int):
        """``(serializer, deserializer, serialized_bytes(shape, dtype))`` of LMCache's serde."""
        if importlib.util.find_spec("lmcache") is None:
            raise ImportError('lmcache_quant needs LMCache: pip install "kvpack[lmcache]"')
        c = self.config
        if c.serde == "fp8":
            from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationDeserializer, Fp8QuantizationSerializer

            fp8 = getattr(torch, c.fp8_dtype)
            return (Fp8QuantizationSerializer(fp8), Fp8QuantizationDeserializer(fp8),
                    lambda shape, dtype: int(torch.Size(shape).numel()))
        from lmcache.v1.distributed.serde.turboquant import turboquant as tq

        cfg = self._turboquant_config(head_dim)
        return (tq.TurboQuantSerializer(cfg), tq.TurboQuantDeserializer(cfg),
                lambda shape, dtype: tq._serialized_nbytes_for_shape(torch.Size(shape), dtype, cfg))

    def _turboquant_config(self, head_dim: int):
        """LMCache's ``TurboQuantSerdeConfig`` of this codec's settings."""
        from lmcache.v1.distributed.serde.turboquant import turboquant as tq

        c = self.config
        return tq.TurboQuantSerdeConfig(preset=c.preset, head_dim=head_dim, block_size=c.block_size,
                                        skip_first_layers=c.skip_first_layers, skip_last_layers=c.skip_last_layers)

    @contextlib.contextmanager
    def _on_device(self, device: torch.device):
        """Run TurboQuant's serde on ``device``: on a CPU, LMCache's CUDA staging device is replaced by the
        tensors' own device, fp8 is Hopper's format (e4m3fn), and with ``kernels="torch"`` the three Triton
        kernels by their ports. LMCache's module attributes are restored on exit."""
        if self.config.serde != "turboquant":
            yield
            return
        from lmcache.v1.distributed.serde.turboquant import decode_kernel, store_kernel
        from lmcache.v1.distributed.serde.turboquant import turboquant as tq

        swaps: list[tuple[object, str, object]] = []
        if device.type == "cpu":
            if self.config.kernels == "triton" and not _interpreting():
                raise RuntimeError("lmcache_quant with kernels='triton' on a CPU runs LMCache's Triton kernels under "
                                   "Triton's interpreter: set TRITON_INTERPRET=1 before anything imports triton "
                                   "(about 22 ms per token and KV head), or use kernels='torch'")
            swaps.append((tq, "_select_cuda_device", lambda *args, **kwargs: device))
        if self.config.kernels == "torch":
            swaps += [(store_kernel, "_tq_fused_store_mse", kernels.STORE_MSE),
                      (store_kernel, "_tq_fused_store_fp8", kernels.STORE_FP8),
                      (decode_kernel, "_tq_full_dequant_kv", kernels.FULL_DEQUANT)]
        with _PATCH_LOCK:
            saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
            capability = decode_kernel._FP8_E4B15.get(device.index or 0)
            try:
                for module, name, value in swaps:
                    setattr(module, name, value)
                if device.type == "cpu":
                    decode_kernel._FP8_E4B15[device.index or 0] = 0  # e4nv = e4m3fn, no CUDA capability to ask
                yield
            finally:
                for module, name, value in saved:
                    setattr(module, name, value)
                if device.type == "cpu":
                    if capability is None:
                        decode_kernel._FP8_E4B15.pop(device.index or 0, None)
                    else:
                        decode_kernel._FP8_E4B15[device.index or 0] = capability

    def _zero_padding(self, out: torch.Tensor, shape, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """``out`` (one chunk's serialized bytes) with the bytes TurboQuant leaves unwritten set to zero: the
        slots of a partial last block's missing tokens and each slot's alignment byte, which its serializer
        copies from an uninitialized staging buffer (so a blob would carry stray process memory and differ
        between runs). fp8 writes every byte."""
        if self.config.serde != "turboquant":
            return out
        from lmcache.v1.distributed.serde.turboquant import turboquant as tq

        cfg = self._turboquant_config(head_dim)
        start, end = tq._layer_ranges(shape[1], cfg)
        if end == start:
            return out
        layout = tq._compressed_layout_for_shape(torch.Size(shape), cfg, end - start)
        first = tq._raw_group_nbytes(torch.Size(shape), dtype, start)
        coded = out[first:first + int(torch.Size(layout).numel())].view(*layout)
        tokens = shape[2]
        if tokens % cfg.block_size:
            coded[:, -1, tokens % cfg.block_size:] = 0
        coded[..., cfg.slot_size:] = 0
        return out

    def _device(self) -> torch.device:
        if self.config.serde == "turboquant" and self.config.kernels == "triton" and torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")

    # -- the model ----------------------------------------------------------------------------

    def check_model(self, model) -> None:
        self._check_fingerprint(model_fingerprint(model))

    def _check_fingerprint(self, fp: dict) -> None:
        """Refuse a model (by its fingerprint) whose cache LMCache's chunks or TurboQuant cannot hold."""
        if len(fp["full_layers"]) != fp["layers"]:
            raise ValueError(f"lmcache_quant needs every layer to hold every token in one shape (LMCache's "
                             f"[2, layers, tokens, hidden] chunks); {fp['architecture']} has "
                             f"{fp['layers'] - len(fp['full_layers'])} sliding-window layers")
        d = fp["head_dim"]
        if self.config.serde == "turboquant" and (d < 8 or d & (d - 1)):
            raise ValueError(f"LMCache's TurboQuant needs a head dim that is a power of two (its Hadamard "
                             f"rotation), {fp['architecture']} has {d}")

    def dense_bytes(self, blob: bytes) -> int:
        return get_int(Blob(blob).meta, "dense_bf16_bytes", minimum=0, maximum=1 << 62)

    def describe(self) -> dict:
        return {**self.config.to_dict(), "lmcache": _lmcache_version()}

    # -- compress / decompress --------------------------------------------------------------

    def _settings(self) -> dict:
        return {name: getattr(self.config, name) for name in SETTINGS}

    def compress(self, model, cache, token_ids: list[int]) -> bytes:
        """The serde's bytes of a filled one-sequence cache (``cache.layers[i].keys [1, kv_heads, T, d]``)."""
        fingerprint = model_fingerprint(model)  # once: it hashes a sample of every weight
        self._check_fingerprint(fingerprint)
        n = len(token_ids)
        if n == 0:
            raise ValueError("cannot compress an empty cache (no tokens)")
        layers = cache.layers
        keys0 = layers[0].keys
        heads, d, dtype = keys0.shape[1], keys0.shape[3], keys0.dtype
        if dtype not in CACHE_DTYPES.values():
            raise ValueError(f"lmcache_quant stores caches of {', '.join(CACHE_DTYPES)}, not {dtype}")
        for i, layer in enumerate(layers):
            for side, t in (("keys", layer.keys), ("values", layer.values)):
                if t is None or tuple(t.shape) != (1, heads, n, d) or t.dtype != dtype:
                    shape = None if t is None else tuple(t.shape)
                    raise ValueError(f"cache layer {i} {side}: expected [1, {heads}, {n}, {d}] {dtype} for the "
                                     f"{n} tokens, got {shape}")
        for i, layer in enumerate(layers):
            if not (all_finite(layer.keys) and all_finite(layer.values)):
                raise ValueError(f"cache layer {i} holds NaN or Inf: refused before LMCache's serde codes it")
        device = self._device()
        serializer, _, size = self._serde(d)
        # LMCache's layout: [2, layers, tokens, kv_heads·head_dim]
        kv = torch.stack([torch.stack([layer.keys[0] for layer in layers]),
                          torch.stack([layer.values[0] for layer in layers])])
        kv = kv.permute(0, 1, 3, 2, 4).reshape(2, len(layers), n, heads * d)
        pieces = []
        with self._on_device(device):
            for start in range(0, n, self.config.chunk_tokens):
                chunk = kv[:, :, start:start + self.config.chunk_tokens].contiguous().to(device)
                out = torch.zeros(size(chunk.shape, dtype), dtype=torch.uint8, device=device)
                written = serializer.serialize(_Obj(chunk), _Obj(out), None)
                if written != out.numel():
                    raise RuntimeError(f"LMCache's {self.config.serde} serde wrote {written} bytes of a chunk, "
                                       f"its own size says {out.numel()}")
                pieces.append(self._zero_padding(out.cpu(), chunk.shape, dtype, d))
        meta = {"codec": CODEC, **self._settings(), "model": fingerprint, "tokens": n,
                "tokens_sha256": tokens_digest(token_ids), "num_layers": len(layers), "kv_heads": heads,
                "head_dim": d, "cache_dtype": str(dtype).removeprefix("torch."),
                "dense_bf16_bytes": 2 * len(layers) * n * heads * d * DENSE_REFERENCE_BYTES_PER_ELEMENT,
                "lmcache": _lmcache_version()}
        sections = {"token_ids": torch.tensor(token_ids, dtype=torch.int32), "serde_bytes": torch.cat(pieces)}
        return pack_blob(meta, sections, backend="none")

    def _read(self, data: bytes, model) -> tuple[Blob, dict]:
        """The verified blob and its checked header, refused when written with other settings or for another
        model."""
        blob = Blob(data)
        meta = blob.meta
        if meta.get("codec") != CODEC:
            raise BlobError(f"blob was written by codec {meta.get('codec')!r:.40}, not {CODEC!r}")
        check_fields(meta, FIELDS)
        stored = {name: meta.get(name) for name in SETTINGS}
        if stored != self._settings():
            diff = {k: stored[k] for k in SETTINGS if stored[k] != self._settings()[k]}
            raise ForeignBlobError(f"blob was written with other lmcache_quant settings ({diff}); this codec has "
                                   f"{ {k: self._settings()[k] for k in diff} }")
        fp = model_fingerprint(model)
        stored_model = get_object(meta, "model")
        if get_str(stored_model, "hash", "blob header's model") != fp["hash"]:
            raise ForeignBlobError(f"blob was written for another model ({stored_model.get('architecture')!r:.60}, "
                                   f"hash {stored_model.get('hash')!r:.40}); this is {fp['architecture']} "
                                   f"({fp['hash']})")
        n = get_int(meta, "tokens", minimum=1, maximum=1 << 24)
        for name, value in (("num_layers", fp["layers"]), ("kv_heads", fp["kv_heads"]), ("head_dim", fp["head_dim"])):
            if get_int(meta, name, minimum=1, maximum=1 << 16) != value:
                raise BlobError(f"blob header's {name} {meta[name]} does not match the model's {value}")
        if get_str(meta, "cache_dtype") not in CACHE_DTYPES:
            raise BlobError(f"blob header's cache_dtype {meta['cache_dtype']!r:.40} is not one of {list(CACHE_DTYPES)}")
        limit = context_limit(model)
        if limit is not None and n > limit:
            raise ValueError(f"blob holds {n} tokens, more than the model's context of {limit} tokens")
        return blob, meta

    def decompress(self, model, blob: bytes) -> tuple[DenseKV, list[int]]:
        parsed, meta = self._read(blob, model)
        n, layers, heads, d = meta["tokens"], meta["num_layers"], meta["kv_heads"], meta["head_dim"]
        dtype = CACHE_DTYPES[meta["cache_dtype"]]
        ids = parsed.section("token_ids")
        if ids.dtype != torch.int32 or tuple(ids.shape) != (n,):
            raise BlobError(f"token_ids section: expected {n} int32, got {tuple(ids.shape)} {ids.dtype}")
        if tokens_digest(ids.tolist()) != meta["tokens_sha256"]:
            raise BlobError("token ids do not match the header's digest")
        payload = parsed.section("serde_bytes")
        device = self._device()
        _, deserializer, size = self._serde(d)
        starts = range(0, n, self.config.chunk_tokens)
        shapes = [(2, layers, min(self.config.chunk_tokens, n - s), heads * d) for s in starts]
        sizes = [size(shape, dtype) for shape in shapes]
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (sum(sizes),):
            raise BlobError(f"serde_bytes section: expected {sum(sizes)} bytes for {n} tokens in chunks of "
                            f"{self.config.chunk_tokens}, got {tuple(payload.shape)} {payload.dtype}")
        parts, offset = [], 0
        with self._on_device(device):
            for shape, nbytes in zip(shapes, sizes, strict=True):
                out = torch.empty(shape, dtype=dtype, device=device)
                deserializer.deserialize(_Obj(payload[offset:offset + nbytes].to(device)), _Obj(out), None)
                parts.append(out.cpu())
                offset += nbytes
        kv = torch.cat(parts, dim=2).view(2, layers, n, heads, d).permute(0, 1, 3, 2, 4)
        target = model.device
        dense = DenseKV([DenseLayer(kv[0, i][None].contiguous().to(target), kv[1, i][None].contiguous().to(target))
                         for i in range(layers)])
        return dense, ids.tolist()

    # -- continue from a blob -----------------------------------------------------------------

    def resume(self, model, tokenizer, blob, new_token_ids, max_new_tokens, min_new_tokens=0, prefix_tokens=None):
        """Greedy generation after the decoded cache (its first ``prefix_tokens`` tokens) plus ``new_token_ids``;
        ``prefill_s`` counts the decoding."""
        if not new_token_ids:
            raise ValueError("empty prompt: continuing from a stored cache needs at least one new token")
        streamer = ProgressStreamer(len(new_token_ids), max_new_tokens, enabled=False)
        start = streamer.start
        restored, prefix = self.decompress(model, blob)
        if prefix_tokens is not None and prefix_tokens != len(prefix):
            restored, prefix = restored.leading(prefix_tokens), prefix[:prefix_tokens]
        check_context(model, len(prefix) + len(new_token_ids), max_new_tokens)
        cache = to_dynamic_cache(model, restored, len(prefix))
        restore_s = time.perf_counter() - start
        new = greedy_generate(model, tokenizer, cache, prefix + list(new_token_ids), max_new_tokens, min_new_tokens,
                              streamer)
        end = time.perf_counter() - start
        return GenerationResult(text=tokenizer.decode(new, skip_special_tokens=True), method=self.name,
                                config=self.describe(), prompt_tokens=len(prefix) + len(new_token_ids),
                                new_tokens=len(new), kv_bytes=len(blob), dense_kv_bytes=self.dense_bytes(blob),
                                prefill_s=streamer.prefill_s if streamer.prefill_s is not None else end,
                                total_s=end, token_ids=new, restored_tokens=len(prefix), restore_s=restore_s)
