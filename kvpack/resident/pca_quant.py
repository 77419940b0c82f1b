"""``pca_quant``: each KV head's keys and values quantized in their own principal-component basis, with a bit
width per component water-filled under the exact byte budget (beyond the papers).

The idea is kvtc's transform coding (a decorrelating rotation, then bits where the variance is), made
resident: the cache stays in this form while the model attends over it. Per layer:

* **Basis.** When the first block is compressed (at the end of the prefill), each (KV head, side) fits a
  basis to the tokens it holds: the mean ``μ [d]`` and the eigenvectors of the centred covariance,
  ordered by variance ``λ_j``. Keys are taken pre-RoPE (``key_rope``: rotated back with the model's own
  rotary table), so RoPE does not spread their energy over the components. Only the coded components'
  basis columns are kept, in fp16 (``[d, coded]``: the rounding is far below any code's step).
* **Bits.** A component coded at ``w`` bits by a block's min/max quantizer keeps a distortion
  ``λ_j D_j(w)``: its own min/max error at that width over the prompt's blocks (``distortion="measured"``)
  or a Gaussian model of it (``"gaussian"``, :func:`minmax_distortion`; ``D(1)`` is no better than
  dropping it, so a component is first bought at 2 bits). A key component's error is priced by the
  logit error it makes under the prompt's own queries (``key_metric="queries"``: ``λ_j u_jᵀ M u_j``, ``M``
  the second moment of the queries rotated to the keys' positions), a value component's by its variance.
  Widths are bought across every (head, side, component) of the layer in decreasing gain per bit,
  ``c_j / E (D(w) - D(w'))`` with ``c_j`` the component's price and ``E`` its side's total
  (``balance="side"``: the heads of a side compete on one scale, keys and values on their shares); a
  component's first purchase also pays its block scale and zero point and its basis column. Bits are
  bought until the bytes reach ``budget × dense bf16`` at the worst point of the coming block cycle (reverse
  water-filling, greedily). Components left at 0 bits are dropped (their mean remains).
* **Blocks.** Tokens stay dense in a sink (the first ``sinks``) and a tail (the most recent, at least
  ``residual`` plus this layer's stagger lag); whenever the tail holds ``block`` more, the oldest
  ``block`` are coded: coefficients per component over the block's tokens, asymmetric min/max with an
  fp16 scale and zero point (per channel, as KIVI quantizes keys; in this basis values are per channel
  too), codes bit-packed per width in :class:`~kvpack.attention.pca_blocks.PCABlocks`' layout. Tokens
  generated later are coded in the prompt's basis at the prompt's widths. With ``stagger`` the layers'
  lags differ, so their blocks are coded at different decode steps.
* **Attention**: ``kvpack::pca_quant_attention`` over the blocks (native CPU kernel: keys rebuilt from the
  codes, values accumulated in the basis; reference: blocks decoded a tile at a time), its state merged
  with the sink's, the tail's and the chunk's; the dense history never exists as a whole.

Bytes (``nbytes()``: the tensors held): the sink and tail in ``storage_dtype``; per (head, side) the mean
``4 d``, the widths ``d`` and ``2 d`` per coded component (its basis column); per block and (head, side)
``block · Σ_j w_j / 8`` bytes of codes and ``4`` bytes per coded component (scale and zero point); with
``salient``, per KV head ``n`` exact tokens (key and value in ``storage_dtype``, an int32 position) beside the
blocks, which hold ghosts in their place (:mod:`~kvpack.resident.salient`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention.cpu import use_native
from ..attention.pca_blocks import (
    PCABlocks,
    component_columns,
    pca_blocks_partial,
    pca_blocks_partials,
    width_groups,
)
from ..attention.triton import KERNEL_CHOICES, use_triton
from ..attention.triton.pca_quant_op import pca_quant_triton_partial
from ..config import MethodConfig, boolean, choice, integer, number, option, text
from ..ops.accounting import dense_bf16_bytes
from ..ops.bitpack import pack_bitstream_fast
from ..ops.rope import apply_rope, invert_rope, unrope_at
from ..registry import register_method
from .base import LayerLayout
from .layer_budgets import STEP, LayerBudgets, LayerProfile
from .quant import fp16_scale, fp16_zero_point, quantize_minmax
from .salient import (
    corrected_partials,
    ghost_codes,
    ghost_coefficients,
    ghost_tokens,
    salient_bytes,
    select_salient,
)
from .segmented import SegmentedStore, stagger_lag

PARAM_BYTES = 4  # fp16 scale and zero point of one coded component in one block
# the measured distortion's blocks at most (evenly spaced over the prompt's): the error of a width is a mean
# over blocks, and 32 blocks (2,048 coefficients a component at blocks of 64) settle it; all 127 of an 8K
# prompt took 36 of a layer's 85 ms of compression
MEASURED_BLOCKS = 32


@dataclass(frozen=True)
class PCAQuantConfig(MethodConfig):
    """Attributes:
        budget: target fraction of the dense bf16 bytes (default 0.28).
        sinks: leading tokens kept dense (attention sinks).
        residual: recent tokens kept dense at least (the tail holds up to ``residual + block - 1``).
        block: tokens coded together (one scale and zero point per component per block); a multiple of 8.
        max_bits: the widest code of a component.
        key_rope: ``auto`` (pre-RoPE keys where the layer has RoPE), ``pre`` or ``post``.
        distortion: what a width's purchase is worth to the water-filling: ``measured`` (each component's
            own min/max error at each width over the prompt's blocks: heavy-tailed components, whose ranges
            waste levels, buy fewer bits) or ``gaussian`` (:func:`minmax_distortion`, the same for every
            component).
        key_metric: what an error in a key component costs the water-filling: ``queries`` (the squared logit
            error it makes, averaged over the prompt's own (query, key) pairs; see
            :meth:`PCAQuantStore._add_query_moment`) or ``variance`` (its variance, as for values). Without
            queries (a store fed keys and values only) keys are priced by variance.
        balance: ``side`` (every head of a side competes on its share of the side's total error: a head
            whose keys vary 5x more gets more bits) or ``head`` (each (head, side) on its share of its own
            error; the first default: heads of very different scales got equal shares).
        stagger: each layer keeps ``lag`` more recent tokens dense (``lag`` in ``[0, block)``, spread over
            the layers by the golden ratio), so the layers code their blocks at different decode steps:
            one step codes a block in one or two layers rather than in all of them (a decode step that
            coded every layer's block took 2x the median).
        calibration: a directory holding a :class:`~kvpack.resident.layer_budgets.LayerProfile` of the model
            (``kvpack calibrate --method pca_quant``): each layer gets the budget
            :meth:`~kvpack.resident.layer_budgets.LayerProfile.allocate` gives it (their mean is at most
            ``budget``), instead of every layer ``budget``. A profile of another model is refused.
        salient: the share of the prompt's coded tokens (per KV head) kept exact beside the codes: those the
            prompt's last ``window`` queries attend to most (:mod:`~kvpack.resident.salient`; when the question
            ends the prompt, the tokens it reads). Their bytes come out of the budget. 0: none (the default).
            Tokens coded after the prompt's blocks (generated ones) are never salient.
        window: the observation window: the prompt's last queries (of the chunks up to the first coding)
            whose attention ranks the salient tokens.
        salient_pooling: odd max-pool window of that ranking over positions (a needle spans several tokens).
        tile_blocks: blocks decoded per attention tile (the PyTorch path).
        attention_backend: ``auto`` (Triton for CUDA tensors where Triton is installed, the native CPU
            kernel for CPU tensors where it is built, else PyTorch), ``triton`` (on CPU tensors only under
            ``TRITON_INTERPRET=1``), ``native`` or ``torch`` (the reference path).
    """

    budget: float | None = option(0.28, number(0.0, 1.0, low_open=True), "target fraction of the dense bf16 KV bytes")
    sinks: int = option(4, integer(minimum=0), "leading tokens kept dense")
    residual: int = option(0, integer(minimum=0), "recent tokens kept dense at least")
    block: int = option(64, integer(minimum=8), "tokens coded together (a multiple of 8)")
    max_bits: int = option(8, integer(minimum=2, maximum=8), "widest code of a component")
    key_rope: str = option("auto", choice("auto", "pre", "post"), "basis of keys before or after RoPE")
    distortion: str = option("measured", choice("measured", "gaussian"),
                             "the water-filling's error per width: measured on the prompt or a Gaussian model")
    key_metric: str = option("queries", choice("queries", "variance"),
                             "a key component's error priced by the logit error it makes under the prompt's "
                             "queries, or by its variance")
    balance: str = option("side", choice("side", "head"),
                          "a purchase's gain as a share of its side's error (every head of the layer) or of its head's")
    stagger: bool = option(True, boolean(), "spread the layers' block boundaries over the decode steps")
    calibration: str | None = option(None, text(optional=True),
                                     "a layer profile directory (kvpack calibrate --method pca_quant): the budget "
                                     "spread over the layers where it lowers the KL most; none: every layer alike")
    salient: float = option(0.0, number(0.0, 0.5),
                            "share of the prompt's coded tokens kept exact, those its last queries attend to most")
    window: int = option(32, integer(minimum=1), "the prompt's last queries whose attention ranks salient tokens")
    salient_pooling: int = option(7, integer(minimum=1, odd=True), "max-pool window of the salient ranking")
    tile_blocks: int = option(64, integer(minimum=1), "blocks decoded per attention tile (the PyTorch path)")
    attention_backend: str = option("auto", choice(*KERNEL_CHOICES), "attention path for stored tokens")

    def check(self) -> None:
        if self.block % 8:
            raise self.error(f"block must be a multiple of 8 (whole bytes of codes at any width), got {self.block}")


def minmax_distortion(width: int, block: int) -> float:
    """Mean squared error of a unit-variance Gaussian coefficient coded at ``width`` bits by the block's
    min/max quantizer, relative to dropping it (1.0 = no better than its mean).

    The range of ``block`` Gaussian samples is about ``2 sqrt(2 ln block)`` (5.8 at 64, 6.2 at 128); a
    uniform step over it errs by ``step² / 12``. At one bit that is worse than dropping the component
    (the two levels sit at the extremes), which is why a component's first purchase is two bits.
    """
    if width == 0:
        return 1.0
    step = 2.0 * math.sqrt(2.0 * math.log(block)) / (2 ** width - 1)
    return min(1.0, step * step / 12.0)


def water_fill_order(variances: torch.Tensor, max_bits: int, block: int, first_cost: float,
                     distortion: torch.Tensor | None = None, per_side: bool = False) -> torch.Tensor:
    """The order in which bits are bought: ``[K, 4]`` int64 rows ``(head, side, component, new width)``, best
    gain per bit first.

    Args:
        variances: ``[H, 2, d]`` what each component's error costs (keys then values): its variance, or
            for keys a price in logit error (``key_metric="queries"``).
        max_bits: the widest code (at least 2).
        block: tokens per block (the quantizer's range, :func:`minmax_distortion`).
        first_cost: the extra cost, in bits per token, of coding a component at all (its block scale and
            zero point, its basis column), added to its first purchase.
        distortion: the relative error left at each width, ``[max_bits + 1]`` for every component (default:
            :func:`minmax_distortion`) or ``[H, 2, d, max_bits + 1]`` per component.
        per_side: the gain of a purchase is the share of its side's total (every head's) it removes, so the
            heads of a side compete on one scale and the two sides on their shares; else the share of its
            (head, side)'s total, so every (head, side) competes on the share of its own energy.

    A component is bought at 2 bits first, then one bit at a time; the gain of a purchase is the share of
    the total it removes (``per_side``; :func:`minmax_distortion`). Components of zero variance are never
    coded.

    This is greedy water-filling (a heap that offers a component's next purchase once its previous one is
    bought), computed as one sort: each purchase keyed by its gain per bit, lowered to the smallest key of
    the component's earlier purchases (where a first purchase, which also pays ``first_cost``, gains less
    per bit than the next one, the heap buys the next one right after it, as the lowered key does); ties
    fall in (head, side, component, width) order, as the heap's tuples do.
    """
    total = variances.double().sum(dim=(0, 2) if per_side else -1, keepdim=True)
    share = variances.double() / total.clamp_min(1e-30)
    if distortion is None:
        distortion = torch.tensor([minmax_distortion(w, block) for w in range(max_bits + 1)], dtype=torch.float64)
    dist = distortion.double().expand(*share.shape, max_bits + 1)  # [H, 2, d, widths 0..max_bits]
    new = torch.arange(2, max_bits + 1)  # the purchases of one component: 0 -> 2, 2 -> 3, ..., -> max_bits
    prev = torch.cat([new.new_zeros(1), new[:-1]])
    cost = (new - prev).double() + first_cost * (prev == 0).double()
    gain = share[..., None] * ((dist[..., prev] - dist[..., new]) / cost)  # [H, 2, d, purchases]
    key = torch.cummin(gain, dim=-1).values
    H, S, d = share.shape
    index = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(S), torch.arange(d), new, indexing="ij"), dim=-1)
    coded = (share > 0)[..., None].expand_as(key)
    key, index = key[coded], index[coded]  # [K], [K, 4] in (head, side, component, width) order
    return index[torch.sort(key, descending=True, stable=True).indices]


@register_method("pca_quant")
class PCAQuantStore(SegmentedStore):
    """[dense sink] [coded blocks] [dense tail]; the coded blocks as :class:`~kvpack.attention.pca_blocks.PCABlocks`
    lays them out: ``codes [blocks, R]`` uint8, ``scale``/``zero [blocks, C]`` fp16, ``basis [C, d]`` fp16,
    ``mean [2, H, d]`` fp32, ``widths [2, H, d]`` uint8 (``C`` coded components over every (side, head))."""

    Config = PCAQuantConfig

    @classmethod
    def new_group(cls, layouts: list[LayerLayout], config: PCAQuantConfig) -> LayerBudgets | None:
        """The sequence's per-layer budgets from the config's layer profile; None without one."""
        if config.calibration is None:
            return None
        return LayerBudgets(LayerProfile.load(config.calibration), config.budget, [lay.layer_idx for lay in layouts])

    @classmethod
    def check_model(cls, config: PCAQuantConfig, fingerprint) -> None:
        if config.calibration is not None:
            LayerProfile.load(config.calibration).check_fingerprint(fingerprint())

    def __init__(self, layout: LayerLayout, config: PCAQuantConfig, group: LayerBudgets | None = None):
        super().__init__(layout, config)
        # this layer's share of the bytes: the config's budget, or (set when it first codes) its layer
        # profile's allocation
        self.group = group
        self.budget = config.budget
        self.pre_rope = layout.rope is not None and config.key_rope in ("auto", "pre")
        if config.key_rope == "pre" and layout.rope is None:
            raise ValueError("pca_quant: key_rope='pre' needs a layer with RoPE")
        self.basis: torch.Tensor | None = None  # [C, d] fp16, a row per coded component
        self.mean: torch.Tensor | None = None  # [2, H, d] fp32
        self.widths: torch.Tensor | None = None  # [2, H, d] uint8, non-increasing per (side, head)
        self.groups: list[list[tuple[int, int]]] = []  # per (side, head): (width, count) runs, widest first
        self.codes: torch.Tensor | None = None  # [blocks, R] uint8
        self.scale: torch.Tensor | None = None  # [blocks, C] fp16
        self.zero: torch.Tensor | None = None
        self.history_start = 0  # position of the first coded token
        # recent tokens the tail keeps before a block is coded: the residual, plus this layer's stagger
        lag = stagger_lag(layout.layer_idx, config.block) if config.stagger else 0
        self.kept_recent = config.residual + lag
        # key_metric="queries": the running sum of the prompt's query second moments per KV head,
        # each query un-rotated to sampled key positions (see on_append), and how many rows it holds
        self.query_moment: torch.Tensor | None = None  # [H, d, d] fp32
        self.query_rows = 0
        # salient > 0: the prompt's last queries until the first coding ([q_heads, <= window, d]), then each KV
        # head's salient tokens: positions [H, n] int32, exact keys (post-RoPE) and values [H, n, d]
        self.q_window: torch.Tensor | None = None
        self.n_salient = 0
        self.salient_pos: torch.Tensor | None = None
        self.salient_k: torch.Tensor | None = None
        self.salient_v: torch.Tensor | None = None

    @property
    def n_blocks(self) -> int:
        return 0 if self.codes is None else self.codes.shape[0]

    # -- layout -------------------------------------------------------------------------------

    @property
    def sink_capacity(self) -> int:
        return self.config.sinks

    def resolved_params(self) -> dict:
        if self.widths is None:
            return {}
        w = self.widths.float()
        return {"mean_bits_keys": round(float(w[0].mean()), 3), "mean_bits_values": round(float(w[1].mean()), 3),
                "coded_components": int((self.widths > 0).sum())}

    def history_tensors(self) -> dict[str, torch.Tensor]:
        if self.codes is None:
            return {}
        salient = ({"salient_pos": self.salient_pos, "salient_k": self.salient_k, "salient_v": self.salient_v}
                   if self.n_salient else {})
        return {"mean": self.mean, "widths": self.widths, "basis": self.basis, "codes": self.codes,
                "scale": self.scale, "zero": self.zero, **salient}

    def blocks_view(self) -> PCABlocks:
        return PCABlocks(self.codes, self.scale, self.zero, self.basis, self.mean, self.widths, self.config.block,
                         self.layout.rope if self.pre_rope else None, self.history_start, self.config.tile_blocks)

    # -- bytes and widths ---------------------------------------------------------------------

    def _bytes(self, seq: int, bits: torch.Tensor) -> int:
        """Bytes held at ``seq`` tokens with widths ``bits [2, H, d]`` (the block policy of :meth:`compress`)."""
        return self._bytes_at(seq, int(bits.sum()), int((bits > 0).sum()))

    def _bytes_at(self, seq: int, total_bits, coded, kept_recent: int | None = None):
        """:meth:`_bytes` from the widths' sum ``total_bits`` and the coded count ``coded``: ints, or int tensors
        of candidates (the bytes of every prefix of the water-filling at once); ``kept_recent``: another
        layer's (default this one's)."""
        H, d = self.layout.kv_heads, self.layout.head_dim
        cfg, elem = self.config, self.storage_dtype.itemsize
        sink = min(cfg.sinks, seq)
        kept = self.kept_recent if kept_recent is None else kept_recent
        blocks = max(0, (seq - sink - kept) // cfg.block)
        dense = (seq - blocks * cfg.block) * 2 * H * d * elem
        if not blocks:  # nothing coded yet: no means, bases or codes held
            return dense + 0 * coded
        fixed = 2 * H * (4 * d + d) + 2 * d * coded  # means, widths; fp16 basis columns of coded components
        fixed += salient_bytes(self.n_salient, H, d, elem)
        per_block = total_bits * cfg.block // 8 + PARAM_BYTES * coded
        return dense + fixed + blocks * per_block

    def _solve_widths(self, variances: torch.Tensor, measured: torch.Tensor | None = None) -> torch.Tensor:
        """Widths ``[2, H, d]`` uint8 for component costs ``[2, H, d]`` (variances, or prices; see
        :meth:`_fit`): the most bits of
        :func:`water_fill_order` whose bytes (:meth:`_bytes`) stay within the budget over the coming block
        cycle."""
        cfg = self.config
        H, d = self.layout.kv_heads, self.layout.head_dim
        seq = self.seq_len
        if self.group is not None:
            self.budget = self.group.budget_for(self.layout.layer_idx, lambda: self._floor(seq))
        # A coded component's scale and zero point per block, and its fp16 basis column once (over the
        # tokens coded now), in bits per token.
        first_cost = 8.0 * PARAM_BYTES / cfg.block + 16.0 * d / max(1, seq)
        order = water_fill_order(variances.permute(1, 0, 2), cfg.max_bits, cfg.block, first_cost, measured,
                                 per_side=cfg.balance == "side")
        # The bytes after the first k purchases, k = 0..K, at every length of the cycle (_bytes_at, for all k
        # at once: the bytes depend on the widths only through their sum and the coded count).
        first = order[:, 3] == 2
        bits = torch.cat([order.new_zeros(1), torch.cumsum(torch.where(first, 2, 1), 0)])  # [K + 1]
        coded = torch.cat([order.new_zeros(1), torch.cumsum(first.long(), 0)])
        fits = torch.ones(len(bits), dtype=torch.bool)
        worst = 0.0  # the most any length needs with no code at all, for the refusal
        for s in range(seq, seq + cfg.block):
            need = self._bytes_at(s, bits, coded)
            limit = self.budget * dense_bf16_bytes(s, H, d)
            fits &= need <= limit
            worst = max(worst, float(need[0]) / dense_bf16_bytes(s, H, d))
        if not fits[0]:
            salient = ", the salient tokens" if self.n_salient else ""
            raise ValueError(f"pca_quant: budget {self.budget:g} (layer {self.layout.layer_idx}) cannot be reached "
                             f"at {seq} tokens: the dense sink and tail{salient}, the bases and no code at all need "
                             f"{worst:.3f} of the dense bytes")
        k = int(fits.nonzero().max())  # bytes grow with every purchase: the fitting ones are a prefix
        widths = torch.zeros(2 * H * d, dtype=torch.int64)
        h, side, j, w = order[:k].unbind(1)
        widths.scatter_reduce_(0, (side * H + h) * d + j, w, "amax")
        return widths.reshape(2, H, d).to(torch.uint8)

    def _floor(self, seq: int) -> float:
        """The least budget any layer can keep over the block cycle after coding at ``seq`` tokens: its dense
        sink and tail (the longest lag of any layer), means and widths, no code at all; one allocation step
        above it."""
        cfg, H, d = self.config, self.layout.kv_heads, self.layout.head_dim
        lag = cfg.residual + (cfg.block - 1 if cfg.stagger else 0)
        # the most salient tokens any layer keeps (the least lag codes the most tokens), beyond this one's
        extra = salient_bytes(self._salient_count(seq - min(cfg.sinks, seq)) - self.n_salient, H, d,
                              self.storage_dtype.itemsize)
        need = max((self._bytes_at(s, 0, 0, kept_recent=lag) + extra) / dense_bf16_bytes(s, H, d)
                   for s in range(seq, seq + cfg.block))
        return need + STEP

    def _salient_count(self, coded_tokens: int) -> int:
        """Salient tokens per KV head when the first coding codes ``coded_tokens`` prompt tokens."""
        return min(coded_tokens, math.ceil(self.config.salient * coded_tokens))

    # -- coding ---------------------------------------------------------------------------------

    def on_append(self, q: torch.Tensor | None, out: torch.Tensor | None, n_new: int) -> None:
        if self.basis is not None or q is None:
            return
        if self.config.key_metric == "queries":
            self._add_query_moment(q, self.seq_len - n_new)
        if self.config.salient > 0:  # the observation window: the last queries before the first coding
            window = q if self.q_window is None else torch.cat([self.q_window, q.to(self.q_window.dtype)], dim=1)
            self.q_window = window[:, -self.config.window:].clone()

    def _add_query_moment(self, q: torch.Tensor, first: int, rows: int = 256, keys: int = 16) -> None:
        """Add the prompt's queries ``q [q_heads, n, d]`` (post-RoPE, positions ``first ..``) to the key metric.

        A pre-RoPE key error ``δk`` at position ``t`` moves query ``i``'s logit by ``q_i · R_t δk =
        (R_t⁻¹ q_i) · δk``; so the expected squared logit error over the prompt's (query, key) pairs is
        ``δkᵀ M δk`` with ``M = E[(R_t⁻¹ q_i)(R_t⁻¹ q_i)ᵀ]``, the pairs' key positions ``t`` uniform over
        ``[0, p_i]`` (causal). Estimated from ``rows`` queries a KV head (evenly spaced over its group's
        rows) times ``keys`` evenly spaced key positions each (4,096 pairs for a 64 x 64 moment: a few
        percent of error in a component's price, far below the spread of the prices), accumulated in fp32.

        Summed over the prefill's chunks until the basis is fitted; later (decode) queries are not used."""
        H, G, d = self.layout.kv_heads, self.layout.group, self.layout.head_dim
        n = q.shape[1]
        qs = q.float().reshape(H, G * n, d)
        pick = torch.linspace(0, G * n - 1, min(rows, G * n), device=q.device).round().long()
        qi = qs[:, pick]  # [H, S, d]
        pos = (first + pick % n).float()  # [S]
        frac = (torch.arange(keys, device=q.device).float() + 0.5) / keys
        t = (pos[:, None] * frac).floor().long()  # [S, K] key positions in [0, p]
        z = qi[:, :, None, :].expand(H, len(pick), keys, d)
        if self.layout.rope is not None:
            cos, sin = self.layout.rope.cos_sin(t.reshape(-1).to(q.device))
            z = invert_rope(z.reshape(H, -1, d), cos, sin)
        z = z.reshape(H, -1, d)
        moment = z.transpose(1, 2) @ z  # [H, d, d]
        self.query_moment = moment if self.query_moment is None else self.query_moment + moment
        self.query_rows += z.shape[1]

    def _pre_rope(self, k: torch.Tensor, first: int) -> torch.Tensor:
        return unrope_at(self.layout.rope, k, first) if self.pre_rope else k

    def _measured_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens of ``x [2, H, n, d]`` the measured distortion reads: its whole blocks, at most
        :data:`MEASURED_BLOCKS` of them, evenly spaced (the table is a mean over blocks; a few dozen settle it):
        ``[2, H, blocks · block, d]``. Chosen before the projection onto the basis, which then projects 32
        blocks, not an 8K prompt's 127."""
        G = self.config.block
        nb = x.shape[2] // G
        if nb <= MEASURED_BLOCKS:
            return x[:, :, :nb * G]
        pick = torch.linspace(0, nb - 1, MEASURED_BLOCKS).round().long().to(x.device)
        blocks = x[:, :, :nb * G].reshape(*x.shape[:2], nb, G, x.shape[-1])[:, :, pick]
        return blocks.reshape(*x.shape[:2], MEASURED_BLOCKS * G, x.shape[-1])

    def _measured_distortion(self, c: torch.Tensor) -> torch.Tensor | None:
        """``[H, 2, d, max_bits + 1]``: the squared error of each component's min/max code at each width over
        the given whole blocks (:meth:`_measured_blocks` of the fitted tokens), relative to
        its variance over them (width 0: 1) — what the water-filling
        buys against with ``distortion="measured"``; None with no whole block. Width 1, which the
        water-filling never buys (a component's first purchase is 2 bits), is left at 1.

        The codes are :func:`~kvpack.resident.quant.quantize_minmax`'s (its fp16 zero point and scale,
        :func:`~kvpack.resident.quant.fp16_zero_point` / :func:`~kvpack.resident.quant.fp16_scale`), computed
        without it: the zero point and the offsets from it are the same at every width, so only the scale,
        the rounding and the error are recomputed per width, in one buffer (2.7x faster; the error differs
        from dequantizing the codes in the last bits of fp32).

        Args:
            c: ``[2, H, blocks · block, d]`` coefficients (centred) of whole blocks.
        """
        G, top = self.config.block, self.config.max_bits
        nb = c.shape[2] // G
        if not nb:
            return None
        blocks = c.reshape(c.shape[0], c.shape[1], nb, G, -1).float()  # [2, H, blocks, G, d]
        var = blocks.var(dim=(2, 3), correction=0).clamp_min(1e-30)
        lo, hi = torch.aminmax(blocks, dim=3, keepdim=True)
        zero = fp16_zero_point(lo)
        offset = blocks - zero.float()
        span = hi - zero.float()
        out = torch.ones(*var.shape, top + 1)
        err = torch.empty_like(blocks)
        for w in range(2, top + 1):
            levels = (1 << w) - 1
            scale = fp16_scale(span / levels).float()
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            torch.div(offset, safe, out=err).round_().clamp_(0, levels)
            err.mul_(scale).sub_(offset)  # the code's value minus the coefficient
            out[..., w] = (err.square_().mean(dim=(2, 3)) / var).clamp(max=1.0)
        return out.permute(1, 0, 2, 3)

    def _fit(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Bases, means and widths from the tail's tokens ``k`` (pre-RoPE where configured), ``v``
        ``[H, n, d]`` fp32."""
        x = torch.stack([k, v])  # [2, H, n, d]
        mean = x.mean(dim=2)
        xc = x - mean[:, :, None]
        # the covariance accumulated in fp32 (centred data: a relative error near 1e-6 at 8K tokens, far below
        # what moves a basis), decomposed in fp64
        cov = (xc.transpose(-1, -2) @ xc / x.shape[2]).double()
        lam, vec = torch.linalg.eigh(cov)  # ascending
        lam, vec = lam.flip(-1).clamp_min(0), vec.flip(-1)
        measured = (self._measured_distortion(self._measured_blocks(xc).float() @ vec.float())
                    if self.config.distortion == "measured" else None)
        # what each component's error costs: its variance, for keys under key_metric="queries" times the
        # squared logit change a unit error along it makes, u_jᵀ M u_j (M: the query moment)
        cost = lam
        if self.query_moment is not None:
            m = (self.query_moment / self.query_rows).double().to(vec.device)
            cost = lam.clone()
            cost[0] = lam[0] * torch.einsum("hdj,hde,hej->hj", vec[0], m, vec[0]).clamp_min(0)
            self.query_moment = None  # used once, at the fit
        widths = self._solve_widths(cost.float(), measured)
        # Components in decreasing width (stable: decreasing variance within a width), so each (side, head)'s
        # coded components lead and group by width — the layout the attention paths read (water-filling
        # gives a higher cost no fewer bits, but with key_metric="queries" the cost is not the variance).
        order = torch.sort(widths.to(torch.int64), dim=-1, descending=True, stable=True).indices
        self.widths = torch.gather(widths, -1, order).to(k.device)
        vec = torch.gather(vec, -1, order[:, :, None, :].expand_as(vec))
        self.mean = mean.float().to(k.device)
        self.groups = width_groups(self.widths)
        # Only the coded components' basis vectors are kept, fp16 rows [C, d]: near orthonormal (fp16
        # rounds each entry by at most 2^-11 relative, far below any code's step), so B is its own
        # inverse for coding (c = x Bᵀ) and decoding (x = c B).
        H = self.layout.kv_heads
        rows = [vec[side, h][:, :sum(n for _, n in self.groups[side * H + h])].T
                for side in range(2) for h in range(H)]
        self.basis = torch.cat(rows).to(torch.float16).to(k.device)

    def compress(self) -> None:
        cfg = self.config
        n_new = max(0, (self.tail_k.shape[1] - self.kept_recent) // cfg.block)
        if n_new == 0:
            return
        first = self.tail_start
        n = n_new * cfg.block
        tail_pre = self._pre_rope(self.tail_k.float(), first)  # [H, T, d], rotated back once
        salient = None  # [H, n] bool: the salient tokens among those coded now (the first coding only)
        if self.basis is None:
            self.history_start = first
            if cfg.salient > 0:
                salient = self._select_salient(first, n)
            self._fit(tail_pre, self.tail_v.float())
        _, v = self.pop_tail(n)
        x = torch.stack([tail_pre[:, :n], v.float()]) - self.mean[:, :, None]  # [2, H, n, d]
        H = self.layout.kv_heads
        runs, scales, zeros = [], [], []
        for i, (groups, cols) in enumerate(zip(self.groups, component_columns(self.groups))):
            side, h = divmod(i, H)
            coded = cols.stop - cols.start
            if not coded:  # a (side, head) the budget bought nothing for: its mean stands for it
                continue
            basis = self.basis[cols].float()  # [coded, d]
            c = (x[side, h] @ basis.T).reshape(n_new, cfg.block, coded)  # [blocks, block, coded]
            if salient is not None:  # their rows left out of the blocks' ranges (salient.py)
                c = ghost_coefficients(c, salient[h].reshape(n_new, cfg.block))
            bits = torch.tensor([w for w, count in groups for _ in range(count)], device=c.device)
            codes, scale, zero = quantize_minmax(c, dim=1, bits=bits)  # every width at once: bits per column
            if salient is not None:  # their codes: ghosts whose reconstruction the scale and zero point give
                at = salient[h].reshape(n_new, cfg.block)
                codes = torch.where(at[:, :, None], ghost_codes(scale, zero, bits), codes)
            codes = codes.transpose(1, 2)  # [blocks, coded, block]: component-major, the layout PCABlocks reads
            j = 0
            for width, count in groups:
                # each block's stream is whole bytes (block % 8 == 0)
                stream = pack_bitstream_fast(codes[:, j:j + count].contiguous(), width)
                runs.append(stream.reshape(n_new, -1))
                j += count
            scales.append(scale[:, 0])
            zeros.append(zero[:, 0])
        codes = torch.cat(runs, dim=1) if runs else x.new_empty(n_new, 0, dtype=torch.uint8)
        scale = torch.cat(scales, dim=1) if scales else x.new_empty(n_new, 0, dtype=torch.float16)
        zero = torch.cat(zeros, dim=1) if zeros else x.new_empty(n_new, 0, dtype=torch.float16)
        if self.codes is None:
            self.codes, self.scale, self.zero = codes, scale, zero
        else:
            self.codes = torch.cat([self.codes, codes])
            self.scale = torch.cat([self.scale, scale])
            self.zero = torch.cat([self.zero, zero])

    def _select_salient(self, first: int, n: int) -> torch.Tensor:
        """Choose and copy each KV head's salient tokens among the ``n`` tail tokens from position ``first`` (about
        to be coded); returns them as ``[H, n]`` bool over those tokens."""
        cfg, H = self.config, self.layout.kv_heads
        if self.q_window is None:
            raise ValueError("pca_quant: salient tokens need the prompt's queries (a store fed keys and values only)")
        self.n_salient = self._salient_count(n)
        keys = torch.cat([self.sink_k, self.tail_k], dim=1)  # every token so far, positions 0 .. seq_len - 1
        pos = select_salient(self.q_window, keys, self.scaling or self.layout.head_dim ** -0.5, first, first + n,
                             self.n_salient, cfg.salient_pooling)  # [H, count] ascending
        self.q_window = None
        rel = (pos - first)[..., None].expand(-1, -1, self.layout.head_dim)
        self.salient_k = torch.gather(self.tail_k, 1, rel).clone()
        self.salient_v = torch.gather(self.tail_v, 1, rel).clone()
        self.salient_pos = pos.to(torch.int32)
        mask = torch.zeros(H, n, dtype=torch.bool, device=pos.device)
        return mask.scatter_(1, pos - first, True)

    def _ghosts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The coded blocks' reconstruction of the salient tokens: keys (post-RoPE) and values ``[H, n, d]`` fp32
        (see :func:`~kvpack.resident.salient.ghost_tokens`)."""
        H = self.layout.kv_heads
        pos = self.salient_pos.long()
        blocks = (pos - self.history_start) // self.config.block  # [H, n]
        out = []
        for i, cols in enumerate(component_columns(self.groups)):
            side, h = divmod(i, H)
            widths = self.widths[side, h, :cols.stop - cols.start]
            out.append(ghost_tokens(self.scale[:, cols], self.zero[:, cols], widths, self.basis[cols],
                                    self.mean[side, h], blocks[h]))
        k, v = torch.stack(out[:H]), torch.stack(out[H:])
        if self.pre_rope:
            cos, sin = self.layout.rope.cos_sin(pos.reshape(-1))
            k = apply_rope(k, cos.reshape(*pos.shape, -1), sin.reshape(*pos.shape, -1))
        return k, v

    def decoded(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values of blocks ``[lo, hi)`` as ``[H, (hi - lo) · block, d]`` fp32, the salient
        tokens among them exact."""
        k, v = self.blocks_view().decoded(lo, hi)
        if self.n_salient:
            rel = self.salient_pos.long() - (self.history_start + lo * self.config.block)  # [H, n]
            inside = (rel >= 0) & (rel < k.shape[1])
            for h in range(self.layout.kv_heads):
                at = rel[h][inside[h]]
                k[h, at] = self.salient_k[h][inside[h]].float()
                v[h, at] = self.salient_v[h][inside[h]].float()
        return k, v

    # -- attention --------------------------------------------------------------------------------

    @property
    def attention_backend(self) -> str:
        return self.config.attention_backend

    def history_dense(self):
        if not self.n_blocks:
            return self.empty_history()
        return self.decoded(0, self.n_blocks)

    def history_partials(self, qg, scaling):
        if not self.n_blocks:
            return []
        backend = self.config.attention_backend
        if use_triton(backend, qg.device):
            coded = [pca_quant_triton_partial(self.blocks_view(), qg, scaling)]
        elif qg.dtype != torch.float64 and use_native(backend, qg.device):  # fp64: the reference
            coded = [pca_blocks_partial(self.blocks_view(), qg, scaling)]
        else:
            coded = pca_blocks_partials(self.blocks_view(), qg, scaling)
        if not self.n_salient:
            return coded
        ghost_k, ghost_v = self._ghosts()
        return corrected_partials(coded, qg, scaling, ghost_k, ghost_v, self.salient_k, self.salient_v)
