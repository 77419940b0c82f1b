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
blocks, which hold ghosts in their place (:mod:`~kvpack.resident.pca_quant.salient`).

Files: ``config.py`` (the fields), ``allocation.py`` (what a width costs, the water-filling's order),
``store.py`` (:class:`PCAQuantStore`: fit, code, attend), ``layer_budgets.py`` (the per-layer budgets of a layer
profile), ``salient.py`` (the exact salient tokens).
"""

from .allocation import (
    MEASURED_BLOCKS,
    PARAM_BYTES,
    measured_blocks,
    measured_distortion,
    minmax_distortion,
    water_fill_order,
)
from .config import PCAQuantConfig
from .store import PCAQuantStore

__all__ = ["MEASURED_BLOCKS", "PARAM_BYTES", "PCAQuantConfig", "PCAQuantStore", "measured_blocks",
           "measured_distortion", "minmax_distortion", "water_fill_order"]
