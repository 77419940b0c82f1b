"""RULER's scoring: string match of the references in the prediction (case-insensitive).

``all`` (``string_match_all``): the fraction of references found — every NIAH/VT/CWE/FWE task.
``part`` (``string_match_part``): 1 if any reference is found — RULER's QA tasks.
"""

from __future__ import annotations


def string_match_all(prediction: str, references: list[str]) -> float:
    if not references:
        raise ValueError("no references to score against")
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    if not references:
        raise ValueError("no references to score against")
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


METRICS = {"all": string_match_all, "part": string_match_part}


def score(prediction: str, references: list[str], metric: str) -> float:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {sorted(METRICS)}")
    return METRICS[metric](prediction, references)
