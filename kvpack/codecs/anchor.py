"""AnchorKV: exact anchors, per-token scaled anchor copies, budgeted 2-bit residuals (AnchorKV, §2–5, Alg. 1).

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

Attention (``kvpack.attention.anchor``) reconstructs keys and values tile by tile,
``x̂ = γ a + r̃`` where a residual is stored, rotates keys by RoPE at their positions, and merges the
tiles, the dense tail of generated tokens and the new chunk by online softmax.

What the store holds (and ``M_base`` counts): anchor keys (pre-RoPE) and values ``[H, k, D]`` (bf16),
per-token anchor indices ``[H, S]`` (int16) and coefficients ``[H, S]`` (fp16) for each side,
residual bitmasks ``[H, ⌈S/8⌉]`` (packed bits) and per-32-token prefix counts ``[H, ⌈S/32⌉]``
(int32) for each side — the decoder finds a token's residual slot from them in O(1). Each stored
residual costs ``b_res = D/4`` code bytes + a 4-byte scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.anchor import anchor_tile_partials
from ..attention.triton import use_triton
from ..attention.scores import observation_scores
from ..attention.softmax_merge import (
    attend_history_and_chunk,
    dense_partial,
    group_queries,
    prefill_attention,
    ungroup_output,
)
from ..ops import lloyd_max
from ..ops.bitpack import pack_bits, unpack_bits
from ..ops.hadamard import RandomizedHadamard
from ..ops.rope import apply_rope, invert_rope
from .base import DENSE_REFERENCE_BYTES_PER_ELEMENT, Codec, CodecConfig, LayerLayout, LayerStore, register_codec, \
    require_int

PREFIX_BLOCK = 32  # tokens per prefix count
RESIDUAL_BITS = 2
SCALE_BYTES = 4  # fp32 per-token residual scale


@dataclass
class AnchorConfig(CodecConfig):
    """AnchorKV parameters (paper defaults).

    Attributes:
        budget: the retain fraction θ (default 0.1): the layer's bytes ≤ θ × its dense bf16 bytes.
        window: W, the last positions, always anchors and the observation queries (default 32).
        anchors: k, anchors per KV head; None = ``max(⌊S/128⌋, W)`` (the paper's S/128, never
            fewer than the window).
        anchor_fraction: the S/128 of the default (used when ``anchors`` is None).
        rho: share of the non-window anchors chosen by score (default 0.7); the rest is random.
        kernel: κ, the pooling kernel of the scores (odd, default 7).
        tile: tokens reconstructed per attention tile (multiple of 32; default 1024).
        recompress_every: beyond the paper: when the dense tail of generated tokens reaches this
            many tokens, compress them as a new segment (same anchors, Eq. 6/9 over the segment,
            scored by the last W decode queries). None (default): generated tokens stay dense.
        attention_backend: attention over the compressed segments: ``auto`` (the Triton kernel for
            CUDA tensors when Triton is installed, else PyTorch), ``triton`` (always; CPU only under
            ``TRITON_INTERPRET=1``) or ``torch``.
    """

    budget: float | None = 0.1
    window: int = 32
    anchors: int | None = None
    anchor_fraction: float = 1 / 128
    rho: float = 0.7
    kernel: int = 7
    tile: int = 1024
    recompress_every: int | None = None
    attention_backend: str = "auto"

    def validate(self) -> None:
        super().validate()
        from ..attention.triton import KERNEL_CHOICES

        if self.attention_backend not in KERNEL_CHOICES:
            raise ValueError(f"attention_backend must be one of {KERNEL_CHOICES}, got {self.attention_backend!r}")
        if self.budget is None:
            raise ValueError("anchor: budget (the retain fraction θ) is required")
        require_int(self, "window", minimum=1)
        if self.anchors is not None:
            require_int(self, "anchors", minimum=1)
            if self.anchors < self.window:
                raise ValueError(f"anchors (k = {self.anchors}) must be >= window (W = {self.window})")
        if not (isinstance(self.rho, (int, float)) and 0.0 <= self.rho <= 1.0):
            raise ValueError(f"rho must be in [0, 1], got {self.rho!r}")
        if not (isinstance(self.anchor_fraction, (int, float)) and 0.0 < self.anchor_fraction <= 1.0):
            raise ValueError(f"anchor_fraction must be in (0, 1], got {self.anchor_fraction!r}")
        require_int(self, "kernel", minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel (κ) must be odd, got {self.kernel}")
        require_int(self, "tile", minimum=PREFIX_BLOCK)
        if self.tile % PREFIX_BLOCK:
            raise ValueError(f"tile must be a multiple of {PREFIX_BLOCK}, got {self.tile}")
        if self.recompress_every is not None:
            require_int(self, "recompress_every", minimum=PREFIX_BLOCK)


def residual_bytes(head_dim: int) -> int:
    """``b_res``: packed 2-bit codes of one residual plus its scale."""
    return head_dim * RESIDUAL_BITS // 8 + SCALE_BYTES


def base_bytes(seq_len: int, kv_heads: int, head_dim: int, n_anchors: int, anchor_bytes: int = 2) -> int:
    """``M_base``: every byte besides the residual codes and scales (see module doc)."""
    per_side = (kv_heads * n_anchors * head_dim * anchor_bytes  # anchor vectors
                + kv_heads * seq_len * (2 + 2)  # int16 anchor index + fp16 coefficient
                + kv_heads * math.ceil(seq_len / 8)  # residual bitmask
                + kv_heads * math.ceil(seq_len / PREFIX_BLOCK) * 4)  # int32 prefix counts
    return 2 * per_side


def residual_slots(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                   anchor_bytes: int = 2) -> int:
    """Eq. 9: residuals the budget buys (raises below the fixed cost)."""
    m_full = seq_len * kv_heads * head_dim * 2 * DENSE_REFERENCE_BYTES_PER_ELEMENT
    m_base = base_bytes(seq_len, kv_heads, head_dim, n_anchors, anchor_bytes)
    if theta * m_full < m_base:
        raise ValueError(
            f"anchor: budget θ = {theta} is below AnchorKV's fixed cost at {seq_len} tokens: anchors and metadata "
            f"need {m_base / m_full:.4f} of the dense bytes (k = {n_anchors} anchors per head)"
        )
    return max(0, math.floor((theta * m_full - m_base) / residual_bytes(head_dim)))


def select_anchors(votes: torch.Tensor, seq_len: int, n_anchors: int, window: int, rho: float,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor positions ``[H, k]`` (sorted): window + top-``ρ(k−W)`` by ``votes [H, S−W]`` + random rest."""
    H = votes.shape[0]
    n_extra = n_anchors - window
    n_top = round(rho * n_extra)
    out = []
    for h in range(H):
        top = torch.topk(votes[h], n_top).indices if n_top else votes.new_zeros(0, dtype=torch.long)
        rest = torch.ones(seq_len - window, dtype=torch.bool)
        rest[top] = False
        pool = rest.nonzero().squeeze(-1)
        rand = pool[torch.randperm(pool.numel(), generator=generator)[: n_extra - n_top]]
        out.append(torch.cat([top.cpu(), rand, torch.arange(seq_len - window, seq_len)]).sort().values)
    return torch.stack(out).to(votes.device)


def project_onto_anchors(x: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, n, D]`` onto ``anchors [H, k, D]``: ``(index [H, n], gamma [H, n], residual)``."""
    D = x.shape[-1]
    dots = torch.einsum("hsd,hkd->hsk", x, anchors)
    norms = x.norm(dim=-1).clamp_min(1e-30)[..., None] * anchors.norm(dim=-1).clamp_min(1e-30)[:, None, :]
    index = (dots.abs() / norms).argmax(dim=-1)
    a = torch.gather(anchors, 1, index[..., None].expand(-1, -1, D))
    gamma = (x * a).sum(-1) / (a * a).sum(-1).clamp_min(1e-30)
    return index, gamma, x - gamma[..., None] * a


def assign_and_project(x: torch.Tensor, anchor_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, S, D]`` (fp32) and anchor positions ``[H, k]``.

    Returns:
        ``(anchors [H, k, D], index [H, S] long, gamma [H, S], residual [H, S, D])``; anchors are
        their own anchor with γ = 1 and a zero residual.
    """
    H, S, D = x.shape
    anchors = torch.gather(x, 1, anchor_pos[..., None].expand(-1, -1, D))
    dots = torch.einsum("hsd,hkd->hsk", x, anchors)
    norms = x.norm(dim=-1).clamp_min(1e-30)[..., None] * anchors.norm(dim=-1).clamp_min(1e-30)[:, None, :]
    index = (dots.abs() / norms).argmax(dim=-1)
    slot = torch.arange(anchor_pos.shape[1], device=x.device)[None].expand(H, -1)
    index.scatter_(1, anchor_pos, slot)
    a = torch.gather(anchors, 1, index[..., None].expand(-1, -1, D))
    gamma = (x * a).sum(-1) / (a * a).sum(-1).clamp_min(1e-30)
    gamma.scatter_(1, anchor_pos, torch.ones_like(anchor_pos, dtype=gamma.dtype))
    residual = x - gamma[..., None] * a
    residual.scatter_(1, anchor_pos[..., None].expand(-1, -1, D), torch.zeros_like(anchors))
    return anchors, index, gamma, residual


def utilities(q_obs: torch.Tensor, y_obs: torch.Tensor, k_post: torch.Tensor, v: torch.Tensor, key_residual_post,
              value_residual, scaling: float, obs_positions: torch.Tensor, key_positions: torch.Tensor | None = None,
              lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``(u_K, u_V)`` ``[H, S]``.

    Args:
        q_obs: ``[H, m, D]`` observation queries grouped per KV head; y_obs: their exact outputs.
        k_post: ``[H, S, D]`` post-RoPE keys; v: ``[H, S, D]`` values.
        key_residual_post: ``[H, S, D]`` key residuals rotated to their positions (R_t r_K).
        value_residual: ``[H, S, D]``.
        obs_positions: ``[m]`` position of each observation row (causal visibility).
        key_positions: ``[S]`` positions of the keys (default ``0..S-1``).
        lse: ``[H, m]`` log-sum-exp of each observation row's logits over *all* keys it attended;
            when the keys here are only part of them (a re-compressed segment), α is normalised
            with it. None: the keys here are all the row saw (the prompt).
    """
    S = k_post.shape[1]
    pos = torch.arange(S, device=k_post.device) if key_positions is None else key_positions
    s = torch.einsum("hmd,hsd->hms", q_obs, k_post) * scaling
    s = s.masked_fill(pos[None, None, :] > obs_positions[None, :, None], float("-inf"))
    alpha = torch.softmax(s, dim=-1) if lse is None else torch.exp(s - lse[..., None])
    alpha2 = alpha.square()  # [H, m, S]
    ds = torch.einsum("hmd,hsd->hms", q_obs, key_residual_post) * scaling
    dist = (v.square().sum(-1)[:, None, :] - 2 * torch.einsum("hmd,hsd->hms", y_obs, v)
            + y_obs.square().sum(-1)[..., None]).clamp_min(0)
    u_k = (alpha2 * ds.square() * dist).mean(dim=1)
    u_v = alpha2.mean(dim=1) * value_residual.square().sum(-1)
    return u_k, u_v


def top_pooled(u: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[H, S]``: the ``n`` largest finite utilities of the whole layer (all heads pooled)."""
    flat = u.flatten()
    n = min(n, int(torch.isfinite(flat).sum()))
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    if n > 0:
        chosen[torch.topk(flat, n).indices] = True
    return chosen.reshape(u.shape)


class AnchorStore(LayerStore):
    """One sequence, one layer: anchors, compressed segments (the prompt, then any re-compressed
    stretch of generated tokens) and the dense tail of generated tokens.

    Tensors: ``anchor_k``/``anchor_v`` ``[H, k, D]``; per segment ``i`` (``seg{i}_*``): ``index_*``
    ``[H, n]`` int16, ``coef_*`` ``[H, n]`` fp16, ``mask_*`` packed bits, ``prefix_*`` ``[H, ⌈n/32⌉]``
    int32, ``res_*`` ``[slots, D/4]`` uint8, ``scale_*`` ``[slots]`` fp32; ``tail_k``/``tail_v``; with
    ``recompress_every``, the observation buffer ``obs_q``/``obs_y`` ``[Hq, ≤W, D]``, ``obs_lse``
    ``[Hq, ≤W]`` fp32 and ``obs_pos`` ``[≤W]`` int32 (the last decode queries, their outputs and
    softmax normalisers, which score a re-compressed segment's residuals).
    """

    def __init__(self, layout: LayerLayout, config: AnchorConfig):
        super().__init__(layout, config)
        if layout.rope is None:
            raise ValueError("anchor: AnchorKV works on pre-RoPE keys and needs the model's rotary embedding")
        d = layout.head_dim
        self.hadamard = RandomizedHadamard(d, seed=config.seed * 1_000_003 + layout.layer_idx)
        empty = torch.empty(layout.kv_heads, 0, d, dtype=self.storage_dtype)
        self.tail_k, self.tail_v = empty, empty.clone()
        self.anchors: dict[str, torch.Tensor] = {}
        self.segments: list[dict[str, torch.Tensor]] = []
        self.segment_spans: list[tuple[int, int]] = []  # (start position, tokens)
        self.obs: dict[str, torch.Tensor] = {}
        self.n_prompt = 0
        self.n_anchors: int | None = None
        self.n_residuals = (0, 0)
        self._last_lse: torch.Tensor | None = None

    def tensors(self):
        out = dict(self.anchors)
        for i, seg in enumerate(self.segments):
            out.update({f"seg{i}_{name}": t for name, t in seg.items()})
        return {**out, **self.obs, "tail_k": self.tail_k, "tail_v": self.tail_v}

    def resolved_params(self):
        if self.n_anchors is None:
            return {}
        return {"anchors": self.n_anchors, "residuals_k": self.n_residuals[0], "residuals_v": self.n_residuals[1],
                "segments": len(self.segments)}

    @property
    def n_compressed(self) -> int:
        return sum(n for _, n in self.segment_spans)

    # -- residual codec ---------------------------------------------------------------------

    def _encode_residuals(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, D]`` residuals -> packed 2-bit codes ``[n, D/4]`` and fp32 scales ``[n]``."""
        y = self.hadamard.forward(r)
        scale = y.norm(dim=-1) / math.sqrt(r.shape[-1])
        codes = lloyd_max.encode(y / scale.clamp_min(1e-30)[:, None])
        return pack_bits(codes, RESIDUAL_BITS), scale

    def decode_residuals(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = lloyd_max.decode_packed(codes, self.layout.head_dim) * scale[:, None]
        return self.hadamard.inverse(y)

    # -- compression ------------------------------------------------------------------------

    def _segment(self, sides, u_k, u_v, n_res) -> dict[str, torch.Tensor]:
        """Store one segment: ``sides`` = ((index, gamma, residual) for keys, same for values)."""
        H, n = u_k.shape
        n_k = n_res // 2
        masks = (top_pooled(u_k, n_k), top_pooled(u_v, n_res - n_k))
        seg = {}
        for name, (idx, gamma, r), mask in zip(("k", "v"), sides, masks):
            seg[f"index_{name}"] = idx.to(torch.int16)
            seg[f"coef_{name}"] = gamma.to(torch.float16)
            seg[f"mask_{name}"] = pack_bits(mask.to(torch.uint8), 1)
            counts = F.pad(mask, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).sum(-1)
            # Slot of a head's first residual in block b: all residuals of earlier heads and blocks.
            seg[f"prefix_{name}"] = (counts.flatten().cumsum(0) - counts.flatten()).reshape(H, -1).to(torch.int32)
            seg[f"res_{name}"], seg[f"scale_{name}"] = self._encode_residuals(r[mask])  # head-major slots
        self.n_residuals = (self.n_residuals[0] + int(masks[0].sum()), self.n_residuals[1] + int(masks[1].sum()))
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
        n_anchors = cfg.anchors if cfg.anchors is not None else max(math.floor(S * cfg.anchor_fraction), W)
        if n_anchors > S:
            raise ValueError(f"anchor: k = {n_anchors} anchors exceed the prompt's {S} tokens")
        n_res = residual_slots(cfg.budget, S, H, D, n_anchors, self.storage_dtype.itemsize)
        if q.shape[1] < W or out.shape[1] < W:
            raise ValueError(f"anchor: compression needs the last W = {W} queries and outputs")
        k, v, q, out = k.float(), v.float(), q[:, -W:].float(), out[:, -W:].float()
        cos, sin = lay.rope.cos_sin(torch.arange(S, device=k.device))
        k_pre = invert_rope(k, cos, sin)
        votes = observation_scores(q, k, scaling, W, cfg.kernel)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + lay.layer_idx)
        anchor_pos = select_anchors(votes, S, n_anchors, W, cfg.rho, gen)
        ak, idx_k, gamma_k, r_k = assign_and_project(k_pre, anchor_pos)
        av, idx_v, gamma_v, r_v = assign_and_project(v, anchor_pos)
        group = lay.group
        obs_pos = torch.arange(S - W, S, device=k.device).repeat(group)
        u_k, u_v = utilities(q.reshape(H, group * W, D), out.reshape(H, group * W, D), k, v,
                             apply_rope(r_k, cos, sin), r_v, scaling, obs_pos)
        is_anchor = torch.zeros(H, S, dtype=torch.bool, device=k.device)
        is_anchor.scatter_(1, anchor_pos, True)
        u_k = u_k.masked_fill(is_anchor, float("-inf"))
        u_v = u_v.masked_fill(is_anchor, float("-inf"))
        self.anchors = {"anchor_k": ak.to(self.storage_dtype), "anchor_v": av.to(self.storage_dtype)}
        self.segments = [self._segment(((idx_k, gamma_k, r_k), (idx_v, gamma_v, r_v)), u_k, u_v, n_res)]
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
        m_full = n * H * D * 2 * DENSE_REFERENCE_BYTES_PER_ELEMENT
        n_res = max(0, math.floor((cfg.budget * m_full - base_bytes(n, H, D, 0)) / residual_bytes(D)))
        o = self.obs
        group, rows = lay.group, o["obs_q"].shape[1]
        u_k, u_v = utilities(o["obs_q"].float().reshape(H, group * rows, D), o["obs_y"].float().reshape(H, group * rows, D),
                             k, v, apply_rope(sides[0][2], cos, sin), sides[1][2], scaling,
                             o["obs_pos"].long().repeat(group), key_positions=pos,
                             lse=o["obs_lse"].reshape(H, group * rows))
        self.segments.append(self._segment(sides, u_k, u_v, n_res))
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

    def attend(self, q, k, v, scaling):
        self.check_chunk(q, k, v)
        self.scaling = scaling
        lay = self.layout
        if self.seq_len == 0:
            return prefill_attention(q, k, v, scaling)
        qg = group_queries(q, lay.kv_heads)
        out, merged = attend_history_and_chunk(self.stored_partials(qg, scaling), qg, k, v, scaling, lay.q_heads)
        # log-sum-exp of each query row over everything it saw (kept for re-compression scoring).
        self._last_lse = ungroup_output((merged.m + merged.l.log()).unsqueeze(-1), lay.q_heads).squeeze(-1)
        return out.to(q.dtype)

    def stored_partials(self, qg: torch.Tensor, scaling: float) -> list:
        """Partial states of grouped queries over everything stored: the compressed segments (Triton
        kernel or PyTorch tiles, per ``attention_backend``) and the dense tail."""
        if use_triton(self.config.attention_backend, qg.device):
            from ..attention.triton.anchor_op import anchor_partials

            states = anchor_partials(self, qg, scaling)
        else:
            states = anchor_tile_partials(self, qg, scaling)
        if self.tail_k.shape[1]:
            states.append(dense_partial(qg, self.tail_k, self.tail_v, scaling))
        return states

    def reconstruct_tile(self, segment: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values ``[H, hi − lo, D]`` fp32 of tokens ``[lo, hi)`` of a segment.

        ``lo`` must be a multiple of 32 (prefix-count blocks). Only this tile is materialised.
        """
        H, D = self.layout.kv_heads, self.layout.head_dim
        seg = self.segments[segment]
        start = self.segment_spans[segment][0]
        n = hi - lo
        out = []
        for side in ("k", "v"):
            anchors = self.anchors[f"anchor_{side}"]
            k_anchors = anchors.shape[1]
            # One flat row lookup (faster than gather with an expanded index): row h*k + index.
            rows = (seg[f"index_{side}"][:, lo:hi].long()
                    + torch.arange(H, device=anchors.device)[:, None] * k_anchors).flatten()
            x = anchors.reshape(H * k_anchors, D).index_select(0, rows).float().reshape(H, n, D)
            x = x * seg[f"coef_{side}"][:, lo:hi, None].float()
            # lo is a multiple of 32: the tile's bits start on a byte boundary.
            mask = unpack_bits(seg[f"mask_{side}"][:, lo // 8: (hi + 7) // 8], 1, n).bool()
            where = mask.flatten().nonzero().squeeze(-1)  # flat (head, token) of the tile's residuals
            if where.numel():
                # Slot = prefix count of the token's 32-token block + residuals before it in the block.
                padded = F.pad(mask, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).int()
                before = (padded.cumsum(-1) - padded).reshape(H, -1)[:, :n]
                blocks = seg[f"prefix_{side}"][:, lo // PREFIX_BLOCK: lo // PREFIX_BLOCK + padded.shape[1]]
                slots = (blocks.repeat_interleave(PREFIX_BLOCK, dim=1)[:, :n] + before).flatten()[where].long()
                res = self.decode_residuals(seg[f"res_{side}"][slots], seg[f"scale_{side}"][slots])
                x = x.reshape(H * n, D).index_add_(0, where, res).reshape(H, n, D)
            out.append(x)
        cos, sin = self.layout.rope.cos_sin(torch.arange(start + lo, start + hi, device=out[0].device))
        return apply_rope(out[0], cos, sin), out[1]

    def tiles(self):
        """``(segment, lo, hi)`` of every attention tile, in position order."""
        for i, (_, n) in enumerate(self.segment_spans):
            for lo in range(0, n, self.config.tile):
                yield i, lo, min(lo + self.config.tile, n)

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, ``[H, seq_len, D]`` fp32 — for tests only (attention never calls it)."""
        parts = [self.reconstruct_tile(*tile) for tile in self.tiles()]
        k = torch.cat([p[0] for p in parts] + [self.tail_k.float()], dim=1)
        v = torch.cat([p[1] for p in parts] + [self.tail_v.float()], dim=1)
        return k, v


@register_codec("anchor")
class AnchorKV(Codec):
    """AnchorKV (anchors + scaled anchor copies + budgeted 2-bit residuals). See :class:`AnchorConfig`."""

    Config = AnchorConfig

    def new_store(self, layout):
        if layout.head_dim & (layout.head_dim - 1):
            raise ValueError(f"anchor: the Hadamard residual codec needs a power-of-two head_dim, got {layout.head_dim}")
        return AnchorStore(layout, self.config)
