"""Intervals and the paired test of the evaluation report (issue 16, part 1), against hand-computed
values and direct enumerations."""

from __future__ import annotations

import itertools
import math

import pytest

from kvpack.eval.report import paired_retention, summarize, summary_markdown
from kvpack.eval.stats import bootstrap_interval, mcnemar_exact, wilson_interval


@pytest.mark.parametrize("k,n,lo,hi", [
    (5, 10, 0.2366, 0.7634),  # the textbook case
    (0, 8, 0.0, 0.3244),  # no successes: the interval is not [0, 0]
    (8, 8, 0.6756, 1.0),
    (1, 16, 0.0111, 0.2833),
])
def test_wilson_interval_matches_known_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_mcnemar_exact_is_the_two_sided_binomial_over_discordant_pairs():
    def enumerate_p(b, c):  # P(a split at least as unbalanced as (b, c)) over all 2^n splits
        n = b + c
        if n == 0:
            return 1.0
        extreme = abs(b - c)
        hits = sum(1 for bits in itertools.product((0, 1), repeat=n) if abs(2 * sum(bits) - n) >= extreme)
        return hits / 2 ** n

    for b, c in [(8, 0), (0, 8), (3, 1), (5, 5), (6, 2), (0, 0), (10, 3)]:
        ref = [True] * b + [False] * c + [True, False] * 3
        met = [False] * b + [True] * c + [True, False] * 3  # concordant pairs do not count
        got = mcnemar_exact(ref, met)
        assert (got["only_reference"], got["only_method"]) == (b, c)
        assert got["p_value"] == pytest.approx(min(1.0, enumerate_p(b, c)), abs=1e-12)
    assert mcnemar_exact([True] * 8, [False] * 8)["p_value"] == pytest.approx(2 / 256)
    with pytest.raises(ValueError, match="same length"):
        mcnemar_exact([True], [True, False])


def test_bootstrap_interval_is_seeded_and_brackets_the_statistic():
    data = [0.0, 0.25, 0.5, 1.0, 1.0, 0.75, 0.5, 0.0]
    a = bootstrap_interval(data, lambda xs: sum(xs) / len(xs), seed=3)
    assert a == bootstrap_interval(data, lambda xs: sum(xs) / len(xs), seed=3)
    assert a[0] < sum(data) / len(data) < a[1] and 0.0 <= a[0] and a[1] <= 1.0
    assert bootstrap_interval([0.5] * 6, lambda xs: sum(xs) / len(xs)) == (0.5, 0.5)
    assert all(math.isnan(v) for v in bootstrap_interval([], lambda xs: 0.0))


def test_paired_retention_counts_only_samples_fullkv_answers():
    pairs = [(1.0, 1.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (1.0, 1.0)]
    value, ci = paired_retention(pairs)  # the method's answer where FullKV failed does not count
    assert value == pytest.approx(3 / 4) and ci == pytest.approx(wilson_interval(3, 4))
    value, ci = paired_retention([(0.5, 0.25), (1.0, 1.0), (0.75, 0.5)])  # partial credit: bootstrap
    assert value == pytest.approx(1.75 / 2.25) and ci[0] <= value <= ci[1]
    assert paired_retention([(0.0, 1.0)])[0] is None


def _rows(label, method, budget, scores, setting="query-aware"):
    return [{"setting": setting, "task": task, "length": 2048, "sample": i, "label": label, "method": method,
             "budget": budget, "score": s, "ratio": 0.25 if budget else 1.0}
            for task, task_scores in scores.items() for i, s in enumerate(task_scores)]


def test_summary_tells_a_method_that_loses_the_needles_from_one_that_keeps_them():
    full = {"niah_single_1": [1.0] * 8, "niah_single_2": [1.0] * 7 + [0.0]}
    keeps = {"niah_single_1": [1.0] * 8, "niah_single_2": [1.0] * 6 + [0.0, 1.0]}
    loses = {"niah_single_1": [0.0] * 7 + [1.0], "niah_single_2": [0.0] * 8}
    rows = _rows("full", "full", None, full) + _rows("keeps@0.25", "keeps", 0.25, keeps) + \
        _rows("loses@0.25", "loses", 0.25, loses)
    s = summarize(rows)["query-aware"]["methods"]
    assert s["keeps@0.25"]["distinguishable"] is False and s["keeps@0.25"]["mcnemar"]["p_value"] == 1.0
    assert s["loses@0.25"]["distinguishable"] is True
    assert s["loses@0.25"]["mcnemar"]["only_reference"] == 14 and s["loses@0.25"]["mcnemar"]["only_method"] == 0
    assert s["loses@0.25"]["retention"] == pytest.approx(1 / 15)
    assert s["full"]["per_task_ci"]["niah_single_1"] == pytest.approx(wilson_interval(8, 8))
    lo, hi = s["loses@0.25"]["average_ci"]
    assert (lo, hi) == pytest.approx(wilson_interval(1, 16)) and hi < s["full"]["average"]
    # Each task all right or all wrong: a bootstrap would say [0.5, 0.5]; the pooled Wilson does not.
    split = _rows("full", "full", None, {"niah_single_1": [1.0] * 8, "niah_single_2": [0.0] * 8})
    assert summarize(split)["query-aware"]["methods"]["full"]["average_ci"] == pytest.approx(wilson_interval(8, 16))
    partial = _rows("full", "full", None, {"niah_single_1": [1.0, 0.5, 0.0, 1.0], "niah_single_2": [0.25, 1.0]})
    lo, hi = summarize(partial)["query-aware"]["methods"]["full"]["average_ci"]  # partial credit: bootstrap
    assert lo < summarize(partial)["query-aware"]["methods"]["full"]["average"] < hi
    text = summary_markdown(summarize(rows))
    assert "| loses@0.25 |" in text and "**yes** (p = 0.00012; 14 vs 0)" in text
    assert "no (p = 1; 1 vs 1)" in text


def test_speed_column_is_the_median_of_paired_ratios_to_fullkv():
    scores = {"niah_single_1": [1.0] * 4}
    full, fast = _rows("full", "full", None, scores), _rows("fast@0.25", "fast", 0.25, scores)
    for r, ms in zip(full, (100.0, 100.0, 200.0, 100.0)):
        r["decode_ms"] = ms
    for r, ms in zip(fast, (50.0, 80.0, 100.0, 120.0)):  # ratios 0.5, 0.8, 0.5, 1.2
        r["decode_ms"] = ms
    fast[1]["decode_ms"] = None  # a row with no decode step after the first token: no ratio
    m = summarize(full + fast)["query-aware"]["methods"]
    assert m["fast@0.25"]["speed_vs_full"] == pytest.approx(0.5)  # median of 0.5, 0.5, 1.2
    assert m["fast@0.25"]["speed_vs_full_max"] == pytest.approx(1.2)
    assert m["fast@0.25"]["decode_ms"] == pytest.approx(100.0) and m["full"]["speed_vs_full"] == pytest.approx(1.0)
    assert "| 100.0 | 0.50x (1.20x) |" in summary_markdown(summarize(full + fast))
