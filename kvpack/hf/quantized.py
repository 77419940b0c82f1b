"""``hf_quantized``: transformers' own ``QuantizedCache`` layers (optimum-quanto or HQQ) as a kvpack
resident method — the peer users already run, measured under kvpack's protocol.

Each store holds one transformers quantized cache layer (``QuantoQuantizedLayer`` /
``HQQQuantizedLayer``) for one sequence and layer, and lets it do exactly what it does inside
``QuantizedCache``: the prompt is quantized whole (attention over the prompt is exact), decode tokens
wait in a full-precision residual of up to ``residual_length`` tokens, and when the residual fills,
the layer dequantizes everything, appends the residual and quantizes it all again (transformers'
scheme, not KIVI's append-only groups); attention runs over ``[dequantized, residual, new tokens]``
with SDPA, as transformers computes it. Bytes are what the layer's tensors hold: the packed codes,
scales and zero points of the quantized part (the inner tensors of quanto's ``QTensor``, the codes
and ``meta`` tensors of HQQ) plus the residual.

The optional dependencies are the ``peers`` extra (``pip install "kvpack[peers]"``); without them the
store is refused with the extra's name. Sliding-window layers stay the model's, as for every method.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

import torch
from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

from ..attention.dense import dense_state, sdpa_chunk
from ..config import STORAGE_DTYPE_NAMES, MethodConfig, choice, integer, number, option
from ..resident.base import LayerLayout, LayerStore

BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto", (2, 4)), "hqq": ("hqq", "hqq", (1, 2, 3, 4, 8))}


@dataclass(frozen=True)
class HFQuantizedConfig(MethodConfig):
    """transformers' ``QuantizedCache`` settings, with its defaults.

    Attributes:
        backend: ``quanto`` (optimum-quanto) or ``hqq``.
        nbits: bits per code (quanto: 2 or 4; HQQ: 1, 2, 3, 4 or 8).
        group_size: values per quantization group (transformers' ``q_group_size``).
        residual_length: full-precision tokens kept before the whole cache is re-quantized.
        axis_key, axis_value: the axis transformers quantizes along (0 or -1 for quanto, 0 or 1 for HQQ).
        budget: none — the bytes follow nbits, group_size and residual_length (a budget is refused).
        storage_dtype: ``auto``: the layer keeps the model's dtype, as in transformers (the only choice).
    """

    budget: float | None = option(None, number(0.0, 1.0, low_open=True, optional=True),
                                  "none: the bytes follow nbits, group_size and residual_length")
    storage_dtype: str = option("auto", choice(*STORAGE_DTYPE_NAMES), "auto: the model's dtype, as transformers")
    backend: str = option("quanto", choice(*BACKENDS), "transformers' quantization backend")
    nbits: int = option(4, integer(minimum=1, maximum=8), "bits per code")
    group_size: int = option(64, integer(minimum=1), "values per quantization group (q_group_size)")
    residual_length: int = option(128, integer(minimum=0), "full-precision tokens before re-quantizing")
    axis_key: int = option(0, integer(minimum=-1, maximum=1), "axis the keys are quantized along")
    axis_value: int = option(0, integer(minimum=-1, maximum=1), "axis the values are quantized along")

    def check(self) -> None:
        if self.budget is not None:
            raise self.error(f"budget {self.budget:g} is not a setting of hf_quantized: its bytes follow nbits, "
                             "group_size and residual_length")
        if self.storage_dtype != "auto":
            raise self.error("storage_dtype must be auto: transformers' layers keep the model's dtype")
        allowed = BACKENDS[self.backend][2]
        if self.nbits not in allowed:
            raise self.error(f"nbits must be one of {allowed} for the {self.backend} backend, got {self.nbits}")
        axes = (0, -1) if self.backend == "quanto" else (0, 1)
        for name in ("axis_key", "axis_value"):
            if getattr(self, name) not in axes:
                raise self.error(f"{name} must be one of {axes} for the {self.backend} backend, "
                                 f"got {getattr(self, name)}")


def _inner_tensors(prefix: str, x) -> dict[str, torch.Tensor]:
    """Every plain tensor inside ``x``: a tensor subclass's inner tensors (``__tensor_flatten__``,
    recursively: quanto's QTensor holds a PackedTensor of codes, scales and shifts), a tuple's items,
    a dict's tensor values (HQQ's ``meta``)."""
    if isinstance(x, (tuple, list)):
        return {k: t for i, item in enumerate(x) for k, t in _inner_tensors(f"{prefix}{i}.", item).items()}
    if isinstance(x, dict):
        return {k: t for name, item in x.items() if isinstance(item, torch.Tensor)
                for k, t in _inner_tensors(f"{prefix}{name}.", item).items()}
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor and hasattr(x, "__tensor_flatten__"):
        names, _ = x.__tensor_flatten__()
        return {k: t for name in names for k, t in _inner_tensors(f"{prefix}{name}.", getattr(x, name)).items()}
    return {prefix.rstrip("."): x} if isinstance(x, torch.Tensor) else {}


def _clone(x):
    """A deep copy of what a quantized layer holds. quanto's tensor subclasses cannot be deep-copied
    (``clone`` of a wrapper subclass does not return one), so they are rebuilt from clones of their
    inner tensors (``__tensor_unflatten__``)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(item) for item in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor and hasattr(x, "__tensor_flatten__"):
        names, ctx = x.__tensor_flatten__()
        return type(x).__tensor_unflatten__({n: _clone(getattr(x, n)) for n in names}, ctx, x.size(), x.stride())
    if isinstance(x, torch.Tensor):
        return x.clone()
    return copy.deepcopy(x)


class HFQuantizedStore(LayerStore):
    """One transformers quantized cache layer of one sequence (see the module doc)."""

    Config = HFQuantizedConfig
    budgeted = False

    def __init__(self, layout: LayerLayout, config: HFQuantizedConfig):
        super().__init__(layout, config)
        module, extra, _ = BACKENDS[config.backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise ImportError(f"hf_quantized with backend {config.backend!r} needs {extra}: "
                              f'pip install "kvpack[peers]"')
        layer_cls = QuantoQuantizedLayer if config.backend == "quanto" else HQQQuantizedLayer
        self.layer = layer_cls(nbits=config.nbits, axis_key=config.axis_key, axis_value=config.axis_value,
                               q_group_size=config.group_size, residual_length=config.residual_length)

    def __deepcopy__(self, memo):
        """An independent copy (the harness decodes twice from one compressed state)."""
        other = copy.copy(self)
        other.layer = copy.copy(self.layer)
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            if hasattr(self.layer, name):
                setattr(other.layer, name, _clone(getattr(self.layer, name)))
        other._staged, other._checked = None, None
        return other

    # -- what the layer holds -----------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self.layer.is_initialized:
            return {}
        return {**_inner_tensors("quantized_k.", self.layer._quantized_keys),
                **_inner_tensors("quantized_v.", self.layer._quantized_values),
                "residual_k": self.layer.keys, "residual_v": self.layer.values}

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.layer.is_initialized:
            empty = torch.empty(self.layout.kv_heads, 0, self.layout.head_dim)
            return empty, empty.clone()
        # the quantized tokens, dequantized by the layer itself ([1, kv_heads, n, d])
        parts_k = [self.layer._dequantize(self.layer._quantized_keys)[0].float()]
        parts_v = [self.layer._dequantize(self.layer._quantized_values)[0].float()]
        if self.layer.keys.dim() == 4:  # a residual (transformers keeps an empty 1-D tensor otherwise)
            parts_k.append(self.layer.keys[0].float())
            parts_v.append(self.layer.values[0].float())
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    def stored_partials(self, qg, scaling):
        k, v = self.reconstruct()
        return [dense_state(qg, k, v, scaling, "torch")]

    # -- the chunk ----------------------------------------------------------------------------

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``update`` of the chunk: it stores the chunk and returns every token's keys
        and values ``[1, kv_heads, T, d]`` as its attention reads them."""
        dtype = self.layout.model_dtype
        return self.layer.update(k[None].to(dtype), v[None].to(dtype))

    def attend(self, q, k, v, scaling):
        """The template's exception, as FullKV's: transformers' own path — the chunk stored by the
        layer's ``update``, then SDPA over what it returns (dequantized part, residual, chunk)."""
        self.check_chunk(q, k, v)
        self.scaling = scaling
        keys, values = self._store(k, v)
        self._staged = (k, v)
        return sdpa_chunk(q, keys, values, scaling, self.layout.group)

    def append(self, k, v, q=None, out=None):
        if not self.stored_by_attend(q, k, v):
            self._store(k, v)
        self.seq_len += k.shape[1]
