"""The recommended cache: what ``method="auto"`` (and no method at all) picks, from the frontier's results.

The frontier (``benchmarks/frontier.py``) ranks every resident method at five byte budgets on two models; its
ranking ships with the package as ``kvpack/data/frontier_choices.json`` (written by ``benchmarks/render.py``
from ``benchmarks/results/frontier-*.json``, checked current in CI). :func:`recommend` reads it for caches
reused across questions (the *query-agnostic* setting: prefix caching, multi-turn, RAG — a cache built before
the question is known, which is what a cache kept and reused is):

* **the budget**: the largest budget the frontier measured at or below the one asked for (2% tolerance, as the
  frontier compares bytes); none at or below it: refused, naming the smallest measured budget;
* **a model the frontier measured** (recognised by its fingerprint): the method with the lowest mean KL to
  FullKV at that budget among the most complete cells (the frontier's own ranking);
* **any other model**: among the methods that rank first on some measured model at that budget, the one whose
  KL is closest to each model's best (the lowest geometric mean over the measured models of its KL ÷ that
  model's best KL) — the choice that holds up across the models measured;
* a method that takes a budget runs at the budget asked for; a preset whose bytes follow from its own fields
  (``kvtc_resident-8x``) runs as it is, holding at most the measured budget's bytes.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..hf.fingerprint import model_fingerprint

CHOICES_FILE = Path(__file__).resolve().parents[1] / "data" / "frontier_choices.json"
CHOICES_FORMAT = "kvpack-frontier-choices"
DEFAULT_BUDGET = 0.28  # the budget with no budget given: a quarter of the bytes, the frontier's headline
SETTING = "query-agnostic"  # caches reused for questions they were not built for (kvpack.eval.runner.SETTINGS)
BYTES_TOLERANCE = 0.02  # as the frontier's comparisons (kvpack.eval.frontier.BYTES_TOLERANCE)


@dataclass(frozen=True)
class Recommendation:
    """What ``auto`` picked and why.

    Attributes:
        method: the method or preset to run (``kvpack methods``).
        budget: the budget to run it at (None: its bytes follow from its own fields).
        measured_budget: the frontier's budget whose ranking chose it.
        model: the frontier model whose ranking chose it (None: the rule for a model the frontier has not
            measured).
        kl, score, samples: the chosen cell's mean KL to FullKV, score and sample count on that model (None for
            an unmeasured model).
        runner_up: the second-ranked method there (None: none).
        reason: one line saying all of it.
    """

    method: str
    budget: float | None
    measured_budget: float
    model: str | None
    kl: float | None
    score: float | None
    samples: int | None
    runner_up: str | None
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def announcement(self) -> str:
        """The line that says what ``auto`` picked and why (printed on stderr where it is picked)."""
        at = "" if self.budget is None else f" at {self.budget:g}"
        return f"[kvpack] method auto: {self.method}{at} — {self.reason}"

    def method_config(self) -> dict:
        """The config fields to build it with (``get_method(rec.method, **rec.method_config())``)."""
        return {} if self.budget is None else {"budget": self.budget}


@functools.lru_cache(maxsize=1)
def load_choices(path: str = str(CHOICES_FILE)) -> dict:
    """The packaged frontier ranking (``ValueError`` naming the file when it is missing or not the format)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the frontier's ranking {path} ({exc}): reinstall kvpack or name a "
                         "method") from None
    if not isinstance(data, dict) or data.get("format") != CHOICES_FORMAT or not isinstance(data.get("models"), dict):
        raise ValueError(f"{path} is not a {CHOICES_FORMAT} file: reinstall kvpack or name a method")
    return data


def _measured_budget(budgets: list[float], budget: float) -> float:
    fits = [b for b in budgets if b <= budget * (1 + BYTES_TOLERANCE)]
    if not fits:
        raise ValueError(f"no method is measured at or below a budget of {budget:g} (the smallest measured is "
                         f"{min(budgets):g}): name a method (kvpack methods) to run at {budget:g}")
    return max(fits)


def _entry(choices: dict, model: str, budget: float) -> dict | None:
    return next((b for b in choices["models"][model]["settings"].get(SETTING, []) if b["budget"] == budget), None)


def _run_budget(cell: dict, budget: float) -> float | None:
    return budget if cell["budget"] is not None else None


def _figures(cell: dict) -> str:
    return f"KL {cell['kl']:.3g}, score {cell['score']:.2f}, {cell['n']} samples"


def recommend(model=None, budget: float | None = None, *, fingerprint: dict | None = None,
              choices: dict | None = None) -> Recommendation:
    """The recommended resident method for ``model`` at ``budget`` (default :data:`DEFAULT_BUDGET`), by the rule
    of the module doc.

    Args:
        model: the transformers model (its fingerprint recognises a measured model); or give ``fingerprint``.
        budget: a fraction of the dense bf16 bytes, in (0, 1].
        choices: the ranking to read (default: the packaged one).

    Raises:
        ValueError: a budget out of range, or below every measured budget.

    Example:
        >>> import kvpack
        >>> rec = kvpack.recommend(fingerprint={"hash": "a model the frontier has not measured"}, budget=0.28)
        >>> rec.method in kvpack.available_presets() + kvpack.available_methods(), rec.measured_budget
        (True, 0.28)
    """
    budget = DEFAULT_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    choices = choices if choices is not None else load_choices()
    if fingerprint is None and model is not None:
        fingerprint = model_fingerprint(model)
    wanted = (fingerprint or {}).get("hash")
    known = next((m for m, d in choices["models"].items() if wanted and d.get("fingerprint") == wanted), None)
    if known is not None:
        budgets = [b["budget"] for b in choices["models"][known]["settings"].get(SETTING, [])]
        at = _measured_budget(budgets, budget)
        ranked = _entry(choices, known, at)["ranked"]
        best = ranked[0]
        runner = ranked[1] if len(ranked) > 1 else None
        reason = (f"the frontier's lowest KL for {known} at {at:g} of the bytes, caches reused across questions: "
                  f"{best['method']} ({_figures(best)})"
                  + (f"; runner-up {runner['method']} ({_figures(runner)})" if runner else ""))
        return Recommendation(best["method"], _run_budget(best, budget), at, known, best["kl"], best["score"],
                              best["n"], runner["method"] if runner else None, reason)
    return _recommend_unmeasured(choices, budget)


def _recommend_unmeasured(choices: dict, budget: float) -> Recommendation:
    models = [m for m, d in choices["models"].items() if d["settings"].get(SETTING)]
    if not models:
        raise ValueError("the packaged frontier ranking has no model: name a method (kvpack methods)")
    shared = set.intersection(*({b["budget"] for b in choices["models"][m]["settings"][SETTING]} for m in models))
    at = _measured_budget(sorted(shared), budget)
    entries = {m: _entry(choices, m, at)["ranked"] for m in models}
    candidates = list(dict.fromkeys(ranked[0]["method"] for ranked in entries.values()))

    def closeness(name: str) -> float:
        """Geometric mean over the models of this method's KL ÷ the model's best KL (inf: not measured on one)."""
        logs = []
        for ranked in entries.values():
            cell = next((c for c in ranked if c["method"] == name), None)
            if cell is None or cell["kl"] is None or not ranked[0]["kl"]:
                return math.inf
            logs.append(math.log(max(cell["kl"], 1e-12) / ranked[0]["kl"]))
        return math.exp(sum(logs) / len(logs))

    scored = sorted(candidates, key=lambda name: (closeness(name), name))
    best = scored[0]
    cell = next(c for ranked in entries.values() for c in ranked if c["method"] == best)
    reason = (f"a model the frontier has not measured: of the methods with the lowest KL at {at:g} of the bytes on "
              f"{', '.join(models)} (caches reused across questions), {best} is the closest to each model's best "
              f"(KL {closeness(best):.2f}x the best, geometric mean)")
    return Recommendation(best, _run_budget(cell, budget), at, None, None, None, None,
                          scored[1] if len(scored) > 1 else None, reason)


AUTO = "auto"


def resolve_auto(model, method: str | None, config: dict) -> tuple[str, dict, Recommendation | None]:
    """``(method name, its config, the recommendation)`` for a caller's ``method`` and ``config``: ``None`` or
    ``"auto"`` become :func:`recommend`'s choice at ``config["budget"]`` (default :data:`DEFAULT_BUDGET`); any
    other name is returned as it is, with no recommendation.

    Raises:
        ValueError: ``auto`` with config fields other than ``budget`` (they belong to a method it has not
            picked yet), or a budget :func:`recommend` refuses.
    """
    if method not in (None, AUTO):
        return method, config, None
    extra = sorted(k for k in config if k != "budget")
    if extra:
        raise ValueError(f"method='auto' picks the method, so it takes only a budget; got {extra}: name a method "
                         "(kvpack methods) to set its fields")
    rec = recommend(model, config.get("budget"))
    return rec.method, rec.method_config(), rec
