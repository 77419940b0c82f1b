"""AnchorKV's store: exact anchors, per-token scaled anchor copies, budgeted 2-bit residuals (AnchorKV, §2–5, Alg. 1).

Once, at the end of prefill, per layer and KV head:

1. **Anchors** (``k`` positions): the last ``W`` positions, then ``round(ρ (k − W))`` positions with the
   highest SnapKV scores (attention of the ``W`` observation queries, group heads combined,
   average-pooled with kernel ``κ``), then uniformly random (seeded) positions from the rest.
2. **Assignment and projection**, separately for keys (pre-RoPE) and values, with shared anchor
   positions: every token goes to the anchor of largest ``|cos|`` (Eq. 1); ``γ = ⟨x, a⟩ / ‖a‖²``,
   ``x̃ = γ a``, ``r = x − x̃`` (Eq. 2); anchors are their own anchor with ``γ = 1``.
3. **Utilities** (Eq. 6), over the ``m = W · group`` observation queries of the token's KV head:
   ``u_K = mean_w α_t² (q_w · RoPE_t(r_K) · scaling)² ‖V_t − y_w‖²`` and ``u_V = mean_w α_t² ‖r_V‖²``,
   with ``α`` and ``y`` the exact attention weights and outputs. Anchors never compete.
4. **Byte budget** (Eq. 9): ``N = max(0, ⌊(θ M_full − M_base) / b_res⌋)``, ``N_K = ⌊N/2⌋``,
   ``N_V = N − N_K``, the top-utility residuals **pooled across all heads of the layer**.
5. **Residual codec**: randomized Hadamard rotation (seeded signs), per-token scale
   ``σ = ‖r‖ / √D`` (the RMS, which puts the rotated coordinates at unit variance), 4-level
   Lloyd–Max codes for N(0, 1), 2 bits per coordinate, bit-packed.

The package: ``config.py`` (parameters and ablation switches), ``budget.py`` (Eq. 9),
``selection.py`` (Eq. 1, 2, 6), this store (compression and re-compression). Attention
(``kvpack.attention.anchor``, over the :class:`AnchorSegment` views the store hands out)
reconstructs keys tile by tile, ``x̂ = γ a + r̃`` where a
residual is stored, rotates them by RoPE at their positions, takes each tile's weighted sum of
values on the stored form, and merges the tiles, the dense tail of generated tokens and the new
chunk by online softmax.

The ablation switches of the paper's Fig. 5 and three options beyond the paper are fields of
:class:`AnchorConfig` (``config.py``); ``anchor_plus`` is this codec with the three options on.

What the store holds (and ``M_base`` counts): anchor keys (pre-RoPE) and values ``[H, k, D]`` (bf16),
per-token anchor indices ``[H, S]`` (int16; uint8 with ``narrow_index`` and ``k ≤ 256``) and
coefficients ``[H, S]`` (fp16) for each side,
residual bitmasks ``[H, ⌈S/8⌉]`` (packed bits) and per-32-token prefix counts ``[H, ⌈S/32⌉]``
(int32) for each side — the decoder finds a token's residual slot from them in O(1). Each stored
residual costs ``b_res = D/4`` code bytes + a 4-byte scale.

Beyond the paper, ``above_saturation = "residual4"`` spends a budget past the 2-bit saturation point
on a fine tier: the top-ranked token-sides (same ranking, same pooled K/V split as step 4) get a
4-bit residual (``D/2`` code bytes + a 4-byte scale; same rotation and scale rule, the 16-level
Gaussian Lloyd–Max codebook) instead of their 2-bit one, held as a second bitmask, prefix counts,
codes and scales per side (``fine_*``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention.anchor import (
    PREFIX_BLOCK,
    AnchorSegment,
    AnchorSide,
    FineResiduals,
    anchor_tile_partials,
    reconstruct_tile,
)
from ...attention.scores import observation_probabilities, observation_votes
from ...attention.softmax_merge import ungroup_output
from ...attention.triton.anchor_op import anchor_partials
from ...ops.accounting import dense_bf16_bytes
from ...ops.bitpack import pack_bits
from ...ops.residual_codec import BITS, FINE_BITS, make_residual_codec
from ...ops.rope import apply_rope, invert_rope
from ..base import LayerLayout, LayerStore
from .budget import (
    anchors_above_saturation,
    anchors_for_budget,
    base_bytes,
    fine_residual_slots,
    index_bytes_for,
    residual_bytes,
    residual_slots,
)
from .config import AnchorConfig, AnchorPlusConfig
from .selection import (
    assign_and_project,
    observation_weights,
    pool_neighbourhood,
    project_onto_anchors,
    select_anchors,
    top_per_head,
    top_pooled,
    utilities,
)


def _slot_prefix(chosen: torch.Tensor) -> torch.Tensor:
    """Per-32-token prefix counts ``[H, ⌈n/32⌉]`` int32 of a residual mask ``chosen [H, n]``: the
    slot of a head's first residual in block b is the number of residuals of earlier heads and blocks
    (slots are head-major)."""
    H, n = chosen.shape
    counts = F.pad(chosen, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).sum(-1).flatten()
    return (counts.cumsum(0) - counts).reshape(H, -1).to(torch.int32)


class AnchorStore(LayerStore):
    """One sequence, one layer: anchors, compressed segments (the prompt, then any re-compressed
    stretch of generated tokens) and the dense tail of generated tokens.

    Tensors: ``anchor_k``/``anchor_v`` ``[H, k, D]``; per segment ``i`` (``seg{i}_*``): ``index_*``
    ``[H, n]`` int16, ``coef_*`` ``[H, n]`` fp16, ``mask_*`` packed bits, ``prefix_*`` ``[H, ⌈n/32⌉]``
    int32, ``res_*`` ``[slots, D/4]`` uint8, ``scale_*`` ``[slots]`` fp32; ``tail_k``/``tail_v``; with
    ``recompress_every``, the observation buffer ``obs_q``/``obs_y`` ``[Hq, ≤W, D]``, ``obs_lse``
    ``[Hq, ≤W]`` fp32 and ``obs_pos`` ``[≤W]`` int32 (the last decode queries, their outputs and
    softmax normalisers, which score a re-compressed segment's residuals). A segment with a fine tier
    also holds ``fine_mask_*``, ``fine_prefix_*``, ``fine_res_*`` ``[slots, D/2]`` and ``fine_scale_*``.
    """

    Config = AnchorConfig

    def __init__(self, layout: LayerLayout, config: AnchorConfig):
        super().__init__(layout, config)
        if layout.head_dim & (layout.head_dim - 1):
            raise ValueError(f"anchor: the Hadamard residual codec needs a power-of-two head_dim, "
                             f"got {layout.head_dim}")
        if layout.rope is None:
            raise ValueError("anchor: AnchorKV works on pre-RoPE keys and needs the model's rotary embedding")
        d = layout.head_dim
        seed = config.seed * 1_000_003 + layout.layer_idx
        self.residual_codec = make_residual_codec(config.residual_codec, d, seed=seed)
        # The fine tier's codec: the same rotation (same seed), 4-bit codes.
        self.fine_codec = (make_residual_codec(config.residual_codec, d, seed=seed, bits=FINE_BITS)
                           if config.above_saturation == "residual4" else None)
        empty = torch.empty(layout.kv_heads, 0, d, dtype=self.storage_dtype)
        self.tail_k, self.tail_v = empty, empty.clone()
        self.anchors: dict[str, torch.Tensor] = {}
        self.segments: list[dict[str, torch.Tensor]] = []
        self.segment_spans: list[tuple[int, int]] = []  # (start position, tokens)
        self.obs: dict[str, torch.Tensor] = {}
        self.n_prompt = 0
        self.n_anchors: int | None = None
        self.index_bytes = 2
        self.n_residuals = (0, 0)  # 2-bit residuals (keys, values)
        self.n_fine = (0, 0)  # 4-bit residuals of the fine tier
        self._last_lse: torch.Tensor | None = None

    def tensors(self):
        out = dict(self.anchors)
        for i, seg in enumerate(self.segments):
            out.update({f"seg{i}_{name}": t for name, t in seg.items()})
        return {**out, **self.obs, "tail_k": self.tail_k, "tail_v": self.tail_v}

    @property
    def budget_covers_decode(self) -> bool:
        return self.config.recompress_every is not None  # generated tokens stay dense, as in the paper

    def resolved_params(self):
        if self.n_anchors is None:
            return {}
        params = {"anchors": self.n_anchors, "residuals_k": self.n_residuals[0], "residuals_v": self.n_residuals[1],
                  "segments": len(self.segments)}
        if self.fine_codec is not None:
            params.update(fine_residuals_k=self.n_fine[0], fine_residuals_v=self.n_fine[1])
        return params

    @property
    def n_compressed(self) -> int:
        return sum(n for _, n in self.segment_spans)

    # -- compression ------------------------------------------------------------------------

    def _ranking_scores(self, sides, k_pre, k_post, v, cos, sin, q_obs, y_obs, obs_pos, scaling,
                        key_positions=None, lse=None, alpha=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``[H, n]`` per side by which residual candidates are ranked (``config.ranking``).

        ``sides`` = ((index, gamma, residual) for keys, same for values); ``k_pre``/``k_post`` the
        keys before/after RoPE, ``v`` the values ``[H, n, D]``; the observation arguments as
        :func:`utilities`; ``alpha`` their attention weights ``[H, m, n]`` where the caller has them.
        """
        ranking = self.config.ranking
        r_k, r_v = sides[0][2], sides[1][2]
        if ranking == "residual_norm":
            return r_k.square().sum(-1), r_v.square().sum(-1)
        if ranking == "cosine":  # worst-aligned first: 1 − cos² = ‖r‖² / ‖x‖² for the projection γ a
            return tuple(r.square().sum(-1) / x.square().sum(-1).clamp_min(1e-30) for r, x in ((r_k, k_pre), (r_v, v)))
        if ranking == "random":
            gen = torch.Generator().manual_seed(self.config.seed * 104_729 + self.layout.layer_idx * 1_009
                                                + len(self.segments))
            return tuple(torch.rand(r_k.shape[:2], generator=gen).to(r_k.device) for _ in range(2))
        if alpha is None:
            alpha = observation_weights(q_obs, k_post, scaling, obs_pos, key_positions, lse)
        if ranking == "attention":
            usage = alpha.mean(dim=1)
            return usage, usage.clone()
        return utilities(q_obs, y_obs, k_post, v, apply_rope(r_k, cos, sin), r_v, scaling, obs_pos, alpha=alpha)

    def _segment(self, sides, u_k, u_v, n_res, n_fine=0) -> dict[str, torch.Tensor]:
        """Store one segment: ``sides`` = ((index, gamma, residual) for keys, same for values);
        ``u_k``/``u_v`` ``[H, n]`` rank the residual candidates (``-inf``: never a residual);
        ``n_res`` residuals, of which the ``n_fine`` top-ranked are 4-bit (the fine tier)."""
        cfg = self.config
        n_k = n_res // 2
        choose = top_pooled if cfg.residual_split == "pooled" else top_per_head
        ranks = (pool_neighbourhood(u_k, cfg.residual_pooling), pool_neighbourhood(u_v, cfg.residual_pooling))
        masks = (choose(ranks[0], n_k), choose(ranks[1], n_res - n_k))
        fine = None
        if n_fine:  # the same ranking and K/V split among the token-sides that have a residual
            f_k = n_fine // 2
            fine = tuple(choose(rank.masked_fill(~mask, float("-inf")), count)
                         for rank, mask, count in zip(ranks, masks, (f_k, n_fine - f_k)))
            masks = tuple(mask & ~f for mask, f in zip(masks, fine))
        index_dtype = torch.uint8 if self.index_bytes == 1 else torch.int16
        seg = {}
        for i, (name, (idx, gamma, r), mask) in enumerate(zip(("k", "v"), sides, masks)):
            seg[f"index_{name}"] = idx.to(index_dtype)
            seg[f"coef_{name}"] = gamma.to(torch.float16)
            tiers = [("", mask, self.residual_codec)]
            if fine is not None:
                tiers.append(("fine_", fine[i], self.fine_codec))
            for prefix, chosen, codec in tiers:
                seg[f"{prefix}mask_{name}"] = pack_bits(chosen.to(torch.uint8), 1)
                seg[f"{prefix}prefix_{name}"] = _slot_prefix(chosen)
                seg[f"{prefix}res_{name}"], seg[f"{prefix}scale_{name}"] = codec.encode(r[chosen])  # head-major
        self.n_residuals = (self.n_residuals[0] + int(masks[0].sum()), self.n_residuals[1] + int(masks[1].sum()))
        if fine is not None:
            self.n_fine = (self.n_fine[0] + int(fine[0].sum()), self.n_fine[1] + int(fine[1].sum()))
        return seg

    def compress_prompt(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                        scaling: float) -> None:
        """Algorithm 1 on the prompt ``k, v [H, S, D]``.

        ``q`` and ``out`` are the prompt's queries and exact attention outputs ``[Hq, n, D]``; only
        the last ``W`` rows (the observation window) are read, so ``n`` may be ``S`` or ``W``.
        """
        cfg, lay = self.config, self.layout
        H, S, D = k.shape
        W = cfg.window
        if W >= S:
            raise ValueError(f"anchor: window W = {W} must be shorter than the prompt ({S} tokens)")
        itemsize = self.storage_dtype.itemsize
        n_fine = 0
        if cfg.residuals:
            n_anchors = cfg.anchors if cfg.anchors is not None else max(math.floor(S * cfg.anchor_fraction), W)
            if n_anchors > S:
                raise ValueError(f"anchor: k = {n_anchors} anchors exceed the prompt's {S} tokens")
            if cfg.above_saturation != "idle" and cfg.anchors is None:  # beyond the paper: more anchors
                # past the saturation point of the residuals the mode buys (every token-side 2-bit, or 4-bit)
                bits = FINE_BITS if self.fine_codec is not None else BITS
                n_anchors = anchors_above_saturation(cfg.budget, S, H, D, n_anchors, itemsize, cfg.narrow_index, bits)
            self.index_bytes = index_bytes_for(n_anchors, cfg.narrow_index)
            n_res = residual_slots(cfg.budget, S, H, D, n_anchors, itemsize, self.index_bytes)
            if self.fine_codec is not None:
                n_fine = fine_residual_slots(cfg.budget, S, H, D, n_anchors, itemsize, self.index_bytes)
        else:  # ablation: the whole budget on anchors
            n_anchors, self.index_bytes = anchors_for_budget(cfg.budget, S, H, D, W, itemsize, cfg.narrow_index)
            n_res = 0
        if q.shape[1] < W or out.shape[1] < W:
            raise ValueError(f"anchor: compression needs the last W = {W} queries and outputs")
        k, v, q, out = k.float(), v.float(), q[:, -W:].float(), out[:, -W:].float()
        cos, sin = lay.rope.cos_sin(torch.arange(S, device=k.device))
        k_pre = invert_rope(k, cos, sin)
        # The observation window's attention, once: SnapKV votes for the anchors and, regrouped
        # [H, group · W, S] (rows in (group, window) order), the weights α of Eq. 6.
        probs = observation_probabilities(q, k, scaling, W)  # [H, group, W, S]
        votes = observation_votes(probs, cfg.kernel)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + lay.layer_idx)
        anchor_pos = select_anchors(votes, S, n_anchors, W, cfg.rho if cfg.random_anchors else 1.0, gen)
        ak, idx_k, gamma_k, r_k = assign_and_project(k_pre, anchor_pos)
        av, idx_v, gamma_v, r_v = assign_and_project(v, anchor_pos)
        sides = ((idx_k, gamma_k, r_k), (idx_v, gamma_v, r_v))
        group = lay.group
        obs_pos = torch.arange(S - W, S, device=k.device).repeat(group)
        u_k, u_v = self._ranking_scores(sides, k_pre, k, v, cos, sin, q.reshape(H, group * W, D),
                                        out.reshape(H, group * W, D), obs_pos, scaling,
                                        alpha=probs.reshape(H, group * W, S))
        is_anchor = torch.zeros(H, S, dtype=torch.bool, device=k.device)
        is_anchor.scatter_(1, anchor_pos, True)
        u_k = u_k.masked_fill(is_anchor, float("-inf"))
        u_v = u_v.masked_fill(is_anchor, float("-inf"))
        self.anchors = {"anchor_k": ak.to(self.storage_dtype), "anchor_v": av.to(self.storage_dtype)}
        self.segments = [self._segment(sides, u_k, u_v, n_res, n_fine)]
        self.segment_spans = [(0, S)]
        self.n_prompt, self.n_anchors = S, n_anchors

    def _recompress_tail(self, scaling: float) -> None:
        """Beyond the paper: compress the oldest ``recompress_every`` tail tokens as a new segment,
        projected onto the prompt's anchors, its residuals scored by the last decode queries (Eq. 6
        with their exact normalisers) and budgeted by Eq. 9 over the segment (no new anchors)."""
        cfg, lay = self.config, self.layout
        n = cfg.recompress_every
        H, D = lay.kv_heads, lay.head_dim
        start = self.n_compressed
        k, v = self.tail_k[:, :n].float(), self.tail_v[:, :n].float()
        pos = torch.arange(start, start + n, device=k.device)
        cos, sin = lay.rope.cos_sin(pos)
        k_pre = invert_rope(k, cos, sin)
        sides = (project_onto_anchors(k_pre, self.anchors["anchor_k"].float()),
                 project_onto_anchors(v, self.anchors["anchor_v"].float()))
        m_full = dense_bf16_bytes(n, H, D)
        m_base = base_bytes(n, H, D, 0, index_bytes=self.index_bytes)
        n_res = max(0, math.floor((cfg.budget * m_full - m_base) / residual_bytes(D))) if cfg.residuals else 0
        n_fine = (fine_residual_slots(cfg.budget, n, H, D, 0, index_bytes=self.index_bytes)
                  if cfg.residuals and self.fine_codec is not None else 0)
        o = self.obs
        group, rows = lay.group, o["obs_q"].shape[1]
        u_k, u_v = self._ranking_scores(sides, k_pre, k, v, cos, sin, o["obs_q"].float().reshape(H, group * rows, D),
                                        o["obs_y"].float().reshape(H, group * rows, D),
                                        o["obs_pos"].long().repeat(group),
                                        scaling, key_positions=pos, lse=o["obs_lse"].reshape(H, group * rows))
        self.segments.append(self._segment(sides, u_k, u_v, n_res, n_fine))
        self.segment_spans.append((start, n))
        self.tail_k, self.tail_v = self.tail_k[:, n:].clone(), self.tail_v[:, n:].clone()

    def _observe(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """Keep the last W decode queries, outputs and log-sum-exps (for re-compression)."""
        W = self.config.window
        new = {"obs_q": q.to(self.storage_dtype), "obs_y": out.to(self.storage_dtype),
               "obs_lse": self._last_lse.float(),
               "obs_pos": torch.arange(self.seq_len, self.seq_len + q.shape[1], dtype=torch.int32, device=q.device)}
        for name, t in new.items():
            dim = 0 if name == "obs_pos" else 1
            old = self.obs.get(name)
            cat = t if old is None else torch.cat([old, t], dim=dim)
            self.obs[name] = cat.narrow(dim, max(0, cat.shape[dim] - W), min(W, cat.shape[dim])).clone()

    def append(self, k, v, q=None, out=None):
        self.check_chunk(q, k, v)
        if self.seq_len == 0:
            if q is None or out is None:
                raise ValueError("anchor: the prefill chunk needs its queries and attention outputs")
            self.compress_prompt(k, v, q, out, self.scaling)
            self.seq_len += k.shape[1]
            return
        # Generated tokens stay dense, as in the paper, unless re-compression is on.
        self.tail_k = torch.cat([self.tail_k, k.to(self.storage_dtype)], dim=1)
        self.tail_v = torch.cat([self.tail_v, v.to(self.storage_dtype)], dim=1)
        if self.config.recompress_every:
            if q is None or out is None:
                raise ValueError("anchor: re-compression needs each chunk's queries and attention outputs")
            self._observe(q, out)
        self.seq_len += k.shape[1]
        if self.config.recompress_every and self.tail_k.shape[1] >= self.config.recompress_every:
            self._recompress_tail(self.scaling)

    # -- attention --------------------------------------------------------------------------

    def chunk_tail(self):
        return self.tail_k, self.tail_v  # read in place by the chunk step (generated tokens stay dense)

    def after_attend(self, m, l):
        if self.config.recompress_every:  # log-sum-exp of each query row over everything it saw,
            # for re-compression scoring (two more ops per layer and step; skipped when it is off)
            self._last_lse = ungroup_output((m + l.log()).unsqueeze(-1), self.layout.q_heads).squeeze(-1)

    def stored_partials(self, qg: torch.Tensor, scaling: float) -> list:
        """One partial state per compressed segment (native or Triton kernel, or PyTorch tiles, per
        ``attention_backend``); the dense tail is :meth:`chunk_tail`'s."""
        segments = self.segment_views()
        backend = self.backend(qg.device)
        if backend == "triton":
            return anchor_partials(segments, qg, scaling)
        if segments and backend == "native":
            return anchor_partials(segments, qg, scaling, native=True)
        return anchor_tile_partials(segments, qg, scaling)

    def segment_views(self) -> list[AnchorSegment]:
        """The compressed segments as attention reads them (no store internals beyond these)."""
        views = []
        for seg, (start, n) in zip(self.segments, self.segment_spans):
            has_fine = "fine_mask_k" in seg
            k, v = (AnchorSide(*(seg[f"{name}_{side}"] for name in ("index", "coef", "mask", "prefix", "res", "scale")),
                               fine=FineResiduals(*(seg[f"fine_{name}_{side}"] for name in ("mask", "prefix", "res",
                                                                                             "scale")))
                               if has_fine else None)
                    for side in ("k", "v"))
            views.append(AnchorSegment(anchor_k=self.anchors["anchor_k"], anchor_v=self.anchors["anchor_v"], keys=k,
                                       values=v, start=start, length=n, codec=self.residual_codec,
                                       rope=self.layout.rope, tile=self.config.tile,
                                       fine_codec=self.fine_codec if has_fine else None))
        return views

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, ``[H, seq_len, D]`` fp32 — for tests only (attention never calls it)."""
        parts = [reconstruct_tile(seg, lo, hi) for seg in self.segment_views() for lo, hi in seg.tiles()]
        k = torch.cat([p[0] for p in parts] + [self.tail_k.float()], dim=1)
        v = torch.cat([p[1] for p in parts] + [self.tail_v.float()], dim=1)
        return k, v





class AnchorPlusStore(AnchorStore):
    """``anchor`` with neighbourhood-pooled residual ranking and uint8 anchor indices (not the paper's
    defaults); see :class:`AnchorPlusConfig`."""

    Config = AnchorPlusConfig
