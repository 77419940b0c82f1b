"""The resident-codec interface: validated configs, a registry, and per-layer stores that count bytes.

A *codec* (``Codec``) turns a validated config into per-layer *stores* (``LayerStore``). A store
holds one sequence's keys and values of one attention layer, in whatever compact form the codec
uses, and answers attention for new queries directly from that form. Every store reports its live
bytes as the sum of the bytes of every tensor it holds (``tensors()``); the dense reference is the
same tokens in bf16.

Layout conventions (one sequence; the batch is handled by ``kvpack.hf.cache``):

* keys/values: ``[kv_heads, tokens, head_dim]``, keys post-RoPE as the model caches them;
* queries: ``[q_heads, Q, head_dim]`` with query head ``h`` served by KV head ``h // group``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

DENSE_REFERENCE_BYTES_PER_ELEMENT = 2  # bf16, as in the papers


def dense_bf16_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of ``tokens`` tokens' keys and values in bf16 (the reference every budget is a fraction of)."""
    return tokens * kv_heads * head_dim * 2 * DENSE_REFERENCE_BYTES_PER_ELEMENT


STORAGE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "auto": None,  # the model's own dtype
}


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclass
class CodecConfig:
    """Fields every codec shares. Subclasses add their own and extend :meth:`validate`.

    Attributes:
        budget: target fraction of the dense bf16 bytes, in (0, 1]; None = use the codec's own
            parameters as given. Each codec maps it onto its parameters and never exceeds it.
        storage_dtype: dtype of dense regions and float factors: ``bfloat16`` (default),
            ``float16``, ``float32`` or ``auto`` (the model's dtype).
        seed: seed for every random choice the codec makes.
        check_finite: refuse chunks whose keys or values hold NaN or Inf (default). On a GPU the
            check reads a flag back to the host: a synchronisation per tensor checked, on every
            layer and decode step, which also rules out capturing decode steps in a CUDA graph;
            ``false`` skips it (shapes and dtypes are still checked).
    """

    VERSION: ClassVar[int] = 1

    budget: float | None = None
    storage_dtype: str = "bfloat16"
    seed: int = 0
    check_finite: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if self.budget is not None:
            _require_number(self, "budget")
            if not (math.isfinite(self.budget) and 0.0 < self.budget <= 1.0):
                raise ValueError(f"budget must be in (0, 1] (a fraction of the dense bf16 bytes), got {self.budget}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        _require_int(self, "seed", minimum=0)
        require_bool(self, "check_finite")

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CodecConfig":
        data = dict(data)
        version = data.pop("version", cls.VERSION)
        if version != cls.VERSION:
            raise ValueError(f"{cls.__name__}: config version {version} is not supported (expected {cls.VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict[str, Any]:
        """Parse ``["key=value", ...]`` (CLI ``--set``) into typed field values."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"--set expects key=value, got {item!r}")
            if key not in names:
                raise ValueError(f"{cls.__name__}: unknown field {key!r}; known fields: {sorted(names)}")
            out[key] = _parse_value(key, raw.strip(), hints[key])
        return out

    def storage_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return STORAGE_DTYPES[self.storage_dtype] or model_dtype


def _parse_value(key: str, raw: str, hint) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        if base is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"field {key!r}: cannot parse {raw!r} as {base.__name__}") from None
    return raw


def _require_number(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _require_int(cfg, name: str, minimum: int | None = None, maximum: int | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


require_int = _require_int


def require_bool(cfg, name: str) -> None:
    """Raise ``ValueError`` unless ``cfg.<name>`` is a bool (not 0/1, not a string)."""
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


# --------------------------------------------------------------------------------------------
# Layer layout and stores
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerLayout:
    """What a store needs to know about its attention layer.

    Attributes:
        layer_idx: index of the layer in the model.
        kv_heads, q_heads, head_dim: attention shape (``q_heads % kv_heads == 0``).
        model_dtype: dtype of the keys/values the model produces.
        rope: cos/sin table of this layer's RoPE (None where the model has none); codecs working on
            pre-RoPE keys need it.
    """

    layer_idx: int
    kv_heads: int
    q_heads: int
    head_dim: int
    model_dtype: torch.dtype = torch.float32
    rope: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("kv_heads", "q_heads", "head_dim"):
            require_int(self, name, minimum=1)
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


class LayerStore(ABC):
    """One sequence's keys/values of one layer, held in a codec's form.

    The cache calls, for each chunk of new tokens (the prefill, each decode step, a later chunk):
    ``out = store.attend(q, k, v, scaling)`` — exact attention of the chunk's queries over the stored
    history plus the chunk itself (causal) — then ``store.append(k, v, q, out)``, which stores the
    chunk and compresses what the codec's policy says.
    """

    def __init__(self, layout: LayerLayout, config: CodecConfig):
        self.layout = layout
        self.config = config
        self.storage_dtype = config.storage_torch_dtype(layout.model_dtype)
        self.seq_len = 0
        self.scaling: float | None = None  # the layer's logit scale, known from the first attend

    # -- the contract -----------------------------------------------------------------------

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of new queries over history + the new chunk.

        Args:
            q: ``[q_heads, Q, d]`` queries of the chunk's tokens (post-RoPE).
            k, v: ``[kv_heads, Q, d]`` keys (post-RoPE) and values of the same tokens.
            scaling: logit scale.

        Returns:
            ``[q_heads, Q, d]`` in ``q.dtype``.
        """

    @abstractmethod
    def append(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> None:
        """Store the chunk (after :meth:`attend`); ``q``/``out`` are its queries and attention
        outputs, for codecs that score tokens with them."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the store holds (dense regions, factors, codes, scales, indices...)."""

    # -- shared -----------------------------------------------------------------------------

    def load_prefill(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                     scaling: float) -> None:
        """Store an exactly computed prefill chunk into an empty store, as ``attend`` + ``append``
        would in a prefill, but with the attention outputs ``out [q_heads, T, d]`` computed
        elsewhere (the evaluation harness builds every method from one exact prefill)."""
        if self.seq_len:
            raise ValueError(f"load_prefill needs an empty store; this one holds {self.seq_len} tokens")
        self.scaling = scaling
        self.append(k, v, q=q, out=out)

    def resolved_params(self) -> dict[str, Any]:
        """Parameters the store derived from its input (e.g. ranks chosen for a budget)."""
        return {}

    def nbytes(self) -> int:
        """Live bytes: the sum of the bytes of every tensor held."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dense_reference_bytes(self) -> int:
        """Bytes of the same tokens' keys and values in bf16."""
        return dense_bf16_bytes(self.seq_len, self.layout.kv_heads, self.layout.head_dim)

    def check_chunk(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """Refuse malformed input with a message naming the problem."""
        lay = self.layout
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
            if t.dim() != 3 or t.shape[0] != lay.kv_heads or t.shape[2] != lay.head_dim:
                raise ValueError(
                    f"{name} must be [kv_heads={lay.kv_heads}, tokens, head_dim={lay.head_dim}], got {list(t.shape)}"
                )
            if self.config.check_finite and not torch.isfinite(t).all():
                raise ValueError(f"{name} of layer {lay.layer_idx} contain NaN or Inf")
        if k.shape != v.shape:
            raise ValueError(f"keys {list(k.shape)} and values {list(v.shape)} must have the same shape")
        if q is not None:
            if q.dim() != 3 or q.shape[0] != lay.q_heads or q.shape[2] != lay.head_dim or q.shape[1] != k.shape[1]:
                raise ValueError(
                    f"queries must be [q_heads={lay.q_heads}, tokens={k.shape[1]}, head_dim={lay.head_dim}], "
                    f"got {list(q.shape)}"
                )


# --------------------------------------------------------------------------------------------
# Codecs and the registry
# --------------------------------------------------------------------------------------------


class Codec:
    """A compression method: a config plus a factory of per-layer stores."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[CodecConfig]] = CodecConfig
    # Storage codecs (kvtc) hold no resident cache: they turn a whole cache into bytes and back, and
    # implement ``roundtrip_generate`` instead of ``new_store``.
    storage: ClassVar[bool] = False

    def __init__(self, config: CodecConfig | None = None, **overrides):
        if config is None:
            config = self.Config(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.Config):
            raise TypeError(f"codec {self.name!r} expects a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config

    def new_store(self, layout: LayerLayout) -> LayerStore:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "config": self.config.to_dict()}


CODECS: dict[str, type[Codec]] = {}


def register_codec(name: str):
    """Class decorator: register a :class:`Codec` subclass under ``name``."""

    def deco(cls: type[Codec]) -> type[Codec]:
        if name in CODECS:
            raise ValueError(f"codec {name!r} is already registered")
        cls.name = name
        CODECS[name] = cls
        return cls

    return deco


def get_codec(name: str, config: CodecConfig | dict | None = None, **overrides) -> Codec:
    """Instantiate a registered codec by name.

    Raises:
        ValueError: unknown name (the message lists the known ones) or invalid config field.
    """
    from . import _all  # noqa: F401  (imports every codec module so they register)

    if name not in CODECS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(CODECS))}")
    cls = CODECS[name]
    if isinstance(config, dict):
        config = cls.Config.from_dict(config)
    return cls(config, **overrides)


def available_codecs() -> list[str]:
    from . import _all  # noqa: F401

    return sorted(CODECS)
