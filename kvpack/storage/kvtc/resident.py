"""``kvtc_resident``: kvtc's cross-layer transform codes held in memory while the model attends over them
(beyond the papers).

kvtc (its paper; ``docs/methods/kvtc.md``) codes a token's keys of *every* layer and KV head as one feature
vector ``[p]`` (``p = layers · kv_heads · d``; keys pre-RoPE) in one calibrated PCA basis, with bit widths from
a dynamic-programming allocation and a per-token fp16 shift and scale per group of components. The keys of
the layers are strongly correlated, so one basis over all of them needs far fewer bits than a basis per layer
or per head: on SmolLM2 at 16x (no DEFLATE) the KL to FullKV is 0.020 with the cross-layer basis, 0.073 with
one basis per 5 layers, 0.66 per layer and 0.84 per head (``benchmarks/results/kvtc-layer-groups.jsonl``).
kvtc uses this for storage; this method keeps the codes resident instead of a dense cache.

Layout of one sequence (all layers share one :class:`ResidentCodes`):

* **Dense** per layer: the first ``sinks`` tokens and the most recent ``window`` to ``window + block - 1``
  (the calibration's sinks and window, as kvtc keeps them lossless), in ``storage_dtype``.
* **Coded**, shared by every layer: for each token between them, kvtc's codes of its key and value features
  (:func:`~kvpack.storage.kvtc.coder.encode_coefficients`: bit-packed code streams, ``[T, groups]`` fp16
  shifts and scales per side). A token is coded once every layer holds it: when the last layer has appended
  a chunk, every layer's oldest tail tokens beyond the window, in a multiple of ``block``, are coded together
  (the prompt's in one go; while decoding, ``block`` tokens every ``block`` steps). kvtc's codes are per token, so
  the codes do not depend on ``block``: a token is coded exactly as kvtc's storage codec codes it.

Attention at layer ``l``: the coded tokens' coefficients ``D [n, r]`` are dequantized once per forward pass
(the first layer's attention; kept until the last layer has attended, then dropped; straight into block order
for a layer-block calibration). The layer's pre-RoPE keys are rebuilt, ``X_l = D_K B_{K,l}ᵀ`` (the
calibration's basis rows of layer ``l``, or of its block's components; bf16 GEMM where the CPU multiplies bf16
natively). For a few query rows (decoding; ``value_path``):

* the scores come from ``X_l`` in one pass that adds the mean, re-applies RoPE and takes the dot products
  (:func:`~kvpack.storage.kvtc.coder.rope_logits`): the keys are never written;
* the values are not rebuilt: they are coded before any rotation, so for the softmax weights ``P [rows, n]`` of
  a KV head ``h``, ``P V_h = (P D_V) B_{V,h}ᵀ + (P 1) μ_{V,h}`` — ``rows · n · r`` multiply-adds per KV head
  against ``n · r · d`` to rebuild its values.

Prefill chunks (``rows ≥ d``) rebuild keys and values (fp32, kvtc's output pass) and attend them as a dense
partial state. Either state is merged with the sinks', the tail's and the chunk's. So a forward pass holds,
besides the resident codes, the dequantized coefficients (``n · (r_keys + r_values)`` elements in the GEMM
dtype) and one layer's ``X_l`` (or, for a prefill chunk, its rebuilt keys and values) — the dense history of
every layer never exists at once.

It runs on the CPU (a cache on another device is refused by name).

Bytes (``nbytes()``): each layer's sinks and tail; the shared codes, counted once, on the last layer's store (the
one that codes them). The calibration (basis and means, per model, like the weights) is not counted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...attention.dense import dense_state
from ...attention.softmax_merge import PartialAttention, state_from_logits
from ...config import MethodConfig, choice, integer, number, option, text
from ...resident.base import LayerLayout
from ...resident.segmented import SegmentedStore
from .calibration import Calibration, ratio_key
from .codec import load_calibration
from .coder import (
    DECODE_PRECISIONS,
    decode_coefficients,
    encode_coefficients,
    inverse_dtype,
    layer_out,
    rope_logits,
)
from .features import to_features
from .native import native

KINDS = ("keys", "values")
PARTS = ("codes", "shift", "scale")
VALUE_PATHS = ("auto", "coefficients", "rebuild")


DEFAULT_RATIO = 16.0


@dataclass(frozen=True)
class KvtcResidentConfig(MethodConfig):
    """Attributes:
        calibration: a kvtc calibration directory of the model (``kvpack calibrate``; required). A calibration
            of another model, or of other layers or heads, is refused.
        ratio: the calibrated ratio whose bit allocation codes the tokens (the coded tokens' bytes are about
            ``1 / ratio`` of bf16; the dense sinks and tail come on top).
        block: while decoding, tokens coded together once the tail holds ``window + block``; a multiple of 8.
            Codes are per token, so it sets how often coding runs, not what the codes are.
        decode_precision: the GEMM that rebuilds a layer from the coefficients: ``auto`` (bf16 where the CPU
            multiplies bf16 natively, else fp32), ``float32`` or ``bfloat16`` (kvtc's ``decode_precision``).
        encode_precision: the GEMM that projects tokens on the basis when they are coded: the same choices
            (``float32``: kvtc's codec's own codes, bit for bit).
        attention_backend: the dense partial state over the rebuilt layer: ``auto`` (kvpack's native CPU
            kernel where built) or ``torch``.
        value_path: how attention contracts the coded values: ``coefficients`` (the softmax weights times the
            coefficients, then the layer's basis rows; nothing rebuilt), ``rebuild`` (the layer's values rebuilt
            and attended densely) or ``auto`` (coefficients when a KV head has fewer query rows than ``d``, as
            in decoding; rebuilt for prefill chunks).
    """

    budget: float | None = option(None, number(0.0, 1.0, low_open=True, optional=True),
                                  "not taken (refused): the calibrated ratio sets the codes' size")
    calibration: str | None = option(None, text(optional=True), "kvtc calibration directory (kvpack calibrate)")
    ratio: float = option(DEFAULT_RATIO, number(1.0, low_open=True), "a calibrated ratio (its bit allocation)")
    block: int = option(32, integer(minimum=8), "tokens coded together while decoding")
    decode_precision: str = option("auto", choice(*DECODE_PRECISIONS), "the rebuild GEMM: auto, float32, bfloat16")
    encode_precision: str = option("auto", choice(*DECODE_PRECISIONS), "the coding GEMM: auto, float32, bfloat16")
    attention_backend: str = option("auto", choice("auto", "torch"), "dense partial: auto (native) or torch")
    value_path: str = option("auto", choice(*VALUE_PATHS), "coded values: auto, coefficients or rebuild")

    def check(self) -> None:
        if self.budget is not None:
            raise self.error(f"takes a calibrated ratio, not a budget (got budget {self.budget:g}); its bytes are "
                             "measured from the tensors")
        if self.block % 8:
            raise self.error(f"block must be a multiple of 8, got {self.block}")


class ResidentCodes:
    """One sequence's coded tokens, shared by its layers' stores (``new_group``).

    Attributes:
        calibration: the model's kvtc calibration (shared, never copied).
        sections: ``{kind: [dict of tensors per coded run]}`` — :func:`encode_coefficients`' sections.
        runs: tokens of each coded run; ``n_coded`` their sum; the coded tokens sit at positions
            ``[sinks, sinks + n_coded)``.
    """

    def __init__(self, calibration: Calibration, config: KvtcResidentConfig, layouts: list[LayerLayout]):
        self.calibration = calibration
        self.config = config
        self.alloc = calibration.allocation(config.ratio)
        self.layer_order = [lay.layer_idx for lay in layouts]
        self.position = {i: j for j, i in enumerate(self.layer_order)}
        self.rotary = {lay.layer_idx: (lay.rope if calibration.key_rope == "pre" else None) for lay in layouts}
        self.stores: dict[int, KvtcResidentStore] = {}
        self.sections: dict[str, list[dict[str, torch.Tensor]]] = {kind: [] for kind in KINDS}
        self.runs: list[int] = []
        self.n_coded = 0
        self.mm_dtype = inverse_dtype(config.decode_precision)
        self.encode_dtype = inverse_dtype(config.encode_precision)
        # A calibration with layer blocks (``layer_group(kind)``): each block's components gathered together, so
        # a layer is rebuilt from its own block's coefficients alone. ``order[kind]``: the coded components in
        # block order (None: one cross-layer block, component order); ``bounds[kind]``: each block's range in it.
        self.order: dict[str, torch.Tensor | None] = {}
        self.columns: dict[str, torch.Tensor | None] = dict.fromkeys(KINDS)  # order's inverse
        self.bounds: dict[str, list[int]] = {}
        for kind in KINDS:
            extent = self.alloc[kind].coded_extent
            group = calibration.layer_group(kind)
            if group is None:
                self.order[kind], self.bounds[kind] = None, [0, extent]
                continue
            blocks = calibration.component_blocks(kind, extent)
            n_blocks = -(-len(self.layer_order) // group)
            self.order[kind] = torch.argsort(blocks, stable=True)
            self.columns[kind] = torch.argsort(self.order[kind])  # each component's column in block order
            self.bounds[kind] = [0, *torch.bincount(blocks, minlength=n_blocks).cumsum(0).tolist()]
        self._bases: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer position): its block's basis rows
        self._coefficients: dict[str, list[torch.Tensor]] | None = None  # per block; during a forward pass only
        self._cos_sin: dict = {}  # rotary table -> the coded positions' (cos, sin); during a forward pass only

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        memo[id(self)] = new
        new.stores = copy.deepcopy(self.stores, memo)
        new.sections = {kind: [dict(run) for run in runs] for kind, runs in self.sections.items()}  # immutable
        new.runs = list(self.runs)
        new._coefficients, new._cos_sin = None, {}  # the basis rows (_bases) are shared: they never change
        return new

    @property
    def last_layer(self) -> int:
        return self.layer_order[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{kind}_{part}_{i}": run[f"{kind}_{part}"] for kind in KINDS
                for i, run in enumerate(self.sections[kind]) for part in PARTS}

    # -- coding -------------------------------------------------------------------------------

    def code_ready(self) -> None:
        """Code every layer's oldest tail tokens beyond the window, in multiples of ``block`` (all of them
        at once after a prefill). Called by the last layer's store after it appended."""
        stores = [self.stores.get(i) for i in self.layer_order]
        if any(s is None for s in stores):
            missing = [i for i, s in zip(self.layer_order, stores) if s is None]
            raise RuntimeError(f"kvtc_resident: layers {missing} have no store; every covered layer appends before "
                               "the last one codes")
        lengths = {s.seq_len for s in stores}
        if len(lengths) != 1:
            raise RuntimeError(f"kvtc_resident: the layers hold different token counts {sorted(lengths)}; the codes "
                               "span every layer, so each layer must have appended the same tokens")
        ready = stores[-1].tail_k.shape[1] - self.calibration.window
        n = ready // self.config.block * self.config.block
        if n <= 0:
            return
        if stores[-1].tail_k.device.type != "cpu":
            raise ValueError(f"kvtc_resident runs on the CPU; the cache's keys are on {stores[-1].tail_k.device}")
        start = self.calibration.sinks + self.n_coded
        popped = [s.pop_tail(n) for s in stores]
        positions = torch.arange(start, start + n)
        features = {
            "keys": to_features([k for k, _ in popped], [self.rotary[i] for i in self.layer_order], positions),
            "values": to_features([v for _, v in popped], None, positions),
        }
        cal = self.calibration
        for kind, mean in (("keys", cal.key_mean), ("values", cal.value_mean)):
            basis = cal.projection(kind, self.alloc[kind].coded_extent, self.encode_dtype)
            self.sections[kind].append(encode_coefficients(features[kind], mean, basis, self.alloc[kind], kind))
        self.runs.append(n)
        self.n_coded += n
        self.release()

    # -- attention ----------------------------------------------------------------------------

    def coefficients(self, kind: str, block: int) -> torch.Tensor:
        """``[n_coded, r_block]`` dequantized coefficients of ``kind``'s layer block ``block`` in the GEMM dtype
        (every block's made on the first call of a forward pass, dropped by :meth:`release`)."""
        if self._coefficients is None:
            self._coefficients = {}
        if kind not in self._coefficients:
            # every run decoded into its rows of one matrix, in block order where the calibration has blocks
            # (the native pass scatters each code to its column: no gather or concatenation after it)
            coeffs = torch.zeros(self.n_coded, self.alloc[kind].coded_extent, dtype=self.mm_dtype)
            first = 0
            for run, n in zip(self.sections[kind], self.runs):
                decode_coefficients(run.__getitem__, self.alloc[kind], kind, n, self.mm_dtype,
                                    columns=self.columns[kind], out=coeffs[first:first + n])
                first += n
            bounds = self.bounds[kind]
            self._coefficients[kind] = [coeffs[:, a:b] for a, b in zip(bounds, bounds[1:])]  # column views
        return self._coefficients[kind][block]

    def basis(self, kind: str, position: int) -> torch.Tensor:
        """``[r_block, kv_heads·d]``: the basis rows of the covered layer at ``position`` for its block's coded
        components, in the GEMM dtype (transposed for ``X = D B``; made once per sequence)."""
        key = (kind, position)
        if key not in self._bases:
            rows = self.calibration.inverse_basis(kind, position, self.alloc[kind].coded_extent, self.mm_dtype)
            order = self.order[kind]
            if order is not None:
                block = self.block_of(kind, position)
                lo, hi = self.bounds[kind][block], self.bounds[kind][block + 1]
                rows = rows[order[lo:hi]].contiguous()
            self._bases[key] = rows
        return self._bases[key]

    def release(self) -> None:
        """Drop the forward pass's dequantized coefficients and RoPE tables (after the last layer attended)."""
        self._coefficients, self._cos_sin = None, {}

    def rope(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin ``[n_coded, d]`` of the coded positions in the layer's rotary table (None where the keys are
        coded after RoPE), made once per forward pass per table (the layers share their model's tables)."""
        table = self.rotary[layer_idx]
        if table is None:
            return None
        if table not in self._cos_sin:
            start = self.calibration.sinks
            self._cos_sin[table] = table.cos_sin(torch.arange(start, start + self.n_coded))
        return self._cos_sin[table]

    def _rebuilt(self, kind: str, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s coded ``kind`` rebuilt, fp32 ``[kv_heads, n_coded, d]`` (keys post-RoPE): kvtc's
        inverse projection in the GEMM dtype and its output pass (:func:`~kvpack.storage.kvtc.coder.layer_out`).
        fp32 because the rebuilt layer is transient: rounding it to the storage dtype would save nothing."""
        cal, j = self.calibration, self.position[layer_idx]
        mean, rope = (cal.key_mean, self.rope(layer_idx)) if kind == "keys" else (cal.value_mean, None)
        x = self.coefficients(kind, self.block_of(kind, j)) @ self.basis(kind, j)
        y = torch.empty(cal.kv_heads, self.n_coded, cal.head_dim, dtype=torch.float32)
        layer_out(native(), x, mean[cal.layer_features(j)], rope, y)
        return y

    def block_of(self, kind: str, position: int) -> int:
        """The layer block of ``kind`` (the calibration's ``layer_group(kind)``) of the covered layer at
        ``position``."""
        group = self.calibration.layer_group(kind)
        return 0 if group is None else position // group

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s coded tokens rebuilt: keys (post-RoPE) and values fp32 ``[kv_heads, n_coded, d]``."""
        return self._rebuilt("keys", layer_idx), self._rebuilt("values", layer_idx)

    def contract_values(self, layer_idx: int, p: torch.Tensor) -> torch.Tensor:
        """``P V`` without the values: ``p [kv_heads, rows, n_coded]`` (softmax weights, fp32 or fp64) times
        layer ``layer_idx``'s coded values, ``[kv_heads, rows, d]`` in ``p``'s dtype, as
        ``(P D) B_hᵀ + (P 1) μ_h`` — exact algebra, since values are coded with no rotation. The products
        run in the GEMM dtype (``P`` rounded to it, products accumulated in fp32 and rounded to it, as the
        rebuild's GEMM rounds ``D B``); fp64 weights (references) multiply in fp64."""
        cal, j = self.calibration, self.position[layer_idx]
        heads, d = cal.kv_heads, cal.head_dim
        rows = p.shape[1]
        coeffs = self.coefficients("values", self.block_of("values", j))  # [n, r]
        basis = self.basis("values", j)  # [r, H·d]
        mm = torch.float64 if p.dtype == torch.float64 else coeffs.dtype
        pd = (p.reshape(heads * rows, -1).to(mm) @ coeffs.to(mm)).to(p.dtype).view(heads, rows, -1)  # [H, rows, r]
        per_head = basis.to(p.dtype).view(-1, heads, d).transpose(0, 1)  # [H, r, d]
        mean = cal.value_mean[cal.layer_features(j)].to(p.dtype).view(heads, 1, d)
        return torch.bmm(pd, per_head) + p.sum(-1, keepdim=True) * mean

    def attend(self, layer_idx: int, qg: torch.Tensor, scaling: float, backend: str) -> PartialAttention:
        """Partial state of grouped queries ``qg [kv_heads, rows, d]`` over layer ``layer_idx``'s coded tokens:
        scores on the rebuilt keys, values contracted on the coefficients (:meth:`contract_values`) when
        ``value_path`` picks it, else the rebuilt layer attended densely (:func:`dense_state`)."""
        path = self.config.value_path
        if path == "rebuild" or (path == "auto" and qg.shape[1] >= self.calibration.head_dim):
            k, v = self.layer(layer_idx)
            return dense_state(qg, k, v, scaling, backend)
        cal, j = self.calibration, self.position[layer_idx]
        x = self.coefficients("keys", self.block_of("keys", j)) @ self.basis("keys", j)  # [n, H·d], pre-RoPE
        q = qg if qg.dtype == torch.float64 else qg.float()
        logits = rope_logits(native(), x, cal.key_mean[cal.layer_features(j)], self.rope(layer_idx), q,
                             scaling)  # [H, rows, n]; the keys are never written
        return state_from_logits(logits, lambda p: self.contract_values(layer_idx, p))


class KvtcResidentStore(SegmentedStore):
    """[dense sinks] [kvtc codes, shared by every layer: :class:`ResidentCodes`] [dense tail] of one layer."""

    Config = KvtcResidentConfig
    budgeted = False  # the calibrated ratio sets the codes' size; the bytes are measured, not targeted

    @classmethod
    def _calibration(cls, config: KvtcResidentConfig) -> Calibration:
        if config.calibration is None:
            raise ValueError("kvtc_resident needs a kvtc calibration of the model: --set calibration=DIR "
                             "(make one with `kvpack calibrate --model M --out DIR`)")
        return load_calibration(config.calibration)

    @classmethod
    def check_model(cls, config: KvtcResidentConfig, fingerprint) -> None:
        cal = cls._calibration(config)
        cal.check_fingerprint(fingerprint())
        cal.allocation(config.ratio)  # refuses an uncalibrated ratio, naming the calibrated ones

    @classmethod
    def new_group(cls, layouts: list[LayerLayout], config: KvtcResidentConfig) -> ResidentCodes:
        cal = cls._calibration(config)
        covered = [lay.layer_idx for lay in layouts]
        if covered != [int(i) for i in cal.layers]:
            raise ValueError(f"the kvtc calibration covers layers {cal.layers}, this model compresses {covered}")
        lay = layouts[0]
        if (lay.kv_heads, lay.head_dim) != (cal.kv_heads, cal.head_dim):
            raise ValueError(f"the kvtc calibration is for {cal.kv_heads} KV heads of {cal.head_dim}, this model has "
                             f"{lay.kv_heads} of {lay.head_dim}")
        if cal.key_rope == "pre" and lay.rope is None:
            raise ValueError("the kvtc calibration holds pre-RoPE keys, but this model's layers have no RoPE table")
        return ResidentCodes(cal, config, layouts)

    def __init__(self, layout: LayerLayout, config: KvtcResidentConfig, group: ResidentCodes | None = None):
        super().__init__(layout, config)
        if group is None:  # a store alone (no cache around it) is its own one-layer sequence
            group = self.new_group([layout], config)
        self.group = group
        group.stores[layout.layer_idx] = self

    # -- SegmentedStore hooks -------------------------------------------------------------------

    @property
    def sink_capacity(self) -> int:
        return self.group.calibration.sinks

    def compress(self) -> None:
        if self.layout.layer_idx == self.group.last_layer:
            self.group.code_ready()

    def history_tensors(self) -> dict[str, torch.Tensor]:
        return self.group.tensors() if self.layout.layer_idx == self.group.last_layer else {}

    def history_partials(self, qg: torch.Tensor, scaling: float) -> list[PartialAttention]:
        group = self.group
        if not group.n_coded:
            return []
        if qg.device.type != "cpu":  # the codes, the calibration and kvtc's native passes are the CPU's
            raise ValueError(f"kvtc_resident runs on the CPU; layer {self.layout.layer_idx}'s queries are on "
                             f"{qg.device}")
        state = group.attend(self.layout.layer_idx, qg, scaling, self.backend(qg.device))
        if self.layout.layer_idx == group.last_layer:
            group.release()
        return [state]

    def history_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.group.n_coded:
            return self.empty_history()
        k, v = self.group.layer(self.layout.layer_idx)  # what the rebuild path reads
        self.group.release()
        return k, v

    def resolved_params(self) -> dict:
        alloc = self.group.alloc
        return {"ratio": ratio_key(self.config.ratio), "coded_tokens": self.group.n_coded,
                "coded_components": {kind: alloc[kind].coded_extent for kind in KINDS}}
