"""The schema of a kvtc blob's header, checked before any section is decoded.

:func:`read_header` checks the header alone (types, ranges, token counts that add up, layer lists
that partition the cache); :func:`check_header` checks it against the calibration that will decode
it (the same id, layers, KV heads and head dim, the calibration's own bit allocation at that ratio)
and checks every section's dtype and shape in the table against what that header implies, so a
well-checksummed blob that kvpack did not write ends in :class:`BlobError`, not in a traceback from
deep inside torch or in a cache of garbage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ...ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ...store.format import Blob
from ...store.schema import BlobError, ForeignBlobError, check_fields, get_int, get_int_list, get_object, get_str
from .calibration import Calibration, ratio_key

CODEC = "kvtc"
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HEX64 = r"[0-9a-f]{64}"
HEX_ID = r"[0-9a-f]{8,64}"  # model fingerprints and calibration ids
MAX_LAYERS = 4096
FIELDS = {"codec", "model", "calibration_id", "ratio", "allocation", "tokens", "tokens_sha256", "sinks",
          "coded_tokens", "window", "layers", "other_layers", "num_layers", "kv_heads", "head_dim", "cache_dtype",
          "dense_bf16_bytes", "backend", "sections"}  # the last two are the container's (store/format.py)


def _as_json(value):
    """``value`` as JSON would give it back (tuples become lists), for comparing records."""
    return json.loads(json.dumps(value, sort_keys=True))


@dataclass(frozen=True)
class KvtcHeader:
    """A kvtc blob's header, every field checked (see :func:`read_header`)."""

    model: dict  # the model's fingerprint (kvpack.hf.fingerprint.model_fingerprint)
    model_hash: str
    model_architecture: str
    calibration_id: str
    ratio: str
    tokens: int  # T, the tokens the cache holds
    tokens_sha256: str
    sinks: int  # leading tokens stored lossless
    coded_tokens: int  # tokens coded by PCA + quantization
    window: int  # trailing tokens stored lossless; sinks + coded_tokens + window == tokens
    layers: list[int]  # the calibration's full-attention layers, in its order
    other_layers: list[int]  # layers stored lossless (sliding-window layers)
    num_layers: int
    kv_heads: int
    head_dim: int
    cache_dtype: torch.dtype
    dense_bf16_bytes: int
    allocation: dict


def read_header(blob: Blob) -> KvtcHeader:
    """The checked header of a kvtc blob.

    Raises:
        BlobError: another codec's blob, a missing or mistyped field, a value out of range, counts
            that do not add up.
    """
    meta = blob.meta
    codec = meta.get("codec")
    if codec != CODEC:
        raise BlobError(f"blob was written by codec {codec!r:.40}, not {CODEC!r}")
    check_fields(meta, FIELDS)
    model = get_object(meta, "model")
    num_layers = get_int(meta, "num_layers", minimum=1, maximum=MAX_LAYERS)
    header = KvtcHeader(
        model=model,
        model_hash=get_str(model, "hash", "blob header's model", pattern=HEX_ID),
        model_architecture=get_str(model, "architecture", "blob header's model"),
        calibration_id=get_str(meta, "calibration_id", pattern=HEX_ID),
        ratio=get_str(meta, "ratio", pattern=r"[0-9][0-9.e+]{0,15}"),
        tokens=get_int(meta, "tokens", minimum=1),
        tokens_sha256=get_str(meta, "tokens_sha256", pattern=HEX64),
        sinks=get_int(meta, "sinks"),
        coded_tokens=get_int(meta, "coded_tokens"),
        window=get_int(meta, "window"),
        layers=get_int_list(meta, "layers", maximum=num_layers - 1, max_len=MAX_LAYERS),
        other_layers=get_int_list(meta, "other_layers", maximum=num_layers - 1, max_len=MAX_LAYERS),
        num_layers=num_layers,
        kv_heads=get_int(meta, "kv_heads", minimum=1, maximum=1 << 16),
        head_dim=get_int(meta, "head_dim", minimum=1, maximum=1 << 16),
        cache_dtype=CACHE_DTYPES[get_str(meta, "cache_dtype", choices=tuple(CACHE_DTYPES))],
        dense_bf16_bytes=get_int(meta, "dense_bf16_bytes"),
        allocation=get_object(meta, "allocation"),
    )
    if header.sinks + header.coded_tokens + header.window != header.tokens:
        raise BlobError(f"blob header: sinks {header.sinks} + coded {header.coded_tokens} + window {header.window} "
                        f"!= {header.tokens} tokens")
    if sorted(header.layers + header.other_layers) != list(range(num_layers)):
        raise BlobError(f"blob header: layers {header.layers} and other_layers {header.other_layers} do not "
                        f"partition the cache's {num_layers} layers")
    return header


def _check_section(blob: Blob, name: str, dtype: torch.dtype, shape: list[int | None]) -> list[int]:
    """The table entry of section ``name`` must exist with ``dtype`` and ``shape`` (None: any size
    there); returns its recorded shape."""
    entry = blob.sections.get(name)
    if entry is None:
        raise BlobError(f"blob has no section {name!r}")
    found = str(dtype).removeprefix("torch.")
    recorded = entry["shape"]
    if entry["dtype"] != found or len(recorded) != len(shape) or any(
            want is not None and want != got for want, got in zip(shape, recorded)):
        expected = ["*" if s is None else s for s in shape]
        raise BlobError(f"blob section {name!r} is {entry['dtype']} {recorded}, expected {found} {expected}")
    return recorded


def check_header(blob: Blob, header: KvtcHeader, calibration: Calibration) -> None:
    """Check ``header`` against ``calibration`` and every section's table entry against ``header``.

    Raises:
        ForeignBlobError: the blob names another calibration (a mismatch, not damage). BlobError:
            geometry, allocation, byte count or a section that does not fit.
    """
    if header.calibration_id != calibration.calibration_id:
        raise ForeignBlobError(f"blob was made with calibration {header.calibration_id}, not with the one given "
                         f"({calibration.calibration_id})")
    if _as_json(header.model) != _as_json(calibration.fingerprint):
        raise BlobError("blob header's model fingerprint differs from its calibration's")
    geometry = (header.layers, header.kv_heads, header.head_dim)
    if geometry != (calibration.layers, calibration.kv_heads, calibration.head_dim):
        raise BlobError(f"blob header's layers/kv_heads/head_dim {geometry} differ from its calibration's "
                        f"{(calibration.layers, calibration.kv_heads, calibration.head_dim)}")
    if header.ratio not in calibration.allocations:
        raise BlobError(f"blob header's ratio {header.ratio} is not one of its calibration's "
                        f"({', '.join(ratio_key(r) for r in calibration.ratios())})")
    alloc = calibration.allocations[header.ratio]
    if header.allocation != {kind: a.to_dict() for kind, a in alloc.items()}:
        raise BlobError(f"blob header's bit allocation differs from its calibration's at ratio {header.ratio}")
    n_layers, heads, d, dtype = len(header.layers), header.kv_heads, header.head_dim, header.cache_dtype
    _check_section(blob, "token_ids", torch.int32, [header.tokens])
    for side in ("keys", "values"):
        _check_section(blob, f"sink_{side}", dtype, [n_layers, heads, header.sinks, d])
        _check_section(blob, f"window_{side}", dtype, [n_layers, heads, header.window, d])
        if header.coded_tokens:
            coded = alloc[side].coded_groups()
            stream = sum((header.coded_tokens * size * width + 7) // 8 for _, size, width in coded)
            _check_section(blob, f"{side}_codes", torch.uint8, [stream])
            for part in ("shift", "scale"):
                _check_section(blob, f"{side}_{part}", torch.float16, [header.coded_tokens, len(coded)])
    elements = n_layers * heads * header.tokens * d  # keys of the full-attention layers
    for i in header.other_layers:
        keys = _check_section(blob, f"layer{i}_keys", dtype, [None, None, None])
        _check_section(blob, f"layer{i}_values", dtype, keys)
        if keys[1] > header.tokens:
            raise BlobError(f"blob section 'layer{i}_keys' holds {keys[1]} tokens, more than the blob's "
                            f"{header.tokens}")
        elements += keys[0] * keys[1] * keys[2]
    dense = elements * 2 * DENSE_REFERENCE_BYTES_PER_ELEMENT  # keys and values
    if header.dense_bf16_bytes != dense:
        raise BlobError(f"blob header's dense_bf16_bytes {header.dense_bf16_bytes} is not the {dense} its tensors "
                        "describe")
