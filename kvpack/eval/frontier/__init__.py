"""The frontier's cells: an evaluation's rows pooled per (setting, method, budget), compared with FullKV
and with the best peer at equal or fewer bytes, as records a results file holds and a plot draws.

A *cell* pools every sample of one method at one budget in one setting, over all tasks and lengths
(the samples are the same for every method: one prefill per sample is shared by all of them). Per cell:

* ``score`` — the mean per-sample score with its 95% interval (Wilson when every score is 0 or 1,
  else a bootstrap over the samples);
* ``kl`` — the mean KL(FullKV ‖ method) per sample over the answer and a held-out continuation
  (teacher-forced), with a bootstrap interval; ``kl_answer`` / ``kl_continuation`` its two parts;
  ``top1`` the share of those positions where the method's most likely token is FullKV's;
* ``bytes_ratio`` — the measured bytes held ÷ dense bf16 bytes, mean over the samples;
* ``vs_full`` — the exact McNemar test on fully correct answers against FullKV on the same samples;
* ``vs_best_peer`` — against the best *peer* (transformers' ``QuantizedCache``, llama.cpp, kvpress: the
  methods users already run; :data:`PEER_FAMILIES`) whose cell holds at most as many bytes as the cell holds
  or its budget allows (within :data:`BYTES_TOLERANCE`; :func:`bytes_limit`): the highest-scoring such
  cell, ties broken by the lower KL, among those with the most samples (a peer run cut short does not rank
  on a few samples); McNemar on the shared samples and the paired mean KL difference (method − peer) with a
  bootstrap interval;
* ``best_kvpack`` / ``vs_best_kvpack`` (peer cells only) — the other way round: the resident kvpack cell
  with the lowest KL holding at most the peer's measured bytes (within :data:`BYTES_TOLERANCE`; among the
  most complete), and the same paired comparison (peer − kvpack);
* ``decode_vs_full`` — the median over samples of the row's decode ms/token ÷ FullKV's on the same
  sample, and the slowest sample's ratio: FullKV's decode timed in the row's own run (the frontier times it
  for every sample), or for rows made before that, FullKV's row of the sample where it ran on the same CPU
  (``same_run`` counts the former); ``cpus`` names the CPUs the cell's rows ran on (a table shows the ratio
  only for a cell whose rows all ran on one).

Settings are spelled as the runner's rows and the command line spell them: ``query-aware`` /
``query-agnostic`` (:data:`kvpack.eval.runner.SETTINGS`).

Files: ``families.py`` (FullKV, peers, storage codecs: who is who), ``cells.py`` (rows pooled into cells, the paired
tests), ``ranking.py`` (what compares at a budget and which is best; the packaged ranking), ``plot.py``,
``tables.py`` (the Markdown blocks).
"""

from .cells import frontier_cells
from .families import BYTES_TOLERANCE, PEER_FAMILIES, REFERENCE, SIGNIFICANCE, STORAGE_FAMILIES, is_peer, is_storage
from .plot import curve_label, plot_frontier
from .ranking import best_per_budget, bytes_limit, frontier_choices, ranked_per_budget
from .tables import (
    coverage_markdown,
    frontier_table_markdown,
    guidance_markdown,
    method_table_markdown,
    peers_vs_kvpack_markdown,
)

__all__ = ["BYTES_TOLERANCE", "PEER_FAMILIES", "REFERENCE", "SIGNIFICANCE", "STORAGE_FAMILIES", "best_per_budget",
           "bytes_limit", "coverage_markdown", "curve_label", "frontier_cells", "frontier_choices",
           "frontier_table_markdown", "guidance_markdown", "is_peer", "is_storage", "method_table_markdown",
           "peers_vs_kvpack_markdown", "plot_frontier", "ranked_per_budget"]
