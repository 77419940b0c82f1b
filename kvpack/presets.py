"""Presets: the named configurations of kvpack's methods that the frontier measures, in one table.

A preset is a name a user types (``pca_quant-layers``, ``kvtc_resident-8x``) for one registered method with
some of its config fields fixed. Every place that names a configuration reads this table: ``--method`` and
``kvpack eval --methods``, :func:`kvpack.get_method` and :func:`kvpack.attach`, ``kvpack methods``, the frontier
runner (``benchmarks/frontier.py``, whose result labels are these names) and the docs. A label is spelled here
and nowhere else.

A preset that needs a calibration of the model (pca_quant's layer profile, kvtc's PCA bases and bit
allocations) names it as :data:`AUTO_CALIBRATION`: kvpack makes the calibration for the model at hand on first
use and keeps it in its cache directory, keyed by the model's fingerprint (:mod:`kvpack.methods.calibrations`).
``auto:key=value,...`` asks for a kvtc calibration made with other settings (``auto:key_layer_group=1``: a key
basis per layer).

This module is at the bottom of kvpack's layers: plain data, it imports nothing of kvpack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

AUTO_CALIBRATION = "auto"  # a config's ``calibration``: the model's own, made on first use (see the module doc)


def is_auto_calibration(value: Any) -> bool:
    """Whether a ``calibration`` field asks for the model's own calibration (``auto`` or ``auto:k=v,...``)."""
    return isinstance(value, str) and (value == AUTO_CALIBRATION or value.startswith(AUTO_CALIBRATION + ":"))


def unresolved_auto_calibration(value: Any) -> None:
    """Refuse an automatic calibration where a directory is needed (a loader below the entry points that know
    the model): ``ValueError`` naming the way out."""
    if is_auto_calibration(value):
        raise ValueError(f"calibration={value!r} is the model's own calibration, made when kvpack.attach, "
                         "Method.for_model or kvpack generate / eval resolve it for a model; here pass the "
                         "directory of one (kvpack calibrate)")


def auto_calibration_settings(value: str) -> dict[str, int | float | str]:
    """The settings an ``auto:k=v,...`` calibration asks for, typed (``{}`` for plain ``auto``).

    Raises:
        ValueError: ``value`` is not an auto calibration, or a ``k=v`` item is malformed.
    """
    if not is_auto_calibration(value):
        raise ValueError(f"{value!r} is not an automatic calibration ({AUTO_CALIBRATION!r} or "
                         f"'{AUTO_CALIBRATION}:key=value,...')")
    out: dict[str, int | float | str] = {}
    _, _, rest = value.partition(":")
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise ValueError(f"calibration {value!r}: expected key=value after 'auto:', got {item!r}")
        raw = raw.strip()
        try:
            parsed: int | float | str = int(raw)
        except ValueError:
            try:
                parsed = float(raw)
            except ValueError:
                parsed = raw
        out[key.strip()] = parsed
    return out


@dataclass(frozen=True)
class Preset:
    """One named configuration of a registered method.

    Attributes:
        name: what a user types and what the frontier's results call it.
        method: the registered method it configures (``kvpack methods``).
        config: the config fields it fixes (read-only); ``calibration`` is :data:`AUTO_CALIBRATION` (or
            ``auto:...``) where the method needs one.
        budgeted: True when it takes the user's ``budget`` (a fraction of the dense bf16 bytes); False when its
            bytes follow from its own fields (kvtc's ratio, a quantizer's bits).
        summary: one line on what it is, for ``kvpack methods`` and the docs.
        retired: measured once, kept so its rows stay readable and runnable; no longer in the frontier's plan.
    """

    name: str
    method: str
    config: Mapping[str, Any] = field(default_factory=dict)
    budgeted: bool = True
    summary: str = ""
    retired: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    @property
    def needs_calibration(self) -> bool:
        return is_auto_calibration(self.config.get("calibration"))

    def config_dict(self) -> dict[str, Any]:
        """The fixed fields as a plain (mutable) dict."""
        return dict(self.config)


SALIENT_SHARE = 0.02  # pca_quant-salient's share of the prompt's coded tokens kept exact
KVTC_RATIOS = (4, 8, 16)  # kvtc (storage) presets
KVTC_RESIDENT_RATIOS = (8, 16, 32)  # kvtc_resident presets: 4x sits above 0.15 of the bytes, 32x near 0.0625
KVTC_RESIDENT_KEYS_PER_LAYER_RATIOS = (8, 16)
KEYS_PER_LAYER = f"{AUTO_CALIBRATION}:key_layer_group=1"
# LMCache's TurboQuant presets (lmcache_quant's peer rows) and what each codes
TURBOQUANT_PRESETS = (("turboquant_k8v4", "fp8 keys, 4-bit values"),
                      ("turboquant_4bit_nc", "4-bit Lloyd-Max keys with norm correction, 4-bit values"),
                      ("turboquant_k3v4_nc", "3-bit keys, 4-bit values"),
                      ("turboquant_3bit_nc", "3-bit keys, 3-bit values"))

PRESETS: tuple[Preset, ...] = (
    Preset("pca_quant-layers", "pca_quant", {"calibration": AUTO_CALIBRATION},
           summary="pca_quant with its budget spread over the layers by the model's measured layer profile"),
    Preset("pca_quant-salient", "pca_quant", {"calibration": AUTO_CALIBRATION, "salient": SALIENT_SHARE},
           summary="pca_quant-layers keeping exact the 2% of tokens the prompt's last queries read most"),
    Preset("pca_quant-fast", "pca_quant", {"calibration": AUTO_CALIBRATION, "key_rope": "block"},
           summary="pca_quant-layers with each key coded relative to its block's RoPE rotation: attention scores "
                   "the keys in the basis without rebuilding them"),
    Preset("pca_quant-head", "pca_quant", {"balance": "head", "key_metric": "variance"},
           summary="pca_quant's previous default: every (head, side) priced on the share of its own variance"),
    Preset("pca_quant-gaussian", "pca_quant", {"distortion": "gaussian", "balance": "head", "key_metric": "variance"},
           summary="pca_quant's first default: widths priced by a Gaussian model of the min/max error",
           retired=True),
    Preset("puzzle-int4-paper", "puzzle", {"page_size": 32, "rank_k": 16, "rank_v": 14, "int4": True},
           budgeted=False, summary="PuzzleKV at the paper's page and ranks with INT4 factors (18.7% of the bytes)"),
    Preset("hf_quantized-quanto4", "hf_quantized", {"backend": "quanto", "nbits": 4}, budgeted=False,
           summary="transformers' QuantizedCache, quanto 4-bit (the peer users run)"),
    Preset("hf_quantized-quanto2", "hf_quantized", {"backend": "quanto", "nbits": 2}, budgeted=False,
           summary="transformers' QuantizedCache, quanto 2-bit"),
    Preset("hf_quantized-hqq4", "hf_quantized", {"backend": "hqq", "nbits": 4}, budgeted=False,
           summary="transformers' QuantizedCache, HQQ 4-bit"),
    *(Preset(f"turboquant-{preset.removeprefix('turboquant_').replace('_', '-')}", "lmcache_quant",
             {"serde": "turboquant", "preset": preset}, budgeted=False,
             summary=f"LMCache's TurboQuant serde, preset {preset} ({detail}): the cache round-trips through it")
      for preset, detail in TURBOQUANT_PRESETS),
    Preset("fp8-e4m3", "lmcache_quant", {"serde": "fp8"}, budgeted=False,
           summary="LMCache's fp8 serde (e4m3fn, one byte a value): the cache round-trips through it"),
    *(Preset(f"kvtc-{r}x", "kvtc", {"ratio": float(r), "calibration": AUTO_CALIBRATION}, budgeted=False,
             summary=f"kvtc at {r}x smaller than bf16: the cache as a blob between turns") for r in KVTC_RATIOS),
    *(Preset(f"kvtc_resident-{r}x", "kvtc_resident", {"ratio": float(r), "calibration": AUTO_CALIBRATION},
             budgeted=False, summary=f"kvtc's codes held resident at {r}x, attention over them")
      for r in KVTC_RESIDENT_RATIOS),
    *(Preset(f"kvtc_resident-{r}x-keys-per-layer", "kvtc_resident", {"ratio": float(r), "calibration": KEYS_PER_LAYER},
             budgeted=False, summary=f"kvtc_resident at {r}x with a key basis per layer (values cross-layer)")
      for r in KVTC_RESIDENT_KEYS_PER_LAYER_RATIOS),
)

PRESETS_BY_NAME: Mapping[str, Preset] = MappingProxyType({p.name: p for p in PRESETS})


def preset(name: str) -> Preset | None:
    """The preset called ``name`` (None: not a preset)."""
    return PRESETS_BY_NAME.get(name)


def preset_names() -> list[str]:
    return [p.name for p in PRESETS]


__all__ = ["AUTO_CALIBRATION", "PRESETS", "PRESETS_BY_NAME", "Preset", "auto_calibration_settings",
           "is_auto_calibration", "preset", "preset_names", "unresolved_auto_calibration"]
