"""``pca_quant``'s store: the coded blocks of one layer, how it fits, codes and attends over them (the method:
:mod:`kvpack.resident.pca_quant`)."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...attention.pca_blocks import (
    PCABlocks,
    component_columns,
    pca_blocks_partial,
    pca_blocks_partials,
    width_groups,
)
from ...attention.pca_encode import encode_blocks_reference, pack_width_runs, pca_quant_encode
from ...attention.softmax_merge import dense_partial
from ...attention.triton.pca_quant_op import pca_quant_triton_partial
from ...ops.accounting import dense_bf16_bytes
from ...ops.minmax import quantize_minmax
from ...ops.rope import apply_rope, invert_rope, unrope_at
from ..base import LayerLayout
from ..segmented import SegmentedStore, stagger_lag
from .allocation import PARAM_BYTES, measured_blocks, measured_distortion, water_fill_order
from .config import PCAQuantConfig
from .layer_budgets import STEP, LayerBudgets, LayerProfile
from .salient import (
    corrected_partials,
    ghost_codes,
    ghost_coefficients,
    ghost_tokens,
    salient_bytes,
    select_salient,
)


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
        # where the keys' basis sits: "pre" (before RoPE), "block" (each key rotated back by its block's first
        # position: RoPE by its offset in the block kept) or "post" (as the model hands them over; also a layer
        # without RoPE)
        self.key_rope = ("pre" if layout.rope is not None else "post") if config.key_rope == "auto" else config.key_rope
        if self.key_rope in ("pre", "block") and layout.rope is None:
            raise ValueError(f"pca_quant: key_rope='{self.key_rope}' needs a layer with RoPE")
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
                         self.layout.rope if self.key_rope != "post" else None, self.history_start,
                         self.config.tile_blocks, rope_at_block=self.key_rope == "block")

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
        if self.key_rope == "block":  # a key is coded rotated back by its block's first position (sinks + j G)
            G, sinks = self.config.block, self.config.sinks
            t = torch.where(t < sinks, t, sinks + (t - sinks) // G * G)
        z = qi[:, :, None, :].expand(H, len(pick), keys, d)
        if self.key_rope != "post":
            cos, sin = self.layout.rope.cos_sin(t.reshape(-1).to(q.device))
            z = invert_rope(z.reshape(H, -1, d), cos, sin)
        z = z.reshape(H, -1, d)
        moment = z.transpose(1, 2) @ z  # [H, d, d]
        self.query_moment = moment if self.query_moment is None else self.query_moment + moment
        self.query_rows += z.shape[1]

    def _rotation_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """The positions coded keys at positions ``pos`` are rotated at: their own (``pre``) or their block's
        first (``block``; blocks from ``history_start``)."""
        if self.key_rope != "block":
            return pos
        G = self.config.block
        return self.history_start + torch.div(pos - self.history_start, G, rounding_mode="floor") * G

    def _pre_rope(self, k: torch.Tensor, first: int) -> torch.Tensor:
        """Post-RoPE keys ``k [H, T, d]`` at positions ``first ..`` rotated back to the basis' frame (the first
        coding has set ``history_start``; ``first`` is a block boundary)."""
        if self.key_rope == "post":
            return k
        if self.key_rope == "pre":
            return unrope_at(self.layout.rope, k, first)
        pos = self._rotation_positions(torch.arange(first, first + k.shape[1], device=k.device))
        cos, sin = self.layout.rope.cos_sin(pos)
        return invert_rope(k, cos, sin)

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
        measured = (measured_distortion(measured_blocks(xc, self.config.block).float() @ vec.float(),
                                        self.config.block, self.config.max_bits)
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
        salient = None  # [H, n] bool: the salient tokens among those coded now (the first coding only)
        if self.basis is None:  # first: block-relative keys count their blocks from here
            self.history_start = first
        tail_pre = self._pre_rope(self.tail_k.float(), first)  # [H, T, d], rotated back once
        if self.basis is None:
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
            bits = torch.tensor([w for w, count in groups for _ in range(count)], dtype=torch.int32)
            if salient is None:  # min/max codes packed into the width streams: one native pass, or PyTorch's
                encode = pca_quant_encode if self.backend(c.device) == "native" else encode_blocks_reference
                packed, scale, zero = encode(c.contiguous(), bits)
                runs.append(packed)
                scales.append(scale)
                zeros.append(zero)
                continue
            # salient tokens: their rows left out of the blocks' ranges, their codes ghosts (salient.py)
            c = ghost_coefficients(c, salient[h].reshape(n_new, cfg.block))
            bits = bits.to(device=c.device, dtype=torch.int64)
            codes, scale, zero = quantize_minmax(c, dim=1, bits=bits)  # every width at once: bits per column
            at = salient[h].reshape(n_new, cfg.block)
            codes = torch.where(at[:, :, None], ghost_codes(scale, zero, bits), codes)
            runs.append(pack_width_runs(codes.transpose(1, 2), groups))  # component-major, as PCABlocks reads
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
        (see :func:`~kvpack.resident.pca_quant.salient.ghost_tokens`)."""
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
        if self.key_rope != "post":
            cos, sin = self.layout.rope.cos_sin(self._rotation_positions(pos).reshape(-1))
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

    def history_dense(self):
        if not self.n_blocks:
            return self.empty_history()
        return self.decoded(0, self.n_blocks)

    def history_partials(self, qg, scaling):
        if not self.n_blocks:
            return []
        backend = self.backend(qg.device)
        if backend == "triton":  # the salient tokens' ghosts attended, then taken out (corrected_partials)
            coded = [pca_quant_triton_partial(self.blocks_view(), qg, scaling)]
            if not self.n_salient:
                return coded
            ghost_k, ghost_v = self._ghosts()
            return corrected_partials(coded, qg, scaling, ghost_k, ghost_v, self.salient_k, self.salient_v)
        # native and PyTorch paths: the salient tokens' ghosts left out of the coded blocks, their exact copies in
        blocks = self.blocks_view()
        if self.n_salient:
            blocks = dataclasses.replace(blocks, skip=self.salient_pos - self.history_start)
        if qg.dtype != torch.float64 and backend == "native":  # fp64: the reference
            coded = [pca_blocks_partial(blocks, qg, scaling)]
        else:
            coded = pca_blocks_partials(blocks, qg, scaling)
        if not self.n_salient:
            return coded
        return [*coded, dense_partial(qg, self.salient_k, self.salient_v, scaling)]
