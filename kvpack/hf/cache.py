"""kvpack as a transformers ``Cache``: compressed full-attention layers, the model's own sliding layers.

``KVPackCache(model, "puzzle", budget=0.6)`` builds the cache transformers would build for the model
(``DynamicCache(config=...)``) and replaces every full-attention layer by a :class:`KVPackLayer`
that holds one codec store per batch row. Sliding-window (and other special) layers keep the
model's own cache layer.

How a compressed layer serves attention (no patching): the cache is used inside ``with
kvpack.attach(model, ...)`` (or ``kvpack.hf.attention.attached(model, cache)``), which makes it the
active cache and switches the model to the ``"kvpack"`` attention function for the block.
``update()`` receives the chunk's keys and values, parks them and returns them unchanged; the
attention function asks the active cache for the calling module's layer
(:meth:`KVPackCache.kvpack_attend`), and :meth:`KVPackLayer.attend` computes attention over each
row's store plus the chunk and then appends the chunk to the store, so each layer compresses
right after its own prefill attention.

Batches: each row has its own store. Padding (left or anywhere) is read from the attention mask
transformers builds; padded tokens are never stored, so a row stores exactly the tokens it would
store alone, and its pages line up as in batch 1.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from ..ops.accounting import DENSE_REFERENCE_BYTES_PER_ELEMENT
from ..ops.rope import shared_rotary_tables
from ..resident import LayerLayout, LayerStore, StoreFactory, get_resident_method
from .attention import active_cache
from .fingerprint import attention_shape, full_attention_layers, model_fingerprint
from .rotary import find_rotary
from .whole_budget import BUDGET_SCOPES, CacheShape, full_layers_budget


class KVPackLayer(CacheLayerMixin):
    """One full-attention layer whose history lives in codec stores (one per batch row)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, codec: StoreFactory, layout: LayerLayout, new_row_store=None):
        super().__init__()
        self.codec = codec
        self.layout = layout
        # new_row_store(layout, batch, row, tokens) -> the store of one batch row, made when its first tokens
        # arrive (``tokens``: how many, padding excluded); KVPackCache's shares a sequence's state across layers
        self.new_row_store = new_row_store or (lambda layout, batch, row, tokens: self.codec.new_store(layout))
        self.rows: list[LayerStore | None] = []  # None: a row whose first tokens have not arrived
        self.columns = 0  # tokens seen incl. padding: the length transformers' masks and positions use
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- transformers' layer API ------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.rows = [None] * key_states.shape[0]  # made at attend, when each row's real tokens are known
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Park the chunk ``[B, kv_heads, Q, d]`` for the attention function; return it unchanged."""
        if self._pending is not None:
            raise RuntimeError(
                f"layer {self.layout.layer_idx}: the previous chunk was never attended; run the model inside "
                "`with kvpack.attach(model, ...)` (it sets attn_implementation='kvpack' for the block)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.rows):
            raise ValueError(
                f"layer {self.layout.layer_idx}: batch size changed from {len(self.rows)} to {key_states.shape[0]}"
            )
        self._pending = (key_states, value_states)
        self.columns += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows = []
        self.columns = 0
        self._pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvpack caches cannot be cropped (compressed tokens cannot be un-stored)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        order = beam_idx.tolist()
        if len(set(order)) != len(order):
            raise NotImplementedError("kvpack caches do not support beam search (rows would share stores)")
        self.rows = [self.rows[i] for i in order]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("kvpack caches do not support num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in indices.tolist()]

    def offload(self):
        raise NotImplementedError("kvpack caches do not support offloading")

    def prefetch(self):
        raise NotImplementedError("kvpack caches do not support offloading")

    # -- attention --------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of the parked chunk's queries over each row's store, then store the chunk.

        Args:
            query: ``[B, q_heads, Q, d]``; key, value: the tensors ``update`` returned.
            attention_mask: transformers' 4-D mask ``[B, 1, Q, columns]`` (bool, True = attend, or
                additive float) or None (no padding).

        Returns:
            ``[B, Q, q_heads, d]`` as transformers' attention functions return it.
        """
        if self._pending is None or key is not self._pending[0]:
            raise RuntimeError(f"layer {self.layout.layer_idx}: attention called without a matching cache update")
        self._pending = None
        B, _, n_q, _ = query.shape
        valid = _valid_chunk_tokens(attention_mask, B, n_q)
        out = torch.zeros_like(query)
        for b in range(len(self.rows)):
            if valid is None:
                q_b, k_b, v_b = query[b], key[b], value[b]
            else:
                keep = valid[b].nonzero().squeeze(-1)
                if keep.numel() == 0:
                    continue
                q_b, k_b, v_b = query[b][:, keep], key[b][:, keep], value[b][:, keep]
            store = self.rows[b]
            if store is None:
                store = self.rows[b] = self.new_row_store(self.layout, len(self.rows), b, k_b.shape[1])
            o_b = store.attend(q_b, k_b, v_b, scaling)
            store.append(k_b, v_b, q=q_b, out=o_b)
            if valid is None:
                out[b] = o_b
            else:
                out[b][:, keep] = o_b
        return out.transpose(1, 2).contiguous()

    def load_prefill(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, out: torch.Tensor,
                     scaling: float) -> None:
        """Fill this empty layer from an exact prefill computed elsewhere (no padding).

        Args:
            key, value: ``[B, kv_heads, T, d]`` (keys post-RoPE); query, out: ``[B, q_heads, T, d]``,
                the chunk's queries and exact attention outputs.
        """
        if self.is_initialized and any(store.seq_len for store in self.rows):
            raise ValueError(f"layer {self.layout.layer_idx}: load_prefill needs an empty layer")
        self.device = key.device
        self.rows = []
        for b in range(key.shape[0]):
            store = self.new_row_store(self.layout, key.shape[0], b, key.shape[2])
            store.load_prefill(key[b], value[b], query[b], out[b], scaling)
            self.rows.append(store)
        self.columns = key.shape[2]
        self.is_initialized = True

    # -- accounting -------------------------------------------------------------------------

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.rows if store is not None)

    def dense_reference_bytes(self) -> int:
        return sum(store.dense_reference_bytes() for store in self.rows if store is not None)


def _valid_chunk_tokens(mask: torch.Tensor | None, batch: int, n_q: int) -> torch.Tensor | None:
    """``[B, Q]`` bool: which of the chunk's tokens are real (not padding); None = all are."""
    if mask is None:
        return None
    if mask.dim() != 4:
        raise ValueError(f"kvpack attention expects a 4-D attention mask, got shape {list(mask.shape)}")
    chunk = mask[:, 0, :, -n_q:]  # [B, Q, Q]: the chunk's own columns
    attend = chunk if chunk.dtype == torch.bool else chunk == 0
    # A real token is seen by at least one query (itself); a padded one by none.
    valid = attend.any(dim=1)
    if batch != valid.shape[0]:
        valid = valid.expand(batch, -1)
    return None if bool(valid.all()) else valid


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``: the keyword this transformers
    version's ``forward``/``generate`` take (``cache=`` from 5.24, ``past_key_values=`` before)."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class KVPackCache(Cache):
    """A transformers cache whose full-attention layers are compressed by a kvpack resident method.

    Args:
        model: the model it serves (its config gives the layer layout).
        method: a registered resident method's name, or one already configured (a
            :class:`StoreFactory`, as ``kvpack.resident.get_resident_method`` returns).
        **config: the method's config fields when ``method`` is a name (e.g. ``budget=0.6``).

    The model uses it only inside ``with kvpack.attach(model, cache=...)`` /
    ``kvpack.hf.attention.attached(model, cache)``, which switch the model's attention to
    ``"kvpack"`` for the block and restore it after; used outside, the first update refuses.
    ``kv_bytes()`` and ``dense_kv_bytes()`` report measured and reference bytes.

    Each full-attention layer holds one store per batch row (padding is never stored). The model
    hands each layer's update keys and values ``[batch, kv_heads, new_tokens, head_dim]``; a store keeps
    them in its compressed form and attention reads that form directly (queries
    ``[batch, q_heads, new_tokens, head_dim]``, output the same shape). Sliding-window layers stay the
    model's own ``DynamicCache`` layers.

    Example:
        >>> import kvpack
        >>> model, tok = kvpack.load_model("smollm2")  # doctest: +SKIP
        >>> cache = kvpack.KVPackCache(model, "puzzle_plus", budget=0.3)  # doctest: +SKIP
        >>> from kvpack.hf.cache import cache_kwargs
        >>> with kvpack.attach(model, cache=cache):  # doctest: +SKIP
        ...     model(**tok("...", return_tensors="pt"), **cache_kwargs(model, cache))
    """

    def __init__(self, model: torch.nn.Module, method: StoreFactory | str = "full", budget_scope: str = "whole",
                 **config):
        if budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope must be one of {BUDGET_SCOPES}, got {budget_scope!r}")
        if isinstance(method, str):
            method = get_resident_method(method, **config)
        elif config:
            raise ValueError("pass config fields only with a method name, not with a method already configured")
        method.check_model(lambda: model_fingerprint(model))  # a calibration of another model is refused here
        self.codec = method
        shape = attention_shape(model)
        text = model.config.get_text_config(decoder=True)
        if getattr(text, "attn_logit_softcapping", None) is not None:  # Gemma 2: tanh-capped logits
            raise NotImplementedError(f"{type(model).__name__} caps its attention logits (attn_logit_softcapping="
                                      f"{text.attn_logit_softcapping}); kvpack's attention does not (softcap)")
        layer_types = getattr(text, "layer_types", None)
        layers = DynamicCache(config=model.config).layers
        # One RoPE table per layer type, shared by its layers (not one per layer).
        tables = shared_rotary_tables(find_rotary(model), shape["head_dim"],
                                      [layer_types[i] if layer_types else None for i in range(len(layers))])
        for i in full_attention_layers(model):  # plain full attention: compress it (the rest is the model's)
            layout = LayerLayout(layer_idx=i, kv_heads=shape["kv_heads"], q_heads=shape["q_heads"],
                                 head_dim=shape["head_dim"], model_dtype=model.dtype, rope=tables[i])
            layers[i] = KVPackLayer(method, layout, self._new_row_store)
        if not any(isinstance(layer, KVPackLayer) for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"this model has no full-attention layer with a standard cache for kvpack to compress "
                             f"(its cache layers: {', '.join(kinds)}; a sliding window on every layer is kept as the "
                             "model keeps it)")
        self._layouts = [layer.layout for layer in layers if isinstance(layer, KVPackLayer)]
        # budget_scope="whole": the model's own (sliding) layers charged to the compressed ones (whole_budget.py),
        # per batch row from its first chunk's real tokens, before its stores are made
        self.budget_scope = budget_scope
        self._shape = CacheShape(
            full_layers=len(self._layouts),
            windows=tuple(getattr(layer, "sliding_window", 0) - 1 if getattr(layer, "is_sliding", False) else None
                          for layer in layers if not isinstance(layer, KVPackLayer)),
            model_bytes=model.dtype.itemsize)
        self._rows: list = []  # per batch row of the sequence: (its method, what its stores share across layers)
        self.method_label = method.name  # a preset's name where kvpack.attach made it from one
        self.recommendation = None  # what method="auto" chose and why (kvpack.methods.recommend), where it did
        super().__init__(layers=layers)

    @property
    def requested_budget(self) -> float | None:
        """The method's own budget (None where it has none): over the whole cache under ``budget_scope="whole"``."""
        return getattr(self.codec.config, "budget", None)

    @property
    def full_layers_budget(self) -> float | None:
        """The budget the compressed layers were given: the requested one, or under ``budget_scope="whole"`` on a
        model with layers kvpack does not hold, the charged one (a batch: its rows' smallest)."""
        given = [codec.config.budget for codec, _ in filter(None, self._rows)]
        return min(given) if given else self.requested_budget

    def _row_codec(self, tokens: int) -> StoreFactory:
        """The method for a row whose first chunk holds ``tokens`` real tokens: the budget charged for the model's
        own layers where the scope is the whole cache."""
        if self.budget_scope != "whole" or self.requested_budget is None or not self._shape.windows:
            return self.codec
        budget = full_layers_budget(self.requested_budget, tokens, self._shape)
        if budget == self.requested_budget:
            return self.codec
        return StoreFactory(self.codec.store_cls, dataclasses.replace(self.codec.config, budget=budget))

    def _new_row_store(self, layout: LayerLayout, batch: int, row: int, tokens: int) -> LayerStore:
        """A store of batch row ``row`` for ``layout``'s layer, made when the row's first ``tokens`` real tokens
        arrive: the row's method and the state its stores share across layers (``StoreFactory.new_group``) are
        made by its first compressed layer, so a row of a padded batch gets what the prompt alone gets."""
        if len(self._rows) != batch:
            self._rows = [None] * batch
        if self._rows[row] is None or layout.layer_idx == self._layouts[0].layer_idx:
            codec = self._row_codec(tokens)
            self._rows[row] = (codec, codec.new_group(self._layouts))
        codec, group = self._rows[row]
        return codec.new_store(layout, group)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if isinstance(self.layers[layer_idx], KVPackLayer) and active_cache() is not self:
            raise RuntimeError(
                "this KVPackCache is not attached: run the model inside `with kvpack.attach(model, ...)` "
                "(or kvpack.hf.attention.attached(model, cache)), which sets attn_implementation='kvpack' "
                "for the block")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def is_compressed_layer(self, layer_idx: int) -> bool:
        return isinstance(self.layers[layer_idx], KVPackLayer)

    def kvpack_attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        return self.layers[layer_idx].attend(query, key, value, attention_mask, scaling)

    @property
    def kvpack_layers(self) -> list[KVPackLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVPackLayer)]

    def kv_bytes(self) -> int:
        """Live bytes of every layer's KV: compressed stores plus the model's own (sliding) layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVPackLayer):
                total += layer.nbytes()
            elif getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total

    def dense_kv_bytes(self) -> int:
        """The same tokens in bf16 (for the model's own layers: the tokens they hold)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVPackLayer):
                total += layer.dense_reference_bytes()
            elif getattr(layer, "keys", None) is not None:
                total += (layer.keys.numel() + layer.values.numel()) * DENSE_REFERENCE_BYTES_PER_ELEMENT
        return total
