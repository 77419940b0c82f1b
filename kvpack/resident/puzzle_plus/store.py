"""``puzzle_plus``: PuzzleKV's pages at ranks chosen per (layer, KV head, page, side) under one
byte budget for the whole cache (beyond the paper; the faithful method is ``puzzle``).

Layout as in PuzzleKV (``kvpack.resident.puzzle``): a dense sink page, factorized pages, a dense
window page plus the page being filled. What differs:

* **ranks**: every page side gets its own rank, by greedy water-filling across every compressed
  layer (``allocation.py``, ``budget.py``): a rank's *marginal gain* is its squared singular value
  ``σ_i²`` divided by the mean energy ``‖X‖²_F`` of that (layer, KV head, side)'s pages at the
  first round — so layers and heads whose keys differ in scale compete on the share of their own
  energy they keep — optionally weighted by the observation window's attention to the page
  (``attention_weight``), per byte. Ranks are bought in steps of ``rank_step``; a rank costs
  ``(P + d)`` elements, in INT4 ``(P + d) / 2`` bytes plus one fp16 scale.
* **budget**: the whole cache (every compressed layer's sink, window, factors and rank tables) ≤
  ``budget`` × dense bf16, checked at the end of each coming page cycle; pages completed while
  decoding get the ranks of the prefill's threshold λ (fewer only if the budget needs it).
* **storage**: ragged rank buckets (``kvpack.attention.ragged_pages``), no padding; attention over
  mixed ranks in PyTorch (bucket by bucket) or in the Triton kernel (per-page ranks).
"""

from __future__ import annotations

import torch

from ...attention.ragged_pages import RaggedPuzzlePages, ragged_pages_partials
from ...attention.softmax_merge import group_queries
from ...attention.triton.puzzle_ragged_op import ragged_puzzle_partial
from ...ops.accounting import dense_bf16_bytes
from ...ops.lowrank import gram_eigh_factors
from ...ops.rope import rope_at, unrope_pages
from ..base import LayerLayout
from ..segmented import SegmentedStore, stagger_lag
from . import ragged
from .allocation import RankRequest
from .budget import WholeCacheBudget
from .config import PuzzlePlusConfig


class PuzzlePlusStore(SegmentedStore):
    """``puzzle_plus``, one sequence, one layer (see module doc).

    Held: ``sink_k/v``, ``tail_k/v`` (dense ``[H, T, d]``); per side (``k_``, ``v_``) the ragged
    factors and tables of :class:`~kvpack.attention.ragged_pages.RaggedFactors`; ``energy_scale
    [2, H]`` fp32 (the gains' per-(side, head) normaliser, fixed at the first round).

    Args:
        group: the sequence's :class:`WholeCacheBudget` (one per sequence, shared by its layers'
            stores); None = a group of this layer alone (the budget then holds per layer).
    """

    Config = PuzzlePlusConfig

    @classmethod
    def new_group(cls, layouts: list[LayerLayout], config: PuzzlePlusConfig) -> WholeCacheBudget:
        return WholeCacheBudget([lay.layer_idx for lay in layouts], config.budget)

    def __init__(self, layout: LayerLayout, config: PuzzlePlusConfig, group: WholeCacheBudget | None = None):
        super().__init__(layout, config)
        if config.key_rope == "pre" and layout.rope is None:
            raise ValueError("puzzle_plus: key_rope='pre' needs the model's rotary embedding (none was found)")
        # "auto": pre-RoPE keys where the layer has a rotary embedding, the cached keys otherwise.
        self.pre_rope = config.key_rope == "pre" or (config.key_rope == "auto" and layout.rope is not None)
        P, d = config.page_size, layout.head_dim
        self.step = config.rank_step
        if config.int4 and d % 2:
            raise ValueError(f"puzzle_plus: int4 factors need an even head_dim, got {d}")
        cap = min(P, d) if config.rank_cap is None else min(config.rank_cap, P, d)
        self.cap_steps = cap // self.step
        self.floor_steps = min(-(-config.rank_floor // self.step), self.cap_steps)
        if self.cap_steps < 1:
            raise ValueError(f"puzzle_plus: the largest rank {cap} (min of page_size, head_dim, rank_cap) is below "
                             f"rank_step {self.step}")
        # recent tokens the tail keeps beyond the window and the filling page: this layer's stagger
        self.lag = stagger_lag(layout.layer_idx, P) if config.stagger else 0
        self.share: float | None = None  # bytes / dense bytes the first round gave this layer (decode rounds keep it)
        self.group = group or WholeCacheBudget([layout.layer_idx], config.budget)
        self.group.join(layout.layer_idx, self)
        self.keys = None  # RaggedFactors of the key pages
        self.values = None
        self.energy_scale: torch.Tensor | None = None
        self.n_pages = 0
        self.pending = 0  # the oldest tail pages submitted for ranks
        self._observation: torch.Tensor | None = None
        self._decomposed = None

    # -- layout -----------------------------------------------------------------------------

    @property
    def sink_capacity(self) -> int:
        return self.config.sink_pages * self.config.page_size

    def history_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, side in (("k_", self.keys), ("v_", self.values)):
            if side is not None:
                out.update(side.tensors(prefix))
        if self.energy_scale is not None:
            out["energy_scale"] = self.energy_scale
        return out

    def resolved_params(self):
        """The ranks the whole-cache allocation chose, over every layer of this store's group:
        mean, min and max per side, each layer's mean, and the threshold λ."""
        members = [self.group.members[i] for i in self.group.layers if i in self.group.members]
        held = [m for m in members if m.keys is not None]
        if not held:
            return {}
        out = {"lambda": self.group.threshold}
        for name in ("k", "v"):
            ranks = [getattr(m, "keys" if name == "k" else "values").rank.float() for m in held]
            every = torch.cat([r.flatten() for r in ranks])
            out[f"rank_{name}_mean"] = round(float(every.mean()), 2)
            out[f"rank_{name}_min"] = int(every.min())
            out[f"rank_{name}_max"] = int(every.max())
            out[f"rank_{name}_by_layer"] = [round(float(r.mean()), 1) for r in ranks]
        return out

    # -- compression ------------------------------------------------------------------------

    def on_append(self, q, out, n_new):
        if self.config.attention_weight > 0 and self.energy_scale is None and q is not None:
            self._observation = q[:, -self.config.observation_window:].detach()

    def compress(self) -> None:
        ready = max(0, (self.tail_k.shape[1] - self.lag) // self.config.page_size - self.config.window_pages)
        if ready == 0 or self.pending:
            return
        self.pending = ready
        self.group.submit(self.layout.layer_idx)

    def _pending_pages(self) -> torch.Tensor:
        """The pending pages as fp32 ``[2 (keys, values), H, n, P, d]`` (keys pre-RoPE if so factorized)."""
        P, n, H, d = self.config.page_size, self.pending, self.layout.kv_heads, self.layout.head_dim
        k = self.tail_k[:, :n * P].float().reshape(H, n, P, d)
        v = self.tail_v[:, :n * P].float().reshape(H, n, P, d)
        if self.pre_rope:
            k = unrope_pages(self.layout.rope, k, self.tail_start)
        return torch.stack([k, v])

    def rank_request(self) -> RankRequest:
        """The pending pages' marginal gains per byte, ``[2·n·H, steps]`` in entry order (side, page,
        head), and how the store's bytes would grow (see :class:`RankRequest`)."""
        cfg, lay = self.config, self.layout
        P, n, H, d = cfg.page_size, self.pending, lay.kv_heads, lay.head_dim
        x = self._pending_pages()  # [2, H, n, P, d]
        C = min(P, d)
        left, right, sigma = gram_eigh_factors(x, C)  # [2, H, n, P, C], [2, H, n, C, d], [2, H, n, C] descending
        sigma2 = sigma.square()
        if self.energy_scale is None:  # first round: fix each (side, head)'s energy unit
            self.energy_scale = sigma2.sum(-1).mean(-1).clamp_min(1e-20).float()  # [2, H]
        gains = sigma2 / self.energy_scale[:, :, None, None].to(sigma2.dtype)
        weight = self._page_weights()
        if weight is not None:
            gains = gains * weight[None, :, :, None]
        steps = gains[..., :self.cap_steps * self.step].reshape(2, H, n, self.cap_steps, self.step).sum(-1)
        per_step = self._step_bytes()
        gains_per_byte = (steps / per_step).permute(0, 2, 1, 3).reshape(2 * n * H, self.cap_steps)
        self._decomposed = (left.permute(0, 2, 1, 3, 4).reshape(2, n * H, P, C),
                            right.permute(0, 2, 1, 3, 4).reshape(2, n * H, C, d),
                            sigma.permute(0, 2, 1, 3).reshape(2, n * H, C))
        growth = self._cycle_growth()
        fixed = self._fixed_bytes(growth)  # the same for every water level the group tries
        return RankRequest(gains_per_byte.float(), self.floor_steps, self.cap_steps,
                           lambda s: self._projected_bytes(s, fixed),
                           dense_bf16_bytes(self.seq_len + growth, H, d))

    def _step_bytes(self) -> int:
        """Bytes one rank step adds to an entry (``ragged.factor_bytes`` of a step, less its
        per-entry part)."""
        P, d, eb, int4 = self.config.page_size, self.layout.head_dim, self.storage_dtype.itemsize, self.config.int4
        return ragged.factor_bytes(torch.tensor([self.step]), P, d, eb, int4) - ragged.factor_bytes(
            torch.tensor([0]), P, d, eb, int4)

    def _page_weights(self) -> torch.Tensor | None:
        """``[H, n]`` ``(1 − a) + a · n · mass`` from the observation window's attention (first round
        only), or None."""
        a = self.config.attention_weight
        q, self._observation = self._observation, None
        if a == 0 or q is None:
            return None
        P, n, H = self.config.page_size, self.pending, self.layout.kv_heads
        keys = torch.cat([self.sink_k, self.tail_k], dim=1).float()  # [H, T, d]
        T, W = keys.shape[1], q.shape[1]
        qg = group_queries(q.float(), H)  # [H, G·W, d], rows ordered (group, window)
        logits = (qg @ keys.transpose(-1, -2)) * (self.scaling or self.layout.head_dim ** -0.5)
        position = torch.arange(T - W, T).repeat(qg.shape[1] // W)  # each row's query position
        logits = logits.masked_fill(torch.arange(T)[None, None, :] > position[None, :, None], float("-inf"))
        attn = logits.softmax(-1).mean(1)  # [H, T]
        first = self.sink_k.shape[1]
        mass = attn[:, first:first + n * P].reshape(H, n, P).sum(-1)
        mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        return (1 - a) + a * n * mass

    def _cycle_growth(self) -> int:
        """Tokens until the page cycle after this round ends (the next page completes): the store
        is largest just before it, with its window full and a page short of a token."""
        P, w = self.config.page_size, self.config.window_pages
        tail_after = self.tail_k.shape[1] - self.pending * P
        return max(0, (w + 1) * P - 1 + self.lag - tail_after)

    def _fixed_bytes(self, growth: int) -> tuple[int, tuple[set[int], set[int]]]:
        """What the store holds at the end of the coming cycle besides the pending pages' entries
        (its bytes now, less the pending pages' dense tokens, plus ``growth`` dense tokens and less
        the bucket tables the round replaces), and each side's ranks already stored."""
        P, d, H = self.config.page_size, self.layout.head_dim, self.layout.kv_heads
        token_bytes = H * 2 * d * self.storage_dtype.itemsize
        held = self.nbytes() + (growth - self.pending * P) * token_bytes
        stored = []
        for old in (self.keys, self.values):
            held -= 0 if old is None else old.bucket_table.nbytes
            stored.append(set() if old is None else {b.rank for b in old.buckets})
        return held, tuple(stored)

    def _projected_bytes(self, steps: torch.Tensor, fixed: tuple[int, tuple[set[int], set[int]]]) -> int:
        """The store's bytes at the end of the coming cycle if its pending entries keep ``steps``."""
        P, d = self.config.page_size, self.layout.head_dim
        held, stored = fixed
        ranks = steps * self.step  # [2·n·H]
        n_entries = ranks.numel() // 2
        for side in range(2):
            r = ranks[side * n_entries:(side + 1) * n_entries]
            held += ragged.factor_bytes(r, P, d, self.storage_dtype.itemsize, self.config.int4)
            held += n_entries * ragged.table_bytes_per_entry()
            held += ragged.bucket_table_bytes(len(stored[side] | set(torch.unique(r).tolist())))
        return held

    def commit(self, steps: torch.Tensor) -> None:
        """Factorize the pending pages at ``steps [2·n·H]`` rank steps (from the group's round)."""
        P, n, H = self.config.page_size, self.pending, self.layout.kv_heads
        left, right, sigma = self._decomposed
        self._decomposed = None
        ranks = (steps * self.step).reshape(2, n * H)
        sides = []
        for side, old in enumerate((self.keys, self.values)):
            encoded = ragged.encode_entries(left[side], right[side], sigma[side], ranks[side], self.storage_dtype,
                                            self.config.int4)
            sides.append(ragged.merge(old, ranks[side].reshape(n, H), encoded, P, self.layout.head_dim))
        self.keys, self.values = sides
        self.pop_tail(n * P)
        self.n_pages += n
        self.pending = 0

    # -- attention --------------------------------------------------------------------------

    def pages_view(self) -> RaggedPuzzlePages:
        cfg = self.config
        return RaggedPuzzlePages(self.sink_k, self.sink_v, self.tail_k, self.tail_v, self.keys, self.values,
                                 cfg.page_size, self.layout.head_dim, self.layout.kv_heads,
                                 self.layout.rope if self.pre_rope else None)

    def stored_partials(self, qg, scaling):
        backend = self.backend(qg.device)
        if self.n_pages and backend == "triton":
            return [ragged_puzzle_partial(self.pages_view(), qg, scaling)]
        if self.n_pages and backend == "native":
            return [ragged_puzzle_partial(self.pages_view(), qg, scaling, native=True,
                                          dot_precision=self.config.dot_precision)]
        return super().stored_partials(qg, scaling)

    def history_partials(self, qg, scaling):
        return ragged_pages_partials(self.pages_view(), qg, scaling)

    def history_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.n_pages:
            return self.empty_history()
        k, v = self.pages_view().dense_pages()
        return (rope_at(self.layout.rope, k, self.sink_k.shape[1]) if self.pre_rope else k), v
