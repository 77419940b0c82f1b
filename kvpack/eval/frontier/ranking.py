"""How the frontier ranks: which cells compare at a budget (bytes within a tolerance, the most complete), the
best first by mean KL; the packaged ranking the default method reads (:func:`frontier_choices`)."""

from __future__ import annotations

from ...methods.recommend import CHOICES_FORMAT
from ..runner import SETTINGS
from .families import BYTES_TOLERANCE, REFERENCE, is_storage


def most_complete(cells: list[dict]) -> list[dict]:
    """The cells with as many samples as the most complete of them: a cell whose rows are still coming in (a
    peer run cut short after a few samples) does not rank against complete ones on a handful of samples."""
    most = max((c["n"] for c in cells), default=0)
    return [c for c in cells if c["n"] == most]


def bytes_limit(measured: float, target: float | None) -> float:
    """The most bytes (÷ dense bf16) a cell compared with "at equal or fewer bytes" may hold: the larger of the
    ``measured`` bytes and the ``target`` budget (None: a method set by its own parameters), plus
    :data:`BYTES_TOLERANCE`.

    The target counts so that a method coming in under the bytes it was asked for still meets the peers at
    those bytes, and so that one method at one target meets the same peers in both settings: its measured
    bytes differ between them in the fourth decimal (0.2756 and 0.2758 at a 0.28 target put a 0.2812 peer on
    either side of a limit taken from the measured bytes alone)."""
    return max(measured, target if target is not None else 0.0) * (1 + BYTES_TOLERANCE)


def best_peer(cell: dict, peers: list[dict]) -> dict | None:
    """The highest-scoring peer cell (then the lower KL) within the cell's :func:`bytes_limit`, among the most
    complete such cells (:func:`most_complete`)."""
    if cell["bytes_ratio"] is None or cell["peer"]:
        return None
    limit = bytes_limit(cell["bytes_ratio"], cell["budget"])
    fits = most_complete([p for p in peers if p["bytes_ratio"] is not None and p["bytes_ratio"] <= limit])
    if not fits:
        return None
    return max(fits, key=lambda p: (p["score"], -(p["kl"] if p["kl"] is not None else float("inf"))))


def best_kvpack(peer: dict, own: list[dict]) -> dict | None:
    """The resident kvpack cell with the lowest KL (then the higher score) holding at most the peer cell's
    measured bytes (+ :data:`BYTES_TOLERANCE`), among the most complete such cells: what kvpack offers a user
    of that peer at no more memory. A peer has no budget target here (kvpress's kept share is not a byte
    target), so only its measured bytes count."""
    if peer["bytes_ratio"] is None:
        return None
    return lowest_kl_within(own, bytes_limit(peer["bytes_ratio"], None))


def lowest_kl_within(cells: list[dict], limit: float) -> dict | None:
    """The cell with the lowest KL (then the higher score, :func:`kl_first`) among the most complete of
    ``cells`` holding at most ``limit`` of the bytes (:func:`most_complete`); None when none does."""
    fits = most_complete([c for c in cells if c["bytes_ratio"] is not None and c["bytes_ratio"] <= limit])
    return min(fits, key=kl_first) if fits else None


def kl_first(c: dict) -> tuple:
    """Ranking key: the lower mean KL first (the finer measure: a cell's score interval is wide), then the
    higher score; a cell without KL (llama.cpp's) ranks after every cell with one."""
    return (c["kl"] is None, c["kl"] if c["kl"] is not None else 0.0, -(c["score"] or 0.0))


def ranked_per_budget(cells: list[dict], setting: str, budget: float) -> list[dict]:
    """The resident kvpack cells (not FullKV, not a peer, not a storage codec) at a budget, best first: those at
    that target — or, for a method set by its own parameters rather than a target (``kvtc_resident``'s ratio,
    PuzzleKV's INT4 paper setting), holding at most the target's bytes — among the cells with as many samples as
    the most complete one (:func:`most_complete`), by the lower mean KL, then the higher score (:func:`kl_first`)."""

    def at_target(c: dict) -> bool:
        if c["budget"] is None:
            return c["bytes_ratio"] is not None and c["bytes_ratio"] <= budget
        return c["budget"] == budget

    own = [c for c in cells if c["setting"] == setting and at_target(c) and not c["peer"]
           and c["family"] != REFERENCE and not is_storage(c) and c["n"]]
    return sorted(most_complete(own), key=kl_first)


def best_per_budget(cells: list[dict], setting: str, budget: float) -> tuple[dict | None, dict | None, dict | None]:
    """``(best resident kvpack cell, best storage cell, best peer cell)`` at a budget: the resident kvpack
    method (not FullKV, not a peer) at that target — or, for one set by its own parameters rather than a
    target (``kvtc_resident``'s ratio, PuzzleKV's INT4 paper setting), holding at most the target's bytes —
    with the lowest mean KL (then the higher score), among the cells with as many samples as the most
    complete one (a method whose rows are still coming in does not rank on fewer samples); the storage codec
    and the peer with the lowest KL within :func:`bytes_limit` of that cell's measured bytes and the budget,
    each by the same rule (:func:`most_complete`)."""
    ranked = ranked_per_budget(cells, setting, budget)
    if not ranked:
        return None, None, None
    best = ranked[0]
    limit = bytes_limit(best["bytes_ratio"], budget)

    def fitting(pred):
        return lowest_kl_within([c for c in cells if c["setting"] == setting and c["n"] and pred(c)], limit)

    return best, fitting(is_storage), fitting(lambda c: c["peer"])


def _choice(c: dict | None) -> dict | None:
    """What a choice records of a cell: its name (a method or preset), budget target, KL, score, bytes, samples."""
    if c is None:
        return None
    return {"method": c["method"], "budget": c["budget"], "kl": c["kl"], "kl_ci": c["kl_ci"], "score": c["score"],
            "score_ci": c["score_ci"], "bytes_ratio": c["bytes_ratio"], "n": c["n"]}


def frontier_choices(records: dict[str, dict], fingerprints: dict[str, str | None]) -> dict:
    """The frontier's ranking as the data kvpack's default reads (``kvpack/data/frontier_choices.json``): per
    model (with its fingerprint hash, to recognise it), setting and budget, the resident kvpack cells best first
    (:func:`ranked_per_budget`), the best storage codec and the best peer at no more bytes, FullKV's score."""
    models = {}
    for model, data in records.items():
        settings = {}
        for setting in SETTINGS:
            full = next((c for c in data["cells"] if c["setting"] == setting and c["family"] == REFERENCE), None)
            budgets = []
            for budget in data["budgets"]:
                ranked = ranked_per_budget(data["cells"], setting, budget)
                if not ranked:
                    continue
                _, storage, peer = best_per_budget(data["cells"], setting, budget)
                budgets.append({"budget": budget, "ranked": [_choice(c) for c in ranked],
                                "storage": _choice(storage), "peer": _choice(peer),
                                "full_score": None if full is None else full["score"]})
            settings[setting] = budgets
        models[model] = {"fingerprint": fingerprints.get(model), "settings": settings}
    return {"format": CHOICES_FORMAT, "version": 1, "source": "benchmarks/results/frontier-*.json", "models": models}
