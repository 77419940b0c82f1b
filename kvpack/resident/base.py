"""The resident family's interface: per-layer stores that count their bytes, and the codec that builds them.

A resident method keeps the cache compressed while attention runs. A :class:`StoreFactory` (a
method's store class plus a validated config) builds per-layer *stores* (``LayerStore``). A store
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
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention.backend import resolve_backend
from ..attention.history_and_chunk import history_and_chunk
from ..attention.softmax_merge import PartialAttention, group_queries, prefill_attention
from ..config import MethodConfig
from ..ops.accounting import dense_bf16_bytes
from ..ops.finite import all_finite

# Names of MethodConfig.storage_dtype -> torch dtypes (None: the model's own dtype).
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": None}


def storage_torch_dtype(config: MethodConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a config's ``storage_dtype`` (``auto``: ``model_dtype``)."""
    return STORAGE_DTYPES[config.storage_dtype] or model_dtype


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


class LayerStore(ABC):
    """One sequence's keys/values of one layer, held in a resident method's form.

    A resident method is one ``LayerStore`` subclass with a ``Config`` (a :class:`MethodConfig`),
    registered in :mod:`kvpack.methods.catalog` (a user's own with ``@register_method("name")``).

    The cache calls, for each chunk of new tokens (the prefill, each decode step, a later chunk):
    ``out = store.attend(q, k, v, scaling)`` — exact attention of the chunk's queries over the stored
    history plus the chunk itself (causal) — then ``store.append(k, v, q, out)``, which stores the
    chunk and compresses what the method's policy says.

    :meth:`attend` is the one template every compressed method shares: the chunk checked (once:
    ``append`` does not check the same chunk again), ``scaling`` kept, the prefill's exact causal
    attention, and after it the grouped queries' partial states over the stored form
    (:meth:`stored_partials`, the method's own — where its native or Triton kernel plugs in) merged in
    one call with the dense tokens the chunk kernel reads in place (:meth:`chunk_tail`) and the chunk
    itself. A method supplies ``stored_partials``, ``append`` (its compression policy), ``tensors``
    and ``reconstruct``. FullKV and ``hf_quantized`` override ``attend`` (SDPA over what they hold, as
    transformers computes it).
    """

    name: ClassVar[str] = ""  # set when registered (kvpack.registry.register)
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    budgeted: ClassVar[bool] = True  # False: the method has no byte budget (FullKV)

    def __init__(self, layout: LayerLayout, config: MethodConfig):
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} expects a {self.Config.__name__}, got {type(config).__name__}")
        self.layout = layout
        self.config = config
        self.storage_dtype = storage_torch_dtype(config, layout.model_dtype)
        self.seq_len = 0
        self.scaling: float | None = None  # the layer's logit scale, known from the first attend
        self._checked: tuple | None = None  # the chunk attend checked, until append takes it
        self._staged: tuple | None = None  # the chunk an attend that stores (FullKV, hf_quantized) stored
        self._backend: tuple[str, str, str] | None = None  # (choice, device type, resolved path): backend()

    # -- the template -----------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of new queries over history + the new chunk.

        Args:
            q: ``[q_heads, Q, d]`` queries of the chunk's tokens (post-RoPE).
            k, v: ``[kv_heads, Q, d]`` keys (post-RoPE) and values of the same tokens.
            scaling: logit scale.

        Returns:
            ``[q_heads, Q, d]`` in ``q.dtype``.
        """
        self.check_chunk(q, k, v)
        self.scaling = scaling
        if self.seq_len == 0:  # prefill: exact dense causal attention, as the model computes it
            return prefill_attention(q, k, v, scaling)
        lay = self.layout
        qg = group_queries(q, lay.kv_heads)
        out, m, l = history_and_chunk(self.stored_partials(qg, scaling), qg, k, v, scaling, lay.q_heads,
                                      self.backend(qg.device), tail=self.chunk_tail())
        self.after_attend(m, l)
        return out.to(q.dtype)

    @property
    def attention_backend(self) -> str:
        """What the config allows: its ``attention_backend`` (``auto`` / ``triton`` / ``native`` / ``torch``);
        ``torch`` for a config without one."""
        return getattr(self.config, "attention_backend", "torch")

    def backend(self, device: torch.device) -> str:
        """The path this store's attention takes on ``device`` — ``"triton"``, ``"native"`` or ``"torch"`` —
        decided once (:func:`kvpack.attention.backend.resolve_backend`) and kept; decided again only if the
        config's choice or the device changes (a test swapping the config)."""
        key = (self.attention_backend, device.type)
        if self._backend is None or self._backend[:2] != key:
            self._backend = (*key, resolve_backend(self.attention_backend, device))
        return self._backend[2]

    def chunk_tail(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Dense stored tokens ``(k, v) [kv_heads, T, d]`` that the chunk step reads in place instead
        of a partial state from :meth:`stored_partials` (AnchorKV's tail); None: there are none."""
        return None

    def after_attend(self, m: torch.Tensor, l: torch.Tensor) -> None:  # noqa: B027 - an optional hook
        """Hook: the merged softmax state ``m, l [kv_heads, group · Q]`` of the chunk just attended."""

    # -- the contract -----------------------------------------------------------------------

    @abstractmethod
    def stored_partials(self, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
        """Partial softmax states of grouped queries ``qg [kv_heads, group · Q, d]`` over everything
        stored (but :meth:`chunk_tail`), read in the stored form."""

    @abstractmethod
    def append(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> None:
        """Store the chunk (after :meth:`attend`); ``q``/``out`` are its queries and attention
        outputs, for codecs that score tokens with them."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the store holds (dense regions, factors, codes, scales, indices...)."""

    @abstractmethod
    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (post-RoPE) and values attention reads, decoded: ``(K̂, V̂)`` fp32
        ``[kv_heads, n, d]`` in position order — ``n = seq_len``, or the kept tokens for a method that
        evicts. Attention over a store equals attention over these (the test matrix checks it);
        for tests and inspection only, attention never calls it."""

    # -- shared -----------------------------------------------------------------------------

    @classmethod
    def check_model(cls, config: MethodConfig, fingerprint: Callable[[], dict]) -> None:
        """Refuse a model the config's artifacts were not made for (a calibration of another model);
        ``fingerprint()`` computes the model's (``kvpack.hf.fingerprint.model_fingerprint``) when asked.
        Nothing to check by default."""
        return None

    @classmethod
    def new_group(cls, layouts: list[LayerLayout], config: MethodConfig) -> Any:
        """The object one sequence's stores of this method share across layers (None: they share
        nothing). ``puzzle_plus`` returns its whole-cache budget; its stores take it as ``group=``."""
        return None

    def load_prefill(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                     scaling: float) -> None:
        """Store an exactly computed prefill chunk into an empty store, as ``attend`` + ``append``
        would in a prefill, but with the attention outputs ``out [q_heads, T, d]`` computed
        elsewhere (the evaluation harness builds every method from one exact prefill)."""
        if self.seq_len:
            raise ValueError(f"load_prefill needs an empty store; this one holds {self.seq_len} tokens")
        self.scaling = scaling
        self.append(k, v, q=q, out=out)

    @property
    def budget_covers_decode(self) -> bool:
        """Whether the byte budget holds after every decode step (True), or covers the prompt only:
        the tokens generated after it are kept dense, as the method's paper specifies (SnapKV, H2O
        without score updates, AnchorKV without re-compression; the SVD baseline factorizes once)."""
        return True

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
        """Refuse malformed input with a message naming the problem. A chunk is checked once: the
        ``append`` after ``attend`` of the same tensors skips it (with ``check_finite`` each check of a
        tensor is a host synchronisation on a GPU)."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] is k and checked[1] is v and checked[2] is q:
            return
        self._validate_chunk(q, k, v)
        self._checked = (k, v, q)

    def stored_by_attend(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> bool:
        """For stores whose ``attend`` already stores the chunk (FullKV writes it into its buffer,
        ``hf_quantized`` hands it to transformers' layer): whether ``append``'s chunk is that one. The
        chunk is checked if it is not, and let go of either way."""
        staged, self._staged = self._staged, None
        self.check_chunk(q, k, v)
        return staged is not None and staged[0] is k and staged[1] is v

    def _validate_chunk(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
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
            if self.config.check_finite and not all_finite(t):
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
# A resident method with its config
# --------------------------------------------------------------------------------------------


class StoreFactory:
    """A resident method with a validated config: the factory of its per-layer stores.

    Args:
        store_cls: the method's registered :class:`LayerStore` subclass.
        config: an instance of ``store_cls.Config`` (None: built from ``overrides``).
    """

    def __init__(self, store_cls: type[LayerStore], config: MethodConfig | None = None, **overrides):
        if config is None:
            config = store_cls.Config(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, store_cls.Config):
            raise TypeError(f"method {store_cls.name!r} expects a {store_cls.Config.__name__}, "
                            f"got {type(config).__name__}")
        self.store_cls = store_cls
        self.config = config

    @property
    def name(self) -> str:
        return self.store_cls.name

    @property
    def Config(self) -> type[MethodConfig]:  # noqa: N802 - the class it names
        return self.store_cls.Config

    def check_model(self, fingerprint: Callable[[], dict]) -> None:
        """Refuse a model the config's artifacts were not made for (``LayerStore.check_model``)."""
        self.store_cls.check_model(self.config, fingerprint)

    def new_group(self, layouts: list[LayerLayout]) -> Any:
        """What one sequence's stores share across its compressed layers (see ``LayerStore.new_group``)."""
        return self.store_cls.new_group(layouts, self.config)

    def new_store(self, layout: LayerLayout, group: Any = None) -> LayerStore:
        """A store for one layer of one sequence; ``group`` = that sequence's :meth:`new_group`."""
        if group is None:
            return self.store_cls(layout, self.config)
        return self.store_cls(layout, self.config, group=group)

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "config": self.config.to_dict()}
