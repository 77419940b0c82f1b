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

Attention (``kvpack.attention.anchor``) reconstructs keys tile by tile, ``x̂ = γ a + r̃`` where a
residual is stored, rotates them by RoPE at their positions, takes each tile's weighted sum of
values on the stored form, and merges the tiles, the dense tail of generated tokens and the new
chunk by online softmax.

The ablation switches of the paper's Fig. 5 and two options beyond the paper are fields of
:class:`AnchorConfig`; ``anchor_plus`` is this codec with the two options on.

What the store holds (and ``M_base`` counts): anchor keys (pre-RoPE) and values ``[H, k, D]`` (bf16),
per-token anchor indices ``[H, S]`` (int16; uint8 with ``narrow_index`` and ``k ≤ 256``) and
coefficients ``[H, S]`` (fp16) for each side,
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
from ..attention.triton import history_and_chunk, use_triton
from ..attention.scores import observation_scores
from ..attention.softmax_merge import (
    dense_partial,
    group_queries,
    prefill_attention,
    ungroup_output,
)
from ..ops.bitpack import pack_bits, unpack_bits
from ..ops.residual_codec import RESIDUAL_CODECS, ResidualCodec, make_residual_codec
from ..ops.rope import apply_rope, invert_rope
from .base import Codec, CodecConfig, LayerLayout, LayerStore, dense_bf16_bytes, register_codec, \
    require_bool, require_int

PREFIX_BLOCK = 32  # tokens per prefix count
RANKINGS = ("utility", "attention", "residual_norm", "cosine", "random")
RESIDUAL_SPLITS = ("pooled", "per_head")


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

    Ablation switches (paper Fig. 5; the defaults are the paper's method):
        ranking: what ranks the residual candidates: ``utility`` (Eq. 6), ``attention`` (mean
            attention weight of the observation queries), ``residual_norm`` (``‖r‖²``), ``cosine``
            (worst-aligned first: ``1 − cos²`` to the token's anchor) or ``random`` (seeded).
        random_anchors: False = every non-window anchor chosen by score (as ρ = 1).
        residual_split: ``pooled`` (top residuals across all heads of the layer) or ``per_head``
            (an equal share per head).
        residuals: False = no residuals; the budget buys as many anchors as it fits instead
            (``anchors`` must then be left unset).
        residual_codec: ``hadamard_lloyd_max`` or ``naive`` (no rotation, absmax scale, evenly
            spaced levels; same bytes).

    Beyond the paper (off by default; measured in docs/anchorkv.md):
        residual_pooling: odd window of a max-pool over each head's ranking scores along the
            sequence before the top-N choice (1 = off), so the neighbours of a token the
            observation queries use — the digits after a needle's key, which later decode steps
            copy — compete with its score.
        narrow_index: store the per-token anchor indices as uint8 when ``k ≤ 256`` (int16
            otherwise); the byte saved per token and side buys residuals.
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
    ranking: str = "utility"
    random_anchors: bool = True
    residual_split: str = "pooled"
    residuals: bool = True
    residual_codec: str = "hadamard_lloyd_max"
    residual_pooling: int = 1
    narrow_index: bool = False

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
        for name, choices in (("ranking", RANKINGS), ("residual_split", RESIDUAL_SPLITS),
                              ("residual_codec", RESIDUAL_CODECS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("random_anchors", "residuals", "narrow_index"):
            require_bool(self, name)
        require_int(self, "residual_pooling", minimum=1)
        if self.residual_pooling % 2 == 0:
            raise ValueError(f"residual_pooling must be odd, got {self.residual_pooling}")
        if not self.residuals and self.anchors is not None:
            raise ValueError("anchors must be unset when residuals=false: the budget decides how many anchors it buys")


def residual_bytes(head_dim: int) -> int:
    """``b_res``: packed 2-bit codes of one residual plus its scale."""
    return ResidualCodec.bytes_per_residual(head_dim)


def index_bytes_for(n_anchors: int, narrow: bool) -> int:
    """Bytes of one stored anchor index: 2 (int16, the paper's accounting), or 1 (uint8) when
    ``narrow`` and ``k ≤ 256``."""
    return 1 if narrow and n_anchors <= 256 else 2


def base_bytes(seq_len: int, kv_heads: int, head_dim: int, n_anchors: int, anchor_bytes: int = 2,
               index_bytes: int = 2) -> int:
    """``M_base``: every byte besides the residual codes and scales (see module doc)."""
    per_side = (kv_heads * n_anchors * head_dim * anchor_bytes  # anchor vectors
                + kv_heads * seq_len * (index_bytes + 2)  # anchor index + fp16 coefficient
                + kv_heads * math.ceil(seq_len / 8)  # residual bitmask
                + kv_heads * math.ceil(seq_len / PREFIX_BLOCK) * 4)  # int32 prefix counts
    return 2 * per_side


def _below_fixed_cost(theta: float, seq_len: int, m_base: int, m_full: int, n_anchors: int) -> ValueError:
    return ValueError(
        f"anchor: budget θ = {theta} is below AnchorKV's fixed cost at {seq_len} tokens: anchors and metadata "
        f"need {m_base / m_full:.4f} of the dense bytes (k = {n_anchors} anchors per head)"
    )


def residual_slots(theta: float, seq_len: int, kv_heads: int, head_dim: int, n_anchors: int,
                   anchor_bytes: int = 2, index_bytes: int = 2) -> int:
    """Eq. 9: residuals the budget buys (raises below the fixed cost)."""
    m_full = dense_bf16_bytes(seq_len, kv_heads, head_dim)
    m_base = base_bytes(seq_len, kv_heads, head_dim, n_anchors, anchor_bytes, index_bytes)
    if theta * m_full < m_base:
        raise _below_fixed_cost(theta, seq_len, m_base, m_full, n_anchors)
    return max(0, math.floor((theta * m_full - m_base) / residual_bytes(head_dim)))


def anchors_for_budget(theta: float, seq_len: int, kv_heads: int, head_dim: int, window: int,
                       anchor_bytes: int = 2, narrow_index: bool = False) -> tuple[int, int]:
    """The "no residuals" ablation: ``(k, index bytes)`` with the most anchors per head whose
    ``M_base`` fits ``θ M_full`` (at most ``seq_len``; raises when not even the window fits)."""
    m_full = dense_bf16_bytes(seq_len, kv_heads, head_dim)
    per_anchor = 2 * kv_heads * head_dim * anchor_bytes
    for index_bytes in ((1, 2) if narrow_index else (2,)):
        fixed = base_bytes(seq_len, kv_heads, head_dim, 0, anchor_bytes, index_bytes)
        k = min(seq_len, math.floor((theta * m_full - fixed) / per_anchor))
        if index_bytes_for(k, narrow_index) == index_bytes:
            break
    if k < window:
        raise _below_fixed_cost(theta, seq_len, base_bytes(seq_len, kv_heads, head_dim, window, anchor_bytes,
                                                            index_bytes), m_full, window)
    return k, index_bytes


def select_anchors(votes: torch.Tensor, seq_len: int, n_anchors: int, window: int, rho: float,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor positions ``[H, k]`` (sorted): window + top-``ρ(k−W)`` by ``votes [H, S−W]`` + random rest.

    All heads at once on the votes' device; the random part draws one permutation per head from the
    (CPU) ``generator``, so the choice does not depend on the device.
    """
    H = votes.shape[0]
    dev = votes.device
    n_extra = n_anchors - window
    n_top = round(rho * n_extra)
    n_prefix = seq_len - window
    top = torch.topk(votes, n_top, dim=1).indices  # [H, n_top]
    rest = torch.ones(H, n_prefix, dtype=torch.bool, device=dev)
    rest.scatter_(1, top, False)
    pool = rest.nonzero()[:, 1].view(H, n_prefix - n_top)  # each head's remaining positions, ascending
    perms = torch.stack([torch.randperm(n_prefix - n_top, generator=generator) for _ in range(H)])
    rand = torch.gather(pool, 1, perms[:, : n_extra - n_top].to(dev))
    window_pos = torch.arange(n_prefix, seq_len, device=dev).expand(H, -1)
    return torch.cat([top, rand, window_pos], dim=1).sort(dim=1).values


ASSIGN_BLOCK_ELEMENTS = 1 << 24  # bound on one [H, tokens, k] block of |cos| (64 MiB in fp32)


def nearest_anchor(x: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Eq. 1: index ``[H, n]`` of the anchor with the largest ``|cos|`` to each row of ``x [H, n, D]``.

    ``‖x‖`` is the same for every anchor of a token, so only the anchors are normalised. Tokens go in
    blocks so that the ``[H, block, k]`` scores stay bounded (unblocked, 128K tokens with k = 1024
    anchors would take 4 GiB per copy).
    """
    H, n, _ = x.shape
    unit = anchors / anchors.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    block = max(1, ASSIGN_BLOCK_ELEMENTS // (H * anchors.shape[1]))
    return torch.cat([torch.einsum("hsd,hkd->hsk", x[:, i: i + block], unit).abs_().argmax(dim=-1)
                      for i in range(0, n, block)], dim=1)


def project_onto_anchors(x: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, n, D]`` onto ``anchors [H, k, D]``: ``(index [H, n], gamma [H, n], residual)``."""
    D = x.shape[-1]
    index = nearest_anchor(x, anchors)
    a = torch.gather(anchors, 1, index[..., None].expand(-1, -1, D))
    gamma = (x * a).sum(-1) / (a * a).sum(-1).clamp_min(1e-30)
    return index, gamma, x - gamma[..., None] * a


def assign_and_project(x: torch.Tensor, anchor_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, S, D]`` (fp32) and anchor positions ``[H, k]``.

    Returns:
        ``(anchors [H, k, D], index [H, S] long, gamma [H, S], residual [H, S, D])``; anchors are
        their own anchor with γ = 1 and a zero residual (set exactly, whatever ties or rounding say).
    """
    H, S, D = x.shape
    anchors = torch.gather(x, 1, anchor_pos[..., None].expand(-1, -1, D))
    index, gamma, residual = project_onto_anchors(x, anchors)
    index.scatter_(1, anchor_pos, torch.arange(anchor_pos.shape[1], device=x.device)[None].expand(H, -1))
    gamma.scatter_(1, anchor_pos, torch.ones_like(anchor_pos, dtype=gamma.dtype))
    residual.scatter_(1, anchor_pos[..., None].expand(-1, -1, D), torch.zeros_like(anchors))
    return anchors, index, gamma, residual


def observation_weights(q_obs: torch.Tensor, k_post: torch.Tensor, scaling: float, obs_positions: torch.Tensor,
                        key_positions: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights ``α [H, m, S]`` of the observation queries on the keys.

    Args:
        q_obs: ``[H, m, D]`` observation queries grouped per KV head.
        k_post: ``[H, S, D]`` post-RoPE keys.
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
    return torch.softmax(s, dim=-1) if lse is None else torch.exp(s - lse[..., None])


def utilities(q_obs: torch.Tensor, y_obs: torch.Tensor, k_post: torch.Tensor, v: torch.Tensor, key_residual_post,
              value_residual, scaling: float, obs_positions: torch.Tensor, key_positions: torch.Tensor | None = None,
              lse: torch.Tensor | None = None, alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``(u_K, u_V)`` ``[H, S]``.

    Args:
        q_obs, k_post, obs_positions, key_positions, lse: as :func:`observation_weights`.
        y_obs: ``[H, m, D]`` the observation queries' exact outputs.
        v: ``[H, S, D]`` values.
        key_residual_post: ``[H, S, D]`` key residuals rotated to their positions (R_t r_K).
        value_residual: ``[H, S, D]``.
        alpha: the weights, when the caller already has them.
    """
    if alpha is None:
        alpha = observation_weights(q_obs, k_post, scaling, obs_positions, key_positions, lse)
    alpha2 = alpha.square()  # [H, m, S]
    ds = torch.einsum("hmd,hsd->hms", q_obs, key_residual_post) * scaling
    dist = (v.square().sum(-1)[:, None, :] - 2 * torch.einsum("hmd,hsd->hms", y_obs, v)
            + y_obs.square().sum(-1)[..., None]).clamp_min(0)
    u_k = (alpha2 * ds.square() * dist).mean(dim=1)
    u_v = alpha2.mean(dim=1) * value_residual.square().sum(-1)
    return u_k, u_v


def pool_neighbourhood(u: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max of ``u [H, S]`` over a window of ``kernel`` positions (stride 1, same length); ``-inf``
    entries (anchors) stay ``-inf`` and lend nothing to their neighbours."""
    if kernel == 1:
        return u
    finite = torch.isfinite(u)
    x = torch.where(finite, u, torch.zeros_like(u))  # utilities are >= 0: 0 is a neutral floor
    pooled = F.max_pool1d(x[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.masked_fill(~finite, float("-inf"))


def top_pooled(u: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[H, S]``: the ``n`` largest finite utilities of the whole layer (all heads pooled)."""
    flat = u.flatten()
    n = min(n, int(torch.isfinite(flat).sum()))
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    if n > 0:
        chosen[torch.topk(flat, n).indices] = True
    return chosen.reshape(u.shape)


def top_per_head(u: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[H, S]``: an equal share of ``n`` per head (the first ``n mod H`` heads one more), each
    head's largest finite utilities (the "per-head residuals" ablation)."""
    H = u.shape[0]
    return torch.stack([top_pooled(u[h:h + 1], n // H + (h < n % H))[0] for h in range(H)])


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
        self.residual_codec = make_residual_codec(config.residual_codec, d,
                                                  seed=config.seed * 1_000_003 + layout.layer_idx)
        empty = torch.empty(layout.kv_heads, 0, d, dtype=self.storage_dtype)
        self.tail_k, self.tail_v = empty, empty.clone()
        self.anchors: dict[str, torch.Tensor] = {}
        self.segments: list[dict[str, torch.Tensor]] = []
        self.segment_spans: list[tuple[int, int]] = []  # (start position, tokens)
        self.obs: dict[str, torch.Tensor] = {}
        self.n_prompt = 0
        self.n_anchors: int | None = None
        self.index_bytes = 2
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

    # -- compression ------------------------------------------------------------------------

    def _ranking_scores(self, sides, k_pre, k_post, v, cos, sin, q_obs, y_obs, obs_pos, scaling,
                        key_positions=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``[H, n]`` per side by which residual candidates are ranked (``config.ranking``).

        ``sides`` = ((index, gamma, residual) for keys, same for values); ``k_pre``/``k_post`` the
        keys before/after RoPE, ``v`` the values ``[H, n, D]``; the observation arguments as
        :func:`utilities`.
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
        alpha = observation_weights(q_obs, k_post, scaling, obs_pos, key_positions, lse)
        if ranking == "attention":
            usage = alpha.mean(dim=1)
            return usage, usage.clone()
        return utilities(q_obs, y_obs, k_post, v, apply_rope(r_k, cos, sin), r_v, scaling, obs_pos, alpha=alpha)

    def _segment(self, sides, u_k, u_v, n_res) -> dict[str, torch.Tensor]:
        """Store one segment: ``sides`` = ((index, gamma, residual) for keys, same for values);
        ``u_k``/``u_v`` ``[H, n]`` rank the residual candidates (``-inf``: never a residual)."""
        cfg = self.config
        H, n = u_k.shape
        n_k = n_res // 2
        choose = top_pooled if cfg.residual_split == "pooled" else top_per_head
        masks = (choose(pool_neighbourhood(u_k, cfg.residual_pooling), n_k),
                 choose(pool_neighbourhood(u_v, cfg.residual_pooling), n_res - n_k))
        index_dtype = torch.uint8 if self.index_bytes == 1 else torch.int16
        seg = {}
        for name, (idx, gamma, r), mask in zip(("k", "v"), sides, masks):
            seg[f"index_{name}"] = idx.to(index_dtype)
            seg[f"coef_{name}"] = gamma.to(torch.float16)
            seg[f"mask_{name}"] = pack_bits(mask.to(torch.uint8), 1)
            counts = F.pad(mask, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).sum(-1)
            # Slot of a head's first residual in block b: all residuals of earlier heads and blocks.
            seg[f"prefix_{name}"] = (counts.flatten().cumsum(0) - counts.flatten()).reshape(H, -1).to(torch.int32)
            seg[f"res_{name}"], seg[f"scale_{name}"] = self.residual_codec.encode(r[mask])  # head-major slots
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
        itemsize = self.storage_dtype.itemsize
        if cfg.residuals:
            n_anchors = cfg.anchors if cfg.anchors is not None else max(math.floor(S * cfg.anchor_fraction), W)
            if n_anchors > S:
                raise ValueError(f"anchor: k = {n_anchors} anchors exceed the prompt's {S} tokens")
            self.index_bytes = index_bytes_for(n_anchors, cfg.narrow_index)
            n_res = residual_slots(cfg.budget, S, H, D, n_anchors, itemsize, self.index_bytes)
        else:  # ablation: the whole budget on anchors
            n_anchors, self.index_bytes = anchors_for_budget(cfg.budget, S, H, D, W, itemsize, cfg.narrow_index)
            n_res = 0
        if q.shape[1] < W or out.shape[1] < W:
            raise ValueError(f"anchor: compression needs the last W = {W} queries and outputs")
        k, v, q, out = k.float(), v.float(), q[:, -W:].float(), out[:, -W:].float()
        cos, sin = lay.rope.cos_sin(torch.arange(S, device=k.device))
        k_pre = invert_rope(k, cos, sin)
        votes = observation_scores(q, k, scaling, W, cfg.kernel)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + lay.layer_idx)
        anchor_pos = select_anchors(votes, S, n_anchors, W, cfg.rho if cfg.random_anchors else 1.0, gen)
        ak, idx_k, gamma_k, r_k = assign_and_project(k_pre, anchor_pos)
        av, idx_v, gamma_v, r_v = assign_and_project(v, anchor_pos)
        sides = ((idx_k, gamma_k, r_k), (idx_v, gamma_v, r_v))
        group = lay.group
        obs_pos = torch.arange(S - W, S, device=k.device).repeat(group)
        u_k, u_v = self._ranking_scores(sides, k_pre, k, v, cos, sin, q.reshape(H, group * W, D),
                                        out.reshape(H, group * W, D), obs_pos, scaling)
        is_anchor = torch.zeros(H, S, dtype=torch.bool, device=k.device)
        is_anchor.scatter_(1, anchor_pos, True)
        u_k = u_k.masked_fill(is_anchor, float("-inf"))
        u_v = u_v.masked_fill(is_anchor, float("-inf"))
        self.anchors = {"anchor_k": ak.to(self.storage_dtype), "anchor_v": av.to(self.storage_dtype)}
        self.segments = [self._segment(sides, u_k, u_v, n_res)]
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
        o = self.obs
        group, rows = lay.group, o["obs_q"].shape[1]
        u_k, u_v = self._ranking_scores(sides, k_pre, k, v, cos, sin, o["obs_q"].float().reshape(H, group * rows, D),
                                        o["obs_y"].float().reshape(H, group * rows, D), o["obs_pos"].long().repeat(group),
                                        scaling, key_positions=pos, lse=o["obs_lse"].reshape(H, group * rows))
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
        out, m, l = history_and_chunk(self._segment_partials(qg, scaling), qg, k, v, scaling, lay.q_heads,
                                      self.config.attention_backend, tail=(self.tail_k, self.tail_v))
        if self.config.recompress_every:  # log-sum-exp of each query row over everything it saw,
            # for re-compression scoring (two more ops per layer and step; skipped when it is off)
            self._last_lse = ungroup_output((m + l.log()).unsqueeze(-1), lay.q_heads).squeeze(-1)
        return out.to(q.dtype)

    def stored_partials(self, qg: torch.Tensor, scaling: float) -> list:
        """Partial states of grouped queries over everything stored: the compressed segments (Triton
        kernel or PyTorch tiles, per ``attention_backend``) and the dense tail."""
        states = self._segment_partials(qg, scaling)
        if self.tail_k.shape[1]:
            states.append(dense_partial(qg, self.tail_k, self.tail_v, scaling))
        return states

    def _segment_partials(self, qg: torch.Tensor, scaling: float) -> list:
        """One partial state per compressed segment (Triton kernel or PyTorch tiles)."""
        if use_triton(self.config.attention_backend, qg.device):
            from ..attention.triton.anchor_op import anchor_partials

            return anchor_partials(self, qg, scaling)
        return anchor_tile_partials(self, qg, scaling)

    def _tile_residuals(self, segment: int, side: str, lo: int, hi: int):
        """The tile's stored residuals of one side: ``(where, rotated)`` — flat ``head * n + token``
        positions ``[N]`` (head-major, ascending) and the residuals in the codec's rotated domain
        ``[N, D]`` — or None when the tile has none. ``lo`` must be a multiple of 32."""
        H = self.layout.kv_heads
        seg = self.segments[segment]
        n = hi - lo
        # lo is a multiple of 32: the tile's bits start on a byte boundary.
        mask = unpack_bits(seg[f"mask_{side}"][:, lo // 8: (hi + 7) // 8], 1, n).bool()
        where = mask.flatten().nonzero().squeeze(-1)
        if not where.numel():
            return None
        # Slot = prefix count of the token's 32-token block + residuals before it in the block.
        padded = F.pad(mask, (0, (-n) % PREFIX_BLOCK)).reshape(H, -1, PREFIX_BLOCK).int()
        before = (padded.cumsum(-1) - padded).reshape(H, -1)[:, :n]
        blocks = seg[f"prefix_{side}"][:, lo // PREFIX_BLOCK: lo // PREFIX_BLOCK + padded.shape[1]]
        slots = (blocks.repeat_interleave(PREFIX_BLOCK, dim=1)[:, :n] + before).flatten().index_select(0, where).long()
        return where, self.residual_codec.rotated(seg[f"res_{side}"].index_select(0, slots),
                                                  seg[f"scale_{side}"].index_select(0, slots))

    def _scaled_anchors(self, segment: int, side: str, lo: int, hi: int, anchors: torch.Tensor) -> torch.Tensor:
        """``γ_t a_{i_t}`` ``[H, n, D]`` fp32 for the tile; ``anchors`` ``[H, k, D]`` fp32."""
        H, k, D = anchors.shape
        seg = self.segments[segment]
        # One flat row lookup (faster than gather with an expanded index): row h*k + index.
        rows = (seg[f"index_{side}"][:, lo:hi].long() + torch.arange(H, device=anchors.device)[:, None] * k).flatten()
        x = anchors.reshape(H * k, D).index_select(0, rows).reshape(H, hi - lo, D)
        return x.mul_(seg[f"coef_{side}"][:, lo:hi, None].float())

    def _tile_side(self, segment: int, side: str, lo: int, hi: int, anchors: torch.Tensor | None = None):
        """Reconstructed ``x̂ = γ a + r̃`` ``[H, n, D]`` fp32 of one side (keys still pre-RoPE)."""
        if anchors is None:
            anchors = self.anchors[f"anchor_{side}"].float()
        H, _, D = anchors.shape
        n = hi - lo
        x = self._scaled_anchors(segment, side, lo, hi, anchors)
        res = self._tile_residuals(segment, side, lo, hi)
        if res is not None:
            where, rotated = res
            x = x.reshape(H * n, D).index_add_(0, where, self.residual_codec.unrotate(rotated)).reshape(H, n, D)
        return x

    def tile_keys(self, segment: int, lo: int, hi: int, anchors: torch.Tensor | None = None) -> torch.Tensor:
        """Post-RoPE keys ``[H, hi − lo, D]`` fp32 of tokens ``[lo, hi)`` of a segment (``lo`` a
        multiple of 32); ``anchors``: ``anchor_k`` as fp32, when the caller converted it once."""
        start = self.segment_spans[segment][0]
        x = self._tile_side(segment, "k", lo, hi, anchors)
        cos, sin = self.layout.rope.cos_sin(torch.arange(start + lo, start + hi, device=x.device))
        return apply_rope(x, cos, sin)

    def tile_value_sum(self, segment: int, lo: int, hi: int, p: torch.Tensor,
                       anchors: torch.Tensor | None = None) -> torch.Tensor:
        """``Σ_t p[h, i, t] v̂_t`` ``[H, rows, D]`` for weights ``p [H, rows, hi − lo]``, without
        reconstructing the values: ``v̂_t = γ_t a_{i_t} + r̃_t`` is linear, so the anchor part is
        ``(Σ_{t: i_t = j} p_t γ_t) a_j`` (a scatter into k bins, then ``[rows, k] × [k, D]``), and the
        residual part sums the rotated-domain residuals and unrotates once per row."""
        if anchors is None:
            anchors = self.anchors["anchor_v"].float()
        H, rows, n = p.shape
        seg = self.segments[segment]
        weights = p * seg["coef_v"][:, lo:hi].float()[:, None, :]
        index = seg["index_v"][:, lo:hi].long()[:, None, :].expand(-1, rows, -1)
        bins = torch.zeros(H, rows, anchors.shape[1], dtype=p.dtype, device=p.device).scatter_add_(2, index, weights)
        out = torch.bmm(bins, anchors)
        res = self._tile_residuals(segment, "v", lo, hi)
        if res is not None:
            where, rotated = res
            heads = where // n
            p_res = p.permute(0, 2, 1).reshape(H * n, rows).index_select(0, where)  # [N, rows]
            counts = torch.bincount(heads, minlength=H).tolist()
            summed = torch.zeros(H, rows, anchors.shape[2], dtype=p.dtype, device=p.device)
            offset = 0
            for h, c in enumerate(counts):  # where is head-major: each head's residuals are contiguous
                if c:
                    summed[h] = p_res[offset: offset + c].T @ rotated[offset: offset + c]
                    offset += c
            out += self.residual_codec.unrotate(summed)
        return out

    def reconstruct_tile(self, segment: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values ``[H, hi − lo, D]`` fp32 of tokens ``[lo, hi)`` of a segment.

        ``lo`` must be a multiple of 32 (prefix-count blocks). Only this tile is materialised.
        """
        return self.tile_keys(segment, lo, hi), self._tile_side(segment, "v", lo, hi)

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


@dataclass
class AnchorPlusConfig(AnchorConfig):
    """AnchorKV with kvpack's two options beyond the paper on by default (``residual_pooling = 15``,
    ``narrow_index = true``); everything else as :class:`AnchorConfig`. Measured side by side with
    the faithful ``anchor`` in docs/anchorkv.md."""

    residual_pooling: int = 15
    narrow_index: bool = True


@register_codec("anchor_plus")
class AnchorKVPlus(AnchorKV):
    """``anchor`` with neighbourhood-pooled residual ranking and uint8 anchor indices (not the paper's defaults)."""

    Config = AnchorPlusConfig
