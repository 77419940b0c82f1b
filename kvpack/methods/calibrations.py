"""Calibrations made for the user: a config's ``calibration="auto"`` becomes the model's own, made on first use.

Two methods need a calibration of the model: ``pca_quant`` with a layer profile (how much coding each layer
costs the model, :mod:`kvpack.methods.layer_profile`) and kvtc / ``kvtc_resident`` (PCA bases and bit
allocations, :mod:`kvpack.storage.kvtc.calibration`). A preset that needs one says ``calibration="auto"``
(:mod:`kvpack.presets`); :func:`resolve_calibration` turns that into a directory:

1. shipped with the package for the models kvpack measures (``kvpack/data/calibrations/``: the layer profiles,
   a few kB each), when the model's fingerprint matches;
2. else kvpack's cache directory, ``<cache_dir>/calibrations/<fingerprint hash>/<kind>[-<settings>]``, keyed by
   the model's fingerprint as converted models are (:func:`kvpack.paths.cache_dir`);
3. else made there now, with a progress bar, written to a temporary directory and renamed into place (a run
   cut short leaves nothing half-written behind).

A file found there that was made for another model, truncated or tampered with is refused by the loader with
a one-line message naming it; a cache directory that cannot be written is refused naming the directory and
the way out (``KVPACK_CACHE_DIR``, or ``calibration=DIR`` of one made with ``kvpack calibrate``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hf.fingerprint import model_fingerprint
from ..hf.models import load_tokenizer
from ..paths import cache_dir
from ..presets import auto_calibration_settings, is_auto_calibration
from ..resident.pca_quant.layer_budgets import PROFILE_FILE
from ..storage.kvtc.calibration import DEFAULT_RATIOS as KVTC_DEFAULT_RATIOS
from ..storage.kvtc.calibration import TENSORS_FILE, CalibrationSettings, calibrate
from .layer_profile import profile_layers

PACKAGED = Path(__file__).resolve().parents[1] / "data" / "calibrations"
# An automatic kvtc calibration allocates bits for every ratio a preset uses and kvpack calibrate's defaults,
# so one calibration serves them all (each ratio's allocation is solved on its own: a calibration with more
# ratios codes each of them exactly as one with fewer would).
AUTO_KVTC_RATIOS = tuple(sorted({4.0, 8.0, 16.0, 32.0, *KVTC_DEFAULT_RATIOS}))
LAYER_PROFILE_METHODS = ("pca_quant",)
KVTC_METHODS = ("kvtc", "kvtc_resident")


@dataclass(frozen=True)
class CalibrationNeed:
    """What one config's ``calibration="auto"`` asks for.

    Attributes:
        kind: ``layer_profile`` or ``kvtc``.
        settings: kvtc's :class:`CalibrationSettings` fields that differ from kvpack calibrate's defaults
            (``ratios`` always; ``key_layer_group`` for a key basis per layer); ``{}`` for a layer profile.
    """

    kind: str
    settings: dict

    def directory_name(self) -> str:
        """``layer_profile`` / ``kvtc`` / ``kvtc-key_layer_group=1``: the settings beyond the ratios, named."""
        extra = {k: v for k, v in sorted(self.settings.items()) if k != "ratios"}
        ratios = self.settings.get("ratios")
        if ratios is not None and tuple(ratios) != AUTO_KVTC_RATIOS:
            extra["ratios"] = "_".join(f"{r:g}" for r in ratios)
        return self.kind + "".join(f"-{k}={v}" for k, v in extra.items())


def calibration_need(method: str, calibration: str, ratio: float | None = None) -> CalibrationNeed:
    """The calibration ``method``'s config asks for with ``calibration`` (``auto`` or ``auto:k=v,...``).

    Raises:
        ValueError: the method takes no calibration, or the ``auto:`` settings are not kvtc calibration fields.
    """
    settings = auto_calibration_settings(calibration)
    if method in LAYER_PROFILE_METHODS:
        if settings:
            raise ValueError(f"{method}'s automatic layer profile takes no settings, got calibration={calibration!r}")
        return CalibrationNeed("layer_profile", {})
    if method not in KVTC_METHODS:
        raise ValueError(f"method {method!r} takes no calibration (calibration={calibration!r})")
    fields = {f.name for f in dataclasses.fields(CalibrationSettings)} - {"ratios"}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(f"calibration {calibration!r}: {unknown} are not kvtc calibration settings; known: "
                         f"{sorted(fields)}")
    ratios = AUTO_KVTC_RATIOS if ratio is None or float(ratio) in AUTO_KVTC_RATIOS \
        else tuple(sorted({*AUTO_KVTC_RATIOS, float(ratio)}))
    CalibrationSettings(**settings, ratios=ratios)  # refuse a bad value now, naming the field
    return CalibrationNeed("kvtc", {**settings, "ratios": ratios})


def _made(kind: str, directory: Path) -> bool:
    return (directory / (PROFILE_FILE if kind == "layer_profile" else TENSORS_FILE)).is_file()


def packaged_calibration(need: CalibrationNeed, fingerprint: dict) -> Path | None:
    """A calibration shipped with kvpack for this model (its fingerprint hash), if there is one."""
    directory = PACKAGED / fingerprint["hash"] / need.directory_name()
    return directory if _made(need.kind, directory) else None


def cached_calibration_dir(need: CalibrationNeed, fingerprint: dict) -> Path:
    """Where kvpack keeps (or makes) this model's calibration: under its cache directory, by fingerprint."""
    return cache_dir() / "calibrations" / fingerprint["hash"] / need.directory_name()


def _make(need: CalibrationNeed, model, tokenizer, progress: bool):
    if tokenizer is None:
        tokenizer = _tokenizer_of(model)
    if need.kind == "layer_profile":
        return profile_layers(model, tokenizer, progress=progress)
    return calibrate(model, tokenizer, CalibrationSettings(**need.settings), progress=progress)


def _tokenizer_of(model):
    """The tokenizer saved beside the model's weights (``model.name_or_path``), to tokenize the corpus."""
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source:
        raise ValueError("making this model's calibration needs its tokenizer: pass tokenizer= (the model names "
                         "no directory to load it from)")
    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"making this model's calibration needs its tokenizer, which could not be loaded from "
                         f"{source!r} ({exc}): pass tokenizer=") from None


def _writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise ValueError(f"cannot write this model's calibration under {directory} ({exc.strerror or exc}): set "
                         "KVPACK_CACHE_DIR to a writable directory, or pass calibration=DIR of one made with "
                         "`kvpack calibrate`") from None


@torch.no_grad()
def ensure_calibration(need: CalibrationNeed, model, tokenizer=None, progress: bool = True) -> Path:
    """The directory of ``model``'s calibration for ``need``: shipped, cached, or made now (module doc)."""
    fingerprint = model_fingerprint(model)
    shipped = packaged_calibration(need, fingerprint)
    if shipped is not None:
        return shipped
    target = cached_calibration_dir(need, fingerprint)
    if _made(need.kind, target):
        return target
    _writable(target.parent)
    what = "layer profile" if need.kind == "layer_profile" else "kvtc calibration"
    if progress:
        print(f"[kvpack] making this model's {what} once, into {target} (later runs read it)", file=sys.stderr,
              flush=True)
    artifact = _make(need, model, tokenizer, progress)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        artifact.save(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not _made(need.kind, target):  # not another process that finished first: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_calibration(method: str, config: dict, model, tokenizer=None, progress: bool = True) -> dict:
    """``config`` with an automatic ``calibration`` replaced by the directory of the model's own
    (:func:`ensure_calibration`); any other config is returned as it is."""
    value = config.get("calibration")
    if not is_auto_calibration(value):
        return config
    ratio = config.get("ratio")
    if ratio is None and config.get("budget"):  # kvtc given a budget compresses at 1 / budget (its target_ratio)
        ratio = round(1.0 / config["budget"], 6)
    need = calibration_need(method, value, ratio)
    return {**config, "calibration": str(ensure_calibration(need, model, tokenizer, progress))}

