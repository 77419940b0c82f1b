"""kvtc calibration, once per model: cross-layer PCA of keys and values plus DP bit allocations.

Steps (kvtc paper §3; docs/methods/kvtc.md):

1. Run the model over the calibration corpus (``kvpack.storage.kvtc.corpus``) in chunks of
   ``chunk_tokens`` with exact attention and collect each chunk's cache.
2. Per chunk, drop the first ``sinks`` tokens (attention sinks) and the last ``window`` tokens
   (kvtc never codes either), undo RoPE on keys, and turn each remaining position into one key
   vector and one value vector over all full-attention layers and KV heads (``features.py``).
3. Sample ``samples`` positions from the pool (seeded), subtract the mean, and compute the
   leading ``pca_dim`` principal directions with a randomized SVD (``ops.lowrank.randomized_svd``,
   its own seeded generator).
4. Measure the error of coding every aligned group of coefficients at every width on
   ``dp_samples`` positions and solve the DP allocation for each target ratio: the per-token
   budget is ``16 · p / ratio`` bits (bf16 is 16 bits per feature).
5. Keep only the leading components that some ratio codes (the zero-bit tail is dropped).

The artifact is a directory: ``kvtc_calibration.safetensors`` (means and bases) and
``kvtc_calibration.json`` (settings, model fingerprint, allocations, timings, statistics).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ...config import choice, integer, option, validate_fields
from ...hf.dense import prefill
from ...hf.fingerprint import attention_shape, full_attention_layers, model_fingerprint
from ...ops.bitalloc import Allocation, aligned_group_errors, allocate_bits
from ...ops.lowrank import randomized_svd
from ...ops.rope import RotaryTable
from ...progress import status
from ...store.atomic import atomic_write
from .corpus import corpus_token_ids
from .features import layer_rotaries, to_features

FORMAT = "kvpack-kvtc-calibration"
# 2: the calibration id covers the geometry (layers, KV heads, head dim) and the settings, not only
# the tensors and allocations (version 1 ids did not: a reordered `layers` list loaded unnoticed).
FORMAT_VERSION = 2
TENSORS_FILE = "kvtc_calibration.safetensors"
META_FILE = "kvtc_calibration.json"
BF16_BITS = 16
DEFAULT_RATIOS = (8.0, 16.0, 32.0, 64.0)


def ratio_key(ratio: float) -> str:
    """The key a ratio's allocation is stored under (``16.0`` -> ``"16"``)."""
    return f"{float(ratio):g}"


@dataclass
class CalibrationSettings:
    """How a calibration was (or is to be) made.

    Attributes:
        tokens: calibration tokens run through the model (default 65,536).
        chunk_tokens: tokens per forward pass (documents of this length).
        sinks: leading tokens per sequence kvtc keeps lossless (paper: s = 4).
        window: most recent tokens kvtc keeps lossless (paper: w = 128).
        samples: positions sampled for the PCA (None = every eligible position).
        pca_dim: principal components computed (the paper cuts at 10K of p = 32K for 8B models).
        dp_samples: positions whose coefficients measure the group errors for the DP.
        ratios: target ratios to allocate bits for.
        seed: sampling and randomized-SVD seed.
        svd_iters: power iterations of the randomized SVD.
        key_rope: keys in the PCA before RoPE (the paper) or as cached.
        layer_group: None (the paper): one basis over every layer's features. ``g``: one basis per ``g``
            consecutive layers (exact eigendecompositions; the basis is block-diagonal, its components of all
            blocks ordered by variance), so a layer is rebuilt from its block's components alone — what
            ``kvtc_resident`` decodes per layer at every step (cheaper by about the number of blocks), at a
            cost in error (SmolLM2 at 16x: 2.7–2.9x the KL with blocks of 5 layers).
        key_layer_group: the keys' own ``layer_group`` (None: as ``layer_group``). The cross-layer gain is the
            values': on SmolLM2 at 16x, keys with a basis per layer and values with kvtc's cross-layer basis
            have 1.8x the cross-layer KL (Qwen2.5-0.5B: 1.8x too), values per layer 41x
            (``benchmarks/results/kvtc-layer-groups.jsonl``).
    """

    tokens: int = option(32768, integer(minimum=1), "calibration tokens")
    chunk_tokens: int = option(2048, integer(minimum=1), "tokens per calibration sequence")
    sinks: int = option(4, integer(minimum=0), "leading tokens kept lossless")
    window: int = option(128, integer(minimum=0), "most recent tokens kept lossless")
    samples: int | None = option(None, integer(minimum=2, optional=True), "positions sampled for the PCA (none: all)")
    pca_dim: int = option(3072, integer(minimum=1), "principal components computed")
    dp_samples: int = option(4096, integer(minimum=1), "positions whose coefficients measure the DP's group errors")
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    seed: int = option(0, integer(minimum=0), "sampling and randomized-SVD seed")
    svd_iters: int = option(3, integer(minimum=0), "power iterations of the randomized SVD")
    key_rope: str = option("pre", choice("pre", "post"),
                           "keys in the PCA: before RoPE (the paper) or after it (when positions are unknown)")
    layer_group: int | None = option(None, integer(minimum=1, optional=True),
                                     "layers per PCA basis (none: one basis over every layer, the paper's)")
    key_layer_group: int | None = option(None, integer(minimum=1, optional=True),
                                         "layers per PCA basis of the keys (none: as layer_group)")

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.chunk_tokens <= self.sinks + self.window:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must exceed sinks + window "
                             f"({self.sinks} + {self.window}) or no position is eligible")
        self.ratios = tuple(float(r) for r in self.ratios)
        if not self.ratios:
            raise ValueError("give at least one target ratio")
        for r in self.ratios:
            if not (math.isfinite(r) and r > 1.0):
                raise ValueError(f"target ratios must be > 1 (x smaller than bf16), got {r}")

    def to_dict(self) -> dict:
        # the layer groups are left out when unset, so the settings (and ids) of cross-layer calibrations are
        # those written before they existed
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()
                if not (k in LAYER_GROUP_SETTINGS and v is None)}

    def layer_group_of(self, kind: str) -> int | None:
        """Layers per basis block of ``kind`` (None: one cross-layer basis)."""
        return layer_group_of(vars(self), kind)


LAYER_GROUP_SETTINGS = ("layer_group", "key_layer_group")


def layer_group_of(settings: dict, kind: str) -> int | None:
    """Layers per basis block of ``kind`` (``"keys"`` / ``"values"``) under calibration ``settings`` (None: one
    cross-layer basis)."""
    group = settings.get("key_layer_group") if kind == "keys" else None
    if group is None:
        group = settings.get("layer_group")
    return None if group is None else int(group)


@dataclass
class Calibration:
    """A model's kvtc calibration: PCA bases, means and bit allocations per target ratio.

    Attributes:
        fingerprint: :func:`kvpack.hf.fingerprint.model_fingerprint` of the calibrated model.
        layers: full-attention layer indices the feature vectors concatenate.
        kv_heads, head_dim: attention shape.
        key_mean, value_mean: ``[p]`` fp32.
        key_basis, value_basis: ``[p, r]`` fp32 orthonormal columns (leading components only).
        allocations: ``{ratio_key: {"keys": Allocation, "values": Allocation}}``.
        settings: the :class:`CalibrationSettings` used, as a dict.
        stats: timings and spectra summaries.
        calibration_id: hash of everything that decides how a blob decodes: the model's fingerprint,
            layers, KV heads, head dim, settings, tensors and allocations (blobs record it; loading
            recomputes and compares it).
    """

    fingerprint: dict
    layers: list[int]
    kv_heads: int
    head_dim: int
    key_mean: torch.Tensor
    key_basis: torch.Tensor
    value_mean: torch.Tensor
    value_basis: torch.Tensor
    allocations: dict[str, dict[str, Allocation]]
    settings: dict
    stats: dict = field(default_factory=dict)
    calibration_id: str = ""
    # inverse_basis's and projection's copies, made on first use: ``{(kind, layer, dtype): [r, width]}``,
    # ``{(kind, extent, dtype): [p, extent]}``
    _inverse_bases: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _projections: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.calibration_id:
            self.calibration_id = self._compute_id()

    @property
    def features(self) -> int:
        return len(self.layers) * self.kv_heads * self.head_dim

    @property
    def sinks(self) -> int:
        return int(self.settings["sinks"])

    @property
    def window(self) -> int:
        return int(self.settings["window"])

    def layer_group(self, kind: str) -> int | None:
        """Layers per basis block of ``kind`` (None: one cross-layer basis, the paper's)."""
        return layer_group_of(self.settings, kind)

    def component_blocks(self, kind: str, extent: int) -> torch.Tensor:
        """``[extent]`` int64: the layer block (``layer_group(kind)`` consecutive covered layers) each of the
        first ``extent`` components of ``kind`` lives in (its basis column is zero outside that block's
        features); all zeros for a cross-layer basis (one block)."""
        group = self.layer_group(kind)
        if group is None:
            return torch.zeros(extent, dtype=torch.int64)
        basis = (self.key_basis if kind == "keys" else self.value_basis)[:, :extent]
        rows = group * self.kv_heads * self.head_dim
        energy = torch.stack([basis[first:first + rows].pow(2).sum(0) for first in range(0, basis.shape[0], rows)])
        return energy.argmax(0)

    @property
    def key_rope(self) -> str:
        """``"pre"``: the key features are pre-RoPE (the paper; coding needs token positions);
        ``"post"``: keys as cached, after RoPE (no positions needed)."""
        return str(self.settings.get("key_rope", "pre"))

    def key_rotaries(self, model: torch.nn.Module) -> dict[int, RotaryTable | None]:
        """The RoPE tables the key features undo, per layer (all None for a post-RoPE calibration)."""
        if self.key_rope == "post":
            return dict.fromkeys(self.layers)
        return layer_rotaries(model, self.layers, self.head_dim)

    def layer_features(self, layer: int) -> slice:
        """The ``kv_heads·head_dim`` features of the ``layer``-th covered layer (a position in :attr:`layers`) in
        a feature vector ``[p]``."""
        width = self.kv_heads * self.head_dim
        return slice(layer * width, (layer + 1) * width)

    def inverse_basis(self, kind: str, layer: int | None, extent: int, dtype: torch.dtype) -> torch.Tensor:
        """``[extent, width]`` contiguous in ``dtype``: the first ``extent`` basis vectors restricted to
        the features of the ``layer``-th covered layer (``width = kv_heads·head_dim``; ``layer=None``:
        every feature, ``width = p``), transposed — what the inverse projection ``X = D B + μ``
        multiplies coefficients ``D [T, extent]`` by. The transposed copy of all ``r`` components is
        made once per (kind, layer, dtype) and kept (every layer's, in bf16: 35 MB per kind on
        SmolLM2); a smaller extent is its leading rows (contiguous).

        Args:
            kind: ``"keys"`` or ``"values"``; layer: position in :attr:`layers` (not the model's index).
        """
        key = (kind, layer, dtype)
        if key not in self._inverse_bases:
            basis = self.key_basis if kind == "keys" else self.value_basis
            if layer is not None:
                basis = basis[self.layer_features(layer)]
            self._inverse_bases[key] = basis.T.to(dtype).contiguous()
        return self._inverse_bases[key][:extent]

    def projection(self, kind: str, extent: int, dtype: torch.dtype) -> torch.Tensor:
        """``[p, extent]`` contiguous in ``dtype``: the first ``extent`` basis vectors, what coding projects
        the centred features ``[T, p]`` on; made once per (kind, extent, dtype) and kept."""
        key = (kind, extent, dtype)
        if key not in self._projections:
            basis = self.key_basis if kind == "keys" else self.value_basis
            self._projections[key] = basis[:, :extent].to(dtype).contiguous()
        return self._projections[key]

    def ratios(self) -> list[float]:
        return sorted(float(k) for k in self.allocations)

    def allocation(self, ratio: float) -> dict[str, Allocation]:
        """The key and value allocations for ``ratio``.

        Raises:
            ValueError: no allocation was calibrated for this ratio (the message lists those that were).
        """
        key = ratio_key(ratio)
        if key not in self.allocations:
            have = ", ".join(ratio_key(r) for r in self.ratios())
            raise ValueError(f"this calibration has no bit allocation for ratio {key}; calibrated ratios: {have} "
                             "(run `kvpack calibrate --ratios ...` to add one)")
        return self.allocations[key]

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` unless ``model`` is the model this calibration was made for."""
        self.check_fingerprint(model_fingerprint(model))

    def check_fingerprint(self, fp: dict) -> None:
        """Raise ``ValueError`` unless ``fp`` (:func:`~kvpack.hf.fingerprint.model_fingerprint`) is the
        calibrated model's."""
        if fp["hash"] != self.fingerprint["hash"]:
            raise ValueError(
                f"calibration was made for another model ({self.fingerprint['architecture']}, "
                f"{self.fingerprint['layers']} layers, fingerprint {self.fingerprint['hash'][:12]}) than the one "
                f"given ({fp['architecture']}, {fp['layers']} layers, fingerprint {fp['hash'][:12]})"
            )

    def _compute_id(self) -> str:
        h = hashlib.sha256()
        geometry = {"fingerprint": self.fingerprint["hash"], "layers": [int(i) for i in self.layers],
                    "kv_heads": int(self.kv_heads), "head_dim": int(self.head_dim), "settings": self.settings}
        h.update(json.dumps(geometry, sort_keys=True).encode())
        for t in (self.key_mean, self.key_basis, self.value_mean, self.value_basis):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().float().numpy().tobytes())
        alloc = {k: {kind: a.to_dict() for kind, a in v.items()} for k, v in sorted(self.allocations.items())}
        h.update(json.dumps(alloc, sort_keys=True).encode())
        return h.hexdigest()[:24]

    # -- files --------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the artifact into ``directory`` (created; each file replaced atomically)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"key_mean": self.key_mean, "key_basis": self.key_basis,
                   "value_mean": self.value_mean, "value_basis": self.value_basis}
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "calibration_id": self.calibration_id,
            "fingerprint": self.fingerprint, "layers": self.layers, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "settings": self.settings, "stats": self.stats,
            "allocations": {k: {kind: a.to_dict() for kind, a in v.items()} for k, v in self.allocations.items()},
        }
        atomic_write(directory / TENSORS_FILE, lambda p: save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(p), metadata={"calibration_id": self.calibration_id}))
        atomic_write(directory / META_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=1)))
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Calibration:
        """Read an artifact written by :meth:`save`, checking that its files belong together.

        Raises:
            FileNotFoundError: a file is missing. ValueError: wrong format/version, mismatched or
                corrupted files.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        meta_path, tensors_path = directory / META_FILE, directory / TENSORS_FILE
        for path in (meta_path, tensors_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: not a kvtc calibration directory "
                                        "(make one with `kvpack calibrate --model M --out DIR`)")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{meta_path} is not valid JSON: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"{meta_path} is not a kvtc calibration (format {found!r})")
        if meta.get("version") == 1:
            raise ValueError(f"{meta_path} was written by an older kvpack (calibration format 1, whose id does not "
                             "cover the layers, heads and settings); make it again with `kvpack calibrate`")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: calibration format version {meta.get('version')!r:.20} is not supported "
                             f"(expected {FORMAT_VERSION})")
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{tensors_path} is corrupted or truncated: {exc}") from None
        missing = {"key_mean", "key_basis", "value_mean", "value_basis"} - set(tensors)
        if missing:
            raise ValueError(f"{tensors_path} lacks tensors {sorted(missing)}")
        try:
            allocations = {k: {kind: Allocation.from_dict(a) for kind, a in v.items()}
                           for k, v in meta["allocations"].items()}
            calib = cls(fingerprint=meta["fingerprint"], layers=[int(i) for i in meta["layers"]],
                        kv_heads=int(meta["kv_heads"]), head_dim=int(meta["head_dim"]),
                        key_mean=tensors["key_mean"], key_basis=tensors["key_basis"],
                        value_mean=tensors["value_mean"], value_basis=tensors["value_basis"],
                        allocations=allocations, settings=meta["settings"], stats=meta.get("stats", {}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{meta_path} lacks or mangles a field: {exc}") from None
        if calib.calibration_id != meta.get("calibration_id"):
            raise ValueError(f"{directory}: the tensors and the JSON do not belong together or were modified "
                             f"(content id {calib.calibration_id} vs recorded {meta.get('calibration_id')})")
        calib._check_shapes()
        return calib

    def _check_shapes(self) -> None:
        p = self.features
        for kind, mean, basis in (("key", self.key_mean, self.key_basis), ("value", self.value_mean, self.value_basis)):
            if mean.shape != (p,) or basis.dim() != 2 or basis.shape[0] != p:
                raise ValueError(f"{kind} mean/basis shapes {list(mean.shape)}/{list(basis.shape)} do not fit "
                                 f"p = {p} features")
            for key, alloc in self.allocations.items():
                n = alloc["keys" if kind == "key" else "values"].n_components
                if n > basis.shape[1]:
                    raise ValueError(f"ratio {key}: the {kind} allocation codes {n} components, "
                                     f"the stored basis has {basis.shape[1]}")


# ------------------------------------------------------------------------------------------------
# Making a calibration
# ------------------------------------------------------------------------------------------------


def _calibration_chunks(tokenizer, settings: CalibrationSettings, documents: list[str] | None) -> list[torch.Tensor]:
    ids = corpus_token_ids(tokenizer, settings.tokens, documents)
    n_chunks = len(ids) // settings.chunk_tokens
    if n_chunks == 0:
        raise ValueError(f"the calibration corpus gave {len(ids)} tokens, fewer than one chunk of "
                         f"{settings.chunk_tokens}")
    return [torch.tensor(ids[i * settings.chunk_tokens:(i + 1) * settings.chunk_tokens]) for i in range(n_chunks)]


@torch.no_grad()
def collect_features(model, chunks: list[torch.Tensor], layers: list[int], head_dim: int, sinks: int,
                     window: int, progress: bool = True, key_rope: str = "pre") -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value features ``[positions, p]`` of every chunk's eligible positions (fp32); keys
    before RoPE (``key_rope="pre"``) or as cached (``"post"``)."""
    rotaries = layer_rotaries(model, layers, head_dim) if key_rope == "pre" else dict.fromkeys(layers)
    keys, values = [], []
    for chunk in tqdm(chunks, desc="[kvpack] calibration prefill", unit="chunk", disable=not progress):
        cache = prefill(model, chunk.tolist())
        stop = chunk.numel() - window
        positions = torch.arange(sinks, stop)
        ks = [cache.layers[i].keys[0, :, sinks:stop] for i in layers]
        vs = [cache.layers[i].values[0, :, sinks:stop] for i in layers]
        keys.append(to_features(ks, [rotaries[i] for i in layers], positions))
        values.append(to_features(vs, None, positions))
    return torch.cat(keys), torch.cat(values)


def pca(data: torch.Tensor, dim: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean ``[p]``, leading principal directions ``[p, dim]`` and singular values ``[dim]`` of
    ``data [n, p]`` by randomized SVD (Halko et al.; a seeded generator, the global RNG untouched)."""
    mean = data.mean(0)
    dim = min(dim, data.shape[0], data.shape[1])
    _, s, v = randomized_svd(data - mean, dim, iters, torch.Generator().manual_seed(seed))
    order = torch.argsort(s, descending=True)
    return mean, v[:, order].contiguous(), s[order]


def block_pca(data: torch.Tensor, block: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pca` with a block-diagonal basis: each ``block`` consecutive features (the last block may be
    shorter) get the exact eigenvectors of their own centred covariance (fp64); the components of all blocks
    are ordered by variance and the leading ``dim`` kept. Returns mean ``[p]``, basis ``[p, dim]`` and the
    singular values ``[dim]`` (square roots of ``Xᵀ X``'s eigenvalues, as :func:`pca`'s)."""
    mean = data.mean(0)
    x = data - mean
    p = x.shape[1]
    columns, variances = [], []
    for first in range(0, p, block):
        part = x[:, first:first + block].double()
        lam, vec = torch.linalg.eigh(part.T @ part)
        column = torch.zeros(p, vec.shape[1], dtype=torch.float64)
        column[first:first + block] = vec
        columns.append(column)
        variances.append(lam.clamp_min(0))
    lam = torch.cat(variances)
    order = torch.argsort(lam, descending=True)[:min(dim, p)]
    return mean, torch.cat(columns, 1)[:, order].float().contiguous(), lam[order].sqrt().float()


def calibrate(model, tokenizer, settings: CalibrationSettings | None = None, documents: list[str] | None = None,
              progress: bool = True, chunks: list[torch.Tensor] | None = None) -> Calibration:
    """Calibrate kvtc for ``model`` (see the module docstring for the steps).

    Args:
        documents: calibration texts (default: the standard-library corpus of ``kvpack.storage.kvtc.corpus``).
        chunks: token-id sequences ``[chunk_tokens]`` to use instead of tokenizing ``documents``
            (``tokenizer`` may then be None).
    """

    settings = settings or CalibrationSettings()
    shape = attention_shape(model)
    layers = full_attention_layers(model)
    if not layers:
        raise ValueError("this model has no full-attention layer for kvtc to calibrate")
    timings = {}
    start = time.perf_counter()
    if chunks is None:
        chunks = _calibration_chunks(tokenizer, settings, documents)
    elif any(c.dim() != 1 or c.numel() <= settings.sinks + settings.window for c in chunks):
        raise ValueError("calibration chunks must be 1-D token-id tensors longer than sinks + window")
    keys, values = collect_features(model, chunks, layers, shape["head_dim"], settings.sinks, settings.window,
                                    progress, key_rope=settings.key_rope)
    timings["prefill_s"] = time.perf_counter() - start
    gen = torch.Generator().manual_seed(settings.seed)
    pool = keys.shape[0]
    n = pool if settings.samples is None else min(settings.samples, pool)
    pick = torch.randperm(pool, generator=gen)[:n]
    dp_pick = pick[: min(settings.dp_samples, n)]
    p = keys.shape[1]
    stats: dict = {"positions_pool": pool, "positions_sampled": n, "features": p, "chunks": len(chunks)}
    bases, means, allocations = {}, {}, {}

    def step(message):
        return status(message) if progress else contextlib.nullcontext()

    for kind, data in (("keys", keys), ("values", values)):
        t0 = time.perf_counter()
        group = settings.layer_group_of(kind)
        if group is None:
            with step(f"PCA of {n} x {data.shape[1]} {kind} (randomized SVD, {settings.pca_dim} components)"):
                mean, basis, sv = pca(data[pick], settings.pca_dim, settings.svd_iters, settings.seed)
        else:
            block = group * shape["kv_heads"] * shape["head_dim"]
            with step(f"PCA of {n} x {data.shape[1]} {kind} in blocks of {group} layers"):
                mean, basis, sv = block_pca(data[pick], block, settings.pca_dim)
        timings[f"pca_{kind}_s"] = time.perf_counter() - t0
        total_var = float((data[pick] - mean).pow(2).sum())
        explained = (sv.double().pow(2).cumsum(0) / total_var).tolist()
        stats[f"{kind}_explained_at"] = {str(k): explained[k - 1] for k in (16, 64, 256, 1024, 2048, 4096)
                                         if k <= len(explained)}
        t0 = time.perf_counter()
        with step(f"DP bit allocation of {kind} for ratios {', '.join(map(ratio_key, settings.ratios))}"):
            coeffs = (data[dp_pick] - mean) @ basis
            errors = aligned_group_errors(coeffs)
            for ratio in settings.ratios:
                budget = int(BF16_BITS * p // ratio)
                allocations.setdefault(ratio_key(ratio), {})[kind] = allocate_bits(errors, basis.shape[1], budget)
        timings[f"dp_{kind}_s"] = time.perf_counter() - t0
        means[kind], bases[kind] = mean, basis
    # Keep only components some ratio codes; re-solve nothing, just cut each allocation there.
    for kind in ("keys", "values"):
        used = max(a[kind].coded_extent for a in allocations.values())
        bases[kind] = bases[kind][:, :used].contiguous()
        for a in allocations.values():
            a[kind] = _truncate(a[kind], used)
        stats[f"{kind}_components_kept"] = used
    stats["widths"] = {k: {kind: _width_summary(a[kind]) for kind in a} for k, a in allocations.items()}
    timings["total_s"] = time.perf_counter() - start
    stats["timings"] = timings
    return Calibration(fingerprint=model_fingerprint(model), layers=layers, kv_heads=shape["kv_heads"],
                       head_dim=shape["head_dim"], key_mean=means["keys"], key_basis=bases["keys"],
                       value_mean=means["values"], value_basis=bases["values"], allocations=allocations,
                       settings=settings.to_dict(), stats=stats)


def _truncate(alloc: Allocation, n: int) -> Allocation:
    """Drop groups at or beyond component ``n`` (they are all zero-width)."""
    groups = tuple(g for g in alloc.groups if g[0] < n)
    if groups and groups[-1][0] + groups[-1][1] > n:
        start, size, width = groups[-1]
        if width:
            raise AssertionError("cut through a coded group")
        groups = groups[:-1] + ((start, n - start, 0),) if n > start else groups[:-1]
    return Allocation(groups=groups, budget_bits=alloc.budget_bits, used_bits=alloc.used_bits, error=alloc.error)


def _width_summary(alloc: Allocation) -> dict:
    widths = alloc.widths()
    coded = widths[widths > 0]
    nonincreasing = bool((widths[1:] <= widths[:-1]).all()) if len(widths) > 1 else True
    return {"coded_components": int(len(coded)), "used_bits": alloc.used_bits, "budget_bits": alloc.budget_bits,
            "groups": len(alloc.coded_groups()), "max_width": int(widths.max()) if len(widths) else 0,
            "nonincreasing": nonincreasing,
            "inversions": int((widths[1:] > widths[:-1]).sum()) if len(widths) > 1 else 0}
