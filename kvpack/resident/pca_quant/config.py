"""``pca_quant``'s config: its fields, their rules and defaults (the method: :mod:`kvpack.resident.pca_quant`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...attention.triton import KERNEL_CHOICES
from ...config import MethodConfig, boolean, choice, integer, number, option, text


@dataclass(frozen=True)
class PCAQuantConfig(MethodConfig):
    """Attributes:
        budget: target fraction of the dense bf16 bytes (default 0.28).
        sinks: leading tokens kept dense (attention sinks).
        residual: recent tokens kept dense at least (the tail holds up to ``residual + block - 1``).
        block: tokens coded together (one scale and zero point per component per block); a multiple of 8.
        max_bits: the widest code of a component.
        key_rope: where the keys' basis is fitted and coded: ``pre`` (keys rotated back to before RoPE),
            ``post`` (as the model hands them over), ``block`` (each key rotated back by its block's first
            position, so it keeps RoPE's rotation by its offset within the block: a block's keys share one
            rotation, and attention rotates the query back once a block and scores the keys in the basis
            without rebuilding them, as for ``post``); ``auto``: ``pre`` where the layer has RoPE.
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
        calibration: a directory holding a :class:`~kvpack.resident.pca_quant.layer_budgets.LayerProfile` of the model
            (``kvpack calibrate --method pca_quant``): each layer gets the budget
            :meth:`~kvpack.resident.pca_quant.layer_budgets.LayerProfile.allocate` gives it (their mean is at most
            ``budget``), instead of every layer ``budget``. A profile of another model is refused.
        salient: the share of the prompt's coded tokens (per KV head) kept exact beside the codes: those the
            prompt's last ``window`` queries attend to most (:mod:`~kvpack.resident.pca_quant.salient`; when the
            question ends the prompt, the tokens it reads). Their bytes come out of the budget. 0: none (the default).
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
    key_rope: str = option("auto", choice("auto", "pre", "post", "block"),
                           "basis of keys before RoPE, after it, or after their rotation within a block")
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
