"""AnchorKV's configuration: the paper's parameters, its ablation switches (Fig. 5) and three options
beyond the paper (``anchor_plus`` turns them on)."""

from __future__ import annotations

from dataclasses import dataclass

from ...attention.anchor import PREFIX_BLOCK
from ...attention.triton import KERNEL_CHOICES
from ...config import MethodConfig, boolean, choice, integer, number, option
from ...ops.residual_codec import RESIDUAL_CODECS

RANKINGS = ("utility", "attention", "residual_norm", "cosine", "random")
RESIDUAL_SPLITS = ("pooled", "per_head")
ABOVE_SATURATION = ("idle", "anchors", "residual4")


@dataclass(frozen=True)
class AnchorConfig(MethodConfig):
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
            CUDA tensors when Triton is installed, the native CPU kernel for CPU tensors where it is
            built, else PyTorch), ``triton`` (always; CPU only under ``TRITON_INTERPRET=1``), ``native``
            or ``torch`` (the reference).

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

    Beyond the paper (off by default; described in docs/methods/anchorkv.md):
        residual_pooling: odd window of a max-pool over each head's ranking scores along the
            sequence before the top-N choice (1 = off), so the neighbours of a token the
            observation queries use — the digits after a needle's key, which later decode steps
            copy — compete with its score.
        narrow_index: store the per-token anchor indices as uint8 when ``k ≤ 256`` (int16
            otherwise); the byte saved per token and side buys residuals.
        above_saturation: what a budget beyond the 2-bit saturation point (a residual for every
            non-anchor token-side) buys: ``idle`` (the paper: nothing, the bytes stay unspent),
            ``anchors`` (more anchors — more tokens stored exactly — until the budget is spent;
            ``budget.anchors_above_saturation``; applies when ``anchors`` is unset) or
            ``residual4`` (a fine tier: the highest-ranked token-sides get a 4-bit residual instead
            of a 2-bit one, same rotation, 16 Lloyd–Max levels, ``budget.fine_residual_slots``;
            once every token-side has one, more anchors when ``anchors`` is unset; with
            ``residuals = false`` there is nothing to upgrade and it has no effect).
    """

    budget: float | None = option(0.1, number(0.0, 1.0, low_open=True), "the retain fraction θ")
    window: int = option(32, integer(minimum=1), "W: last positions, always anchors; the observation queries")
    anchors: int | None = option(None, integer(minimum=1, optional=True), "k anchors per KV head (none: S/128, >= W)")
    anchor_fraction: float = option(1 / 128, number(0.0, 1.0, low_open=True), "the S/128 of the default k")
    rho: float = option(0.7, number(0.0, 1.0), "share of the non-window anchors chosen by score")
    kernel: int = option(7, integer(minimum=1), "κ, the (odd) pooling kernel of the scores")
    tile: int = option(1024, integer(minimum=PREFIX_BLOCK, multiple_of=PREFIX_BLOCK), "tokens per attention tile")
    recompress_every: int | None = option(None, integer(minimum=PREFIX_BLOCK, optional=True),
                                          "compress the generated tail every N tokens (beyond the paper)")
    attention_backend: str = option("auto", choice(*KERNEL_CHOICES), "attention over the compressed segments")
    ranking: str = option("utility", choice(*RANKINGS), "what ranks the residual candidates")
    random_anchors: bool = option(True, boolean(), "false: every non-window anchor by score")
    residual_split: str = option("pooled", choice(*RESIDUAL_SPLITS), "residuals pooled over heads or per head")
    residuals: bool = option(True, boolean(), "false: the budget buys anchors only")
    residual_codec: str = option("hadamard_lloyd_max", choice(*RESIDUAL_CODECS), "2-bit residual codec")
    residual_pooling: int = option(1, integer(minimum=1, odd=True), "max-pool window of the ranking (1 = off)")
    narrow_index: bool = option(False, boolean(), "uint8 anchor indices when k <= 256")
    above_saturation: str = option("idle", choice(*ABOVE_SATURATION),
                                   "what budget past the 2-bit saturation point buys (idle: nothing)")

    def check(self) -> None:
        if self.anchors is not None and self.anchors < self.window:
            raise self.error(f"anchors (k = {self.anchors}) must be >= window (W = {self.window})")
        if self.kernel % 2 == 0:
            raise self.error(f"kernel (κ) must be odd, got {self.kernel}")
        if not self.residuals and self.anchors is not None:
            raise self.error("anchors must be unset when residuals=false: the budget decides how many anchors it buys")


@dataclass(frozen=True)
class AnchorPlusConfig(AnchorConfig):
    """AnchorKV with kvpack's options beyond the paper on by default (``residual_pooling = 15``,
    ``narrow_index = true``, ``above_saturation = "residual4"``); everything else as
    :class:`AnchorConfig`. Its frontier rows sit beside the faithful ``anchor``'s in docs/methods/anchorkv.md.

    ``residual4`` over ``anchors`` by measurement (SmolLM2, 2K, NIAH single 1/2 and multikey 1, 8
    samples each, both settings): the answer's KL to FullKV was lower in 44/48 paired samples at 0.5
    (0.002–0.003 vs 0.08–0.10) and in 36/48 at 0.25; it answered where ``anchors`` did not in 11
    samples at 0.25 (the reverse in 1) and 6 at 0.5 (the reverse in 2)."""

    residual_pooling: int = option(15, integer(minimum=1, odd=True), "max-pool window of the ranking (1 = off)")
    narrow_index: bool = option(True, boolean(), "uint8 anchor indices when k <= 256")
    above_saturation: str = option("residual4", choice(*ABOVE_SATURATION),
                                   "what budget past the 2-bit saturation point buys (idle: nothing)")
