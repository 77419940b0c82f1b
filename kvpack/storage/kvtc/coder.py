"""kvtc compression and decompression of one sequence's transformers cache.

Compression (after prefill, or after a turn): the first ``sinks`` and the last ``window`` tokens of
every layer are kept lossless (in the cache's dtype); every token in between becomes a key and a
value feature vector over all full-attention layers (keys pre-RoPE, ``features.py``), projected on
the calibration's PCA basis, ``D = (X - μ) V``; each coded group of coefficients is quantized at its
allocated width with an fp16 shift and scale per token (``ops/group_quant.py``), bit-packed, and
every section is entropy-coded (DEFLATE by default) into one self-describing blob
(``store/format.py``). Layers the PCA does not cover (sliding-window layers) are stored lossless.

Decompression inverts each step. The inverse projection ``X_l = D V_lᵀ + μ_l`` is done per layer
with the rows of ``V`` that belong to layer ``l``, so :func:`iter_decompressed_layers` hands out
layer 0 before layer 1 is reconstructed (streaming); :func:`decompress_cache` collects every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ...hf.fingerprint import cache_layer_count, model_fingerprint
from ...hf.generation import context_limit
from ...ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ...ops.bitalloc import Allocation
from ...ops.bitpack import pack_bitstream, unpack_bitstream
from ...ops.cpu_features import has_bf16_gemm
from ...ops.finite import all_finite
from ...ops.group_quant import FP16_MAX, dequantize_groups, quantize_groups
from ...ops.rope import apply_rope
from ...store.format import Blob, BlobError, pack_blob, tokens_digest
from ...store.schema import ForeignBlobError
from ..base import DenseKV, DenseLayer
from .calibration import Calibration, ratio_key
from .features import to_features
from .header import CACHE_DTYPES, CODEC, KvtcHeader, check_header, read_header
from .native import native
from .stages import NO_TIMES, StageTimes


def _check_cache(cache, calibration: Calibration, n_tokens: int) -> None:
    layers = cache.layers
    for i in calibration.layers:
        if i >= len(layers) or getattr(layers[i], "keys", None) is None:
            raise ValueError(f"cache layer {i} is missing or empty; kvtc compresses a filled cache")
        k, v = layers[i].keys, layers[i].values
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"kvtc compresses one sequence: cache layer {i} has keys of shape {list(k.shape)}")
        if k.shape[1] != calibration.kv_heads or k.shape[3] != calibration.head_dim:
            raise ValueError(f"cache layer {i} has {k.shape[1]} heads of {k.shape[3]}, the calibration expects "
                             f"{calibration.kv_heads} of {calibration.head_dim}")
        if k.shape[2] != n_tokens or v.shape != k.shape:
            raise ValueError(f"cache layer {i} holds {k.shape[2]} tokens, the token ids give {n_tokens}")
        if not (all_finite(k) and all_finite(v)):
            raise ValueError(f"cache layer {i} contains NaN or Inf")


def encode_coefficients(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, alloc: Allocation,
                        prefix: str, backend: str = "auto") -> dict[str, torch.Tensor]:
    """Sections for one kind: the bit streams of every coded group, the shifts and the scales.

    The projection ``(x - mean) @ basis`` multiplies in ``basis``' dtype: fp32 (kvtc's codec, the reference)
    or bf16 (the centred features and the basis rounded to bf16, products accumulated in fp32, the
    coefficients rounded to bf16 — relative errors of about 2⁻⁹, far below any coded group's quantization
    step; ``kvtc_resident``'s ``encode_precision``).

    ``backend``: ``auto`` quantizes and packs each group in one native pass where kvpack's CPU
    kernels are built (``kvtc_quantize``: the same bytes), ``torch`` takes the PyTorch path.

    Raises:
        ValueError: a coefficient is NaN/Inf or beyond the fp16 range of the shifts and scales.
    """
    coded = alloc.coded_groups()
    n = x.shape[0]
    coeffs = ((x - mean).to(basis.dtype) @ basis[:, :alloc.coded_extent]).float()
    lib = native() if backend == "auto" and coeffs.device.type == "cpu" else None
    if lib is not None and coded:  # quantize_groups' checks, once for the whole matrix
        if not all_finite(coeffs):
            raise ValueError("cannot quantize NaN or Inf coefficients")
        if float(coeffs.abs().max()) > FP16_MAX / 2:
            raise ValueError(f"coefficient magnitude {float(coeffs.abs().max()):.3g} exceeds the fp16 shift/scale "
                             "range")
    streams, shifts, scales = [], [], []
    for start, size, width in coded:
        if lib is not None:
            stream, shift, scale = lib.kvtc_quantize(coeffs, start, size, width)
        else:
            codes, shift, scale = quantize_groups(coeffs[:, start:start + size], width)
            stream = pack_bitstream(codes, width)
        streams.append(stream)
        shifts.append(shift)
        scales.append(scale)
    empty16 = torch.empty(n, 0, dtype=torch.float16)
    return {
        f"{prefix}_codes": torch.cat(streams) if streams else torch.empty(0, dtype=torch.uint8),
        f"{prefix}_shift": torch.stack(shifts, dim=1) if shifts else empty16,
        f"{prefix}_scale": torch.stack(scales, dim=1) if scales else empty16,
    }


DECODE_PRECISIONS = ("auto", "float32", "bfloat16")


def inverse_dtype(precision: str) -> torch.dtype:
    """The dtype the inverse PCA multiplies in (on the CPU, where decoding runs) for ``precision``
    (one of :data:`DECODE_PRECISIONS`).

    ``float32`` is the reference. ``bfloat16`` rounds the coefficients and the basis to bf16,
    accumulates in fp32 and rounds the product to bf16 (oneDNN's bf16 GEMM): a relative squared error
    of 5e-6 (keys) and 1.3e-5 (values) in SmolLM2's reconstructed cache at 16x, measured, against
    the coding's own 1.1e-2 and 8.4e-2 at that ratio. ``auto``: bf16 where the CPU multiplies bf16
    natively (:func:`has_bf16_gemm`; measured: 3-8x fp32's throughput with AMX, 2.5x with AVX-512 BF16
    on an AMD EPYC of Zen 4 class, ``[256, 1792] @ [1792, 5760]`` 14 vs 35 ms), fp32 elsewhere.
    """
    if precision not in DECODE_PRECISIONS:
        raise ValueError(f"decode precision must be one of {DECODE_PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if has_bf16_gemm() else torch.float32
    return getattr(torch, precision)


def decode_coefficients(section: Callable[[str], torch.Tensor], alloc: Allocation, prefix: str,
                        n: int, dtype: torch.dtype = torch.float32, backend: str = "auto",
                        columns: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, r]`` dequantized coefficients in ``dtype`` (fp32 or bf16), ``r`` = the allocation's coded
    extent (zeros for dropped groups), from the sections :func:`encode_coefficients` wrote
    (``section(name)`` returns one). ``columns`` (int64 ``[r]``, a permutation): component ``c`` is written to
    column ``columns[c]`` (the same values as ``out[:, columns] = coefficients``, with no gather pass).
    ``out``: a zero-filled ``[n, r]`` matrix (or row range of one) in ``dtype`` to write into and return.

    ``backend``: ``auto`` unpacks and dequantizes each group in one native pass where kvpack's CPU
    kernels are built (``kvtc_dequantize``, equal to the PyTorch path bit for bit), ``torch`` always
    takes the PyTorch path (the reference).

    Raises:
        BlobError: sections whose sizes or dtypes do not match the allocation and ``n``.
    """
    coded = alloc.coded_groups()
    stream = section(f"{prefix}_codes")
    shift = section(f"{prefix}_shift")
    scale = section(f"{prefix}_scale")
    if shift.shape != (n, len(coded)) or scale.shape != shift.shape:
        raise BlobError(f"blob {prefix} shift/scale shapes {list(shift.shape)}/{list(scale.shape)} do not match "
                        f"{n} tokens x {len(coded)} groups")
    if shift.dtype != torch.float16 or scale.dtype != torch.float16 or stream.dtype != torch.uint8:
        raise BlobError(f"blob {prefix} sections are {stream.dtype}/{shift.dtype}/{scale.dtype}, not uint8 codes "
                        "and fp16 shifts and scales")
    lib = native() if backend == "auto" and stream.device.type == "cpu" else None
    if out is not None and (tuple(out.shape) != (n, alloc.coded_extent) or out.dtype != dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{n}, {alloc.coded_extent}] {dtype} with unit column stride, got "
                         f"{list(out.shape)} {out.dtype}")
    coeffs = torch.zeros(n, alloc.coded_extent, dtype=dtype) if out is None else out
    if lib is not None:
        shift, scale = shift.T.contiguous(), scale.T.contiguous()  # [groups, n]: one row per group
    if columns is not None and not torch.equal(torch.sort(columns).values, torch.arange(alloc.coded_extent)):
        raise ValueError(f"columns must be a permutation of the {alloc.coded_extent} coded components")
    offset = 0
    for j, (start, size, width) in enumerate(coded):
        nbytes = (n * size * width + 7) // 8
        if offset + nbytes > stream.numel():
            raise BlobError(f"blob {prefix} code stream is {stream.numel()} bytes, shorter than its groups need")
        part = stream[offset:offset + nbytes]
        if lib is not None and columns is not None:
            lib.kvtc_dequantize_columns(part, width, shift[j], scale[j], coeffs, columns[start:start + size])
        elif lib is not None:
            lib.kvtc_dequantize(part, width, shift[j], scale[j], coeffs[:, start:start + size])
        else:
            codes = unpack_bitstream(part, width, n * size).reshape(n, size)
            values = dequantize_groups(codes, shift[:, j], scale[:, j])
            target = slice(start, start + size) if columns is None else columns[start:start + size]
            coeffs[:, target] = values
        offset += nbytes
    if offset != stream.numel():
        raise BlobError(f"blob {prefix} code stream has {stream.numel() - offset} unexplained bytes")
    return coeffs


def compress_cache(cache, calibration: Calibration, ratio: float, token_ids: list[int], model=None,
                   backend: str = "zlib", level: int = 6, sinks: int | None = None,
                   window: int | None = None) -> bytes:
    """Compress a filled one-sequence transformers cache into a kvtc blob.

    Args:
        cache: the cache after prefilling ``token_ids`` (``cache.layers[i].keys [1, kv_heads, T, d]``).
        calibration: the model's calibration; ``ratio`` must be one of its calibrated ratios.
        token_ids: the ``T`` token ids the cache holds (stored, to continue from and to key a store).
        model: the model (for its RoPE; checked against the calibration's fingerprint).
        backend, level: entropy coder (``zlib`` = DEFLATE, ``zstd``, ``none``) and its level.
        sinks, window: tokens kept lossless at the start and the end (default: the calibration's,
            which are the paper's s = 4 and w = 128).

    Returns:
        The blob's bytes.
    """
    if model is None:
        raise ValueError("compress_cache needs the model (its rotary embedding undoes RoPE on keys)")
    calibration.check_model(model)
    alloc = calibration.allocation(ratio)
    n_tokens = len(token_ids)
    if n_tokens == 0:
        raise ValueError("cannot compress an empty cache (no tokens)")
    _check_cache(cache, calibration, n_tokens)
    sinks = calibration.sinks if sinks is None else sinks
    window = calibration.window if window is None else window
    for name, value in (("sinks", sinks), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    s = min(sinks, n_tokens)
    n_mid = max(0, n_tokens - sinks - window)
    w_start = s + n_mid
    layers = cache.layers
    ks = [layers[i].keys[0] for i in calibration.layers]
    vs = [layers[i].values[0] for i in calibration.layers]
    cache_dtype = ks[0].dtype
    if cache_dtype not in CACHE_DTYPES.values():
        raise ValueError(f"kvtc stores caches of {', '.join(CACHE_DTYPES)}, not {cache_dtype}")
    sections: dict[str, torch.Tensor] = {
        "token_ids": torch.tensor(token_ids, dtype=torch.int32),
        "sink_keys": torch.stack([k[:, :s] for k in ks]), "sink_values": torch.stack([v[:, :s] for v in vs]),
        "window_keys": torch.stack([k[:, w_start:] for k in ks]),
        "window_values": torch.stack([v[:, w_start:] for v in vs]),
    }
    if n_mid:
        positions = torch.arange(s, w_start)
        rot = calibration.key_rotaries(model)
        xk = to_features([k[:, s:w_start] for k in ks], [rot[i] for i in calibration.layers], positions)
        xv = to_features([v[:, s:w_start] for v in vs], None, positions)
        sections.update(encode_coefficients(xk, calibration.key_mean, calibration.key_basis, alloc["keys"], "keys"))
        sections.update(encode_coefficients(xv, calibration.value_mean, calibration.value_basis, alloc["values"],
                                             "values"))
    other = [i for i, layer in enumerate(layers) if i not in calibration.layers]
    for i in other:  # sliding-window (and other non-full) layers: lossless, as the model holds them
        if getattr(layers[i], "keys", None) is None:
            raise ValueError(f"cache layer {i} is empty")
        sections[f"layer{i}_keys"] = layers[i].keys[0]
        sections[f"layer{i}_values"] = layers[i].values[0]
    dense = sum(int(layers[i].keys[0].numel()) * 2 for i in range(len(layers))) * DENSE_REFERENCE_BYTES_PER_ELEMENT
    meta = {
        "codec": CODEC, "model": calibration.fingerprint, "calibration_id": calibration.calibration_id,
        "ratio": ratio_key(ratio), "allocation": {k: a.to_dict() for k, a in alloc.items()},
        "tokens": n_tokens, "tokens_sha256": tokens_digest(token_ids), "sinks": s, "coded_tokens": n_mid,
        "window": n_tokens - w_start, "layers": calibration.layers, "other_layers": other,
        "num_layers": len(layers), "kv_heads": calibration.kv_heads, "head_dim": calibration.head_dim,
        "cache_dtype": str(cache_dtype).removeprefix("torch."), "dense_bf16_bytes": dense,
    }
    return pack_blob(meta, sections, backend=backend, level=level)


def read_blob(data: bytes, calibration: Calibration | None = None, model=None,
              times: StageTimes = NO_TIMES) -> tuple[Blob, KvtcHeader]:
    """Parse and verify a kvtc blob and its header, and check that it belongs to ``calibration`` and
    ``model`` (each when given); the checksum and header parse are timed as ``times``' ``verify``.

    Raises:
        BlobError: unreadable or malformed blob; ForeignBlobError (one) for a blob of another model or
            calibration.
    """
    with times("verify"):
        blob = Blob(data)
    header = read_header(blob)
    if model is not None:
        fp = model_fingerprint(model)
        if (header.model_hash, header.model_architecture) != (fp["hash"], fp["architecture"]):
            raise ForeignBlobError(f"blob was made with another model ({header.model_architecture}, fingerprint "
                             f"{header.model_hash[:12]}) than the one given (fingerprint {fp['hash'][:12]})")
    if calibration is not None:
        check_header(blob, header, calibration)
    return blob, header


def blob_token_ids(blob: Blob, header: KvtcHeader) -> list[int]:
    ids = blob.section("token_ids").tolist()
    if len(ids) != header.tokens or tokens_digest(ids) != header.tokens_sha256:
        raise BlobError("blob token ids do not match its header")
    return ids


def iter_decompressed_layers(data: bytes | tuple[Blob, KvtcHeader], calibration: Calibration, model,
                             device: torch.device | str | None = None, times: StageTimes = NO_TIMES,
                             precision: str = "auto") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(layer_idx, keys [1, kv_heads, T, d], values)`` for every cache layer, in order,
    each reconstructed only when asked for (streaming decompression).

    Keys and values come back in the cache dtype recorded in the blob, keys post-RoPE. ``data`` is
    the blob's bytes or what :func:`read_blob` returned for them. ``times`` gets the seconds of each
    stage (verify, inflate, dequantize, inverse_pca, rope, assemble); ``precision``: the inverse PCA's
    (:func:`inverse_dtype`).
    """
    yield from _decoded_layers(*_checked(data, calibration, model, times), calibration, model, device, times,
                               precision)


def _checked(data: bytes | tuple[Blob, KvtcHeader], calibration: Calibration, model,
             times: StageTimes = NO_TIMES) -> tuple[Blob, KvtcHeader]:
    """``data`` parsed and checked against ``calibration``, once: bytes through :func:`read_blob`, a
    pair :func:`read_blob` returned (perhaps without a calibration) through :func:`check_header`."""
    if isinstance(data, bytes | bytearray | memoryview):
        return read_blob(data, calibration, model, times)
    blob, header = data
    check_header(blob, header, calibration)
    return blob, header


def layer_out(lib, x: torch.Tensor, mean: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
               out: torch.Tensor) -> None:
    """``out [H, n, d]`` (a layer cache tensor's coded rows) ``= x [n, H·d] + mean``, RoPE'd with
    ``cos_sin`` (``[n, d]`` each) when given, in ``out``'s dtype: natively in one pass where ``lib`` (the
    CPU kernels) is given, else the PyTorch path (the same products and sums: the same bits)."""
    if lib is not None:
        none = torch.empty(0)
        lib.kvtc_layer_out(x.contiguous(), mean, *(cos_sin if cos_sin is not None else (none, none)), out)
        return
    heads, n, d = out.shape
    y = (x.float() + mean).reshape(n, heads, d).permute(1, 0, 2)
    out.copy_(apply_rope(y, *cos_sin) if cos_sin is not None else y)


def rope_logits(lib, x: torch.Tensor, mean: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                q: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[H, M, n]`` scaled logits of grouped queries ``q [H, M, d]`` against the keys :func:`layer_out` makes
    of ``x [n, H·d]`` (+ ``mean``, RoPE'd with ``cos_sin``), without writing the keys: natively in one pass where
    ``lib`` is given and ``q`` is fp32 (the same keys; the head dim summed in 16 partial sums: within fp32
    rounding of the PyTorch path's matmul); else the keys are made in fp32 and multiplied in ``q``'s dtype."""
    if lib is not None and q.dtype == torch.float32:
        none = torch.empty(0)
        return lib.kvtc_rope_logits(x.contiguous(), mean, *(cos_sin if cos_sin is not None else (none, none)),
                                    q.contiguous(), float(scaling))
    heads, _, d = q.shape
    keys = torch.empty(heads, x.shape[0], d, dtype=torch.float32)
    layer_out(lib, x, mean, cos_sin, keys)
    return torch.matmul(q, keys.to(q.dtype).transpose(1, 2)) * scaling


def _decoded_layers(blob: Blob, header: KvtcHeader, calibration: Calibration, model,
                    device: torch.device | str | None, times: StageTimes = NO_TIMES, precision: str = "auto",
                    kernels: str = "auto") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """:func:`iter_decompressed_layers` for a blob already checked against ``calibration``. The
    lossless sections are in ``header.cache_dtype`` already (:func:`check_header` checks it).

    Decoding runs on the CPU (each layer moves to ``device`` when done). ``kernels``: ``auto`` uses
    kvpack's native CPU kernels for the memory passes (unpack + dequantize, mean + RoPE + transpose +
    cast) where they are built, ``torch`` the PyTorch path (the reference; the same bits)."""
    if kernels not in ("auto", "torch"):
        raise ValueError(f"kernels must be 'auto' or 'torch', got {kernels!r}")
    lib = native() if kernels == "auto" else None
    mm_dtype = inverse_dtype(precision)
    dtype = header.cache_dtype
    s, n_mid, n_tokens = header.sinks, header.coded_tokens, header.tokens
    alloc = calibration.allocations[header.ratio]
    section = times.timed("inflate", blob.section)  # the lossless layers', one by one below
    names = ["sink_keys", "sink_values", "window_keys", "window_values"]
    if n_mid:  # the two code streams first: the largest sections, inflated side by side
        names = ["keys_codes", "values_codes", *names, *(f"{kind}_{part}" for kind in ("keys", "values")
                                                         for part in ("shift", "scale"))]
    with times("inflate"), ThreadPoolExecutor(2) as pool:  # zlib and zstd inflate without the GIL
        inflated = dict(zip(names, pool.map(blob.section, names)))
    sink_k, sink_v = inflated["sink_keys"], inflated["sink_values"]
    win_k, win_v = inflated["window_keys"], inflated["window_values"]
    heads, d = calibration.kv_heads, calibration.head_dim
    coeffs = {}
    for kind in ("keys", "values") if n_mid else ():
        with times("dequantize"):
            coeffs[kind] = decode_coefficients(inflated.__getitem__, alloc[kind], kind, n_mid, mm_dtype,
                                               backend=kernels)
    rot = calibration.key_rotaries(model)
    positions = torch.arange(s, s + n_mid)
    cos_sin: dict = {}  # one (cos, sin) [n_mid, d] per rotary table: layers share their table
    by_layer = {layer: j for j, layer in enumerate(calibration.layers)}
    for i in range(header.num_layers):
        if i not in by_layer:
            k, v = section(f"layer{i}_keys"), section(f"layer{i}_values")
            yield i, k[None].to(device=device), v[None].to(device=device)
            continue
        j = by_layer[i]
        cols = calibration.layer_features(j)
        with times("assemble"):  # the layer's tensors: sinks | coded tokens (below) | window
            k = torch.empty(heads, n_tokens, d, dtype=dtype)
            v = torch.empty(heads, n_tokens, d, dtype=dtype)
            for out, sink, window in ((k, sink_k[j], win_k[j]), (v, sink_v[j], win_v[j])):
                out[:, :s] = sink
                out[:, s + n_mid:] = window
        if n_mid:
            rk, rv = alloc["keys"].coded_extent, alloc["values"].coded_extent
            with times("inverse_pca"):  # only the components that carry bits at this ratio
                xk = coeffs["keys"] @ calibration.inverse_basis("keys", j, rk, mm_dtype)
                xv = coeffs["values"] @ calibration.inverse_basis("values", j, rv, mm_dtype)
            table = rot[i]
            if table is not None and table not in cos_sin:
                cos_sin[table] = table.cos_sin(positions)
            with times("rope"):
                layer_out(lib, xk, calibration.key_mean[cols], cos_sin.get(table), k[:, s:s + n_mid])
            with times("assemble"):
                layer_out(lib, xv, calibration.value_mean[cols], None, v[:, s:s + n_mid])
        yield i, k[None].to(device=device), v[None].to(device=device)


def decompress_cache(data: bytes | tuple[Blob, KvtcHeader], calibration: Calibration, model,
                     times: StageTimes = NO_TIMES, precision: str = "auto") -> tuple[DenseKV, list[int]]:
    """Every layer of a blob's cache, as tensors on the model's device; generation continues from
    ``kvpack.hf.dense.to_dynamic_cache(model, cache, len(token_ids))``.

    Returns:
        ``(cache, token_ids)``: the layers (``cache.layers[i].keys [1, kv_heads, T, d]``) and the token
        ids they hold. ``times`` gets the seconds of each stage (see :mod:`.stages`); ``precision``:
        the inverse PCA's (:func:`inverse_dtype`: ``auto``, ``float32``, ``bfloat16``).

    Raises:
        BlobError: an unreadable or malformed blob. ValueError: a blob of another model or
            calibration, or one holding more tokens than the model's context.
    """
    blob, header = _checked(data, calibration, model, times)
    n_layers = cache_layer_count(model)
    if n_layers != header.num_layers:
        raise ValueError(f"blob holds {header.num_layers} layers, the model's cache has {n_layers}")
    limit = context_limit(model)
    if limit is not None and header.tokens > limit:
        raise ValueError(f"blob holds {header.tokens} tokens, more than the model's context of {limit} tokens")
    ids = blob_token_ids(blob, header)
    parts = _decoded_layers(blob, header, calibration, model, model.device, times, precision)
    return DenseKV([DenseLayer(k, v) for _, k, v in parts]), ids
