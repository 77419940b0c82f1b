"""Evaluation harness: task generators, scorers, the runner end to end on a tiny model, resume."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from kvpack.eval.report import write_report
from kvpack.eval.runner import EvalPlan, MethodSpec, method_specs, rows_in_plan, run_eval
from kvpack.eval.scoring import score, string_match_all, string_match_part
from kvpack.eval.tasks import NIAH_TASKS, RULER_TASKS, make_sample


@pytest.fixture(scope="module")
def tokenizer():
    from kvpack.hf.models import load_tokenizer

    return load_tokenizer("smollm2")


def _tokens(tok, s):
    return len(tok(s.context + s.question).input_ids)


# ------------------------------------------------------------------------------------------------
# Generators
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_length_within_two_percent(tokenizer, task, length):
    s = make_sample(tokenizer, task, length, 0, 3)
    assert abs(_tokens(tokenizer, s) - length) <= 0.02 * length
    assert s.tokens == _tokens(tokenizer, s)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_same_seed_same_sample_other_seed_other_sample(tokenizer, task):
    a = make_sample(tokenizer, task, 2048, 1, 3, seed=0)
    b = make_sample(tokenizer, task, 2048, 1, 3, seed=0)
    c = make_sample(tokenizer, task, 2048, 1, 3, seed=1)
    d = make_sample(tokenizer, task, 2048, 2, 3, seed=0)
    assert a.to_dict() == b.to_dict()
    assert c.answers != a.answers and d.answers != a.answers


def _needle_lines(context):
    return re.findall(r"One of the special magic (?:number|uuid) for (\S+) is: (\S+)\.", context)


@pytest.mark.parametrize("task", NIAH_TASKS)
@pytest.mark.parametrize("index", [0, 2])
def test_niah_answers_exactly_where_intended(tokenizer, task, index):
    s = make_sample(tokenizer, task, 2048, index, 3)
    needles = _needle_lines(s.context)
    query = re.search(r"magic \w+ for (.+) mentioned in the provided text\?", s.question).group(1)
    queried = [k.strip() for k in re.split(r", | and ", query)]
    for answer in s.answers:
        assert s.context.count(answer) == 1  # each value stated once, nowhere else
        assert s.question.count(answer) == 0
    target = [(k, v) for k, v in needles if k in queried]
    assert sorted(v for _, v in target) == sorted(s.answers)  # the queried keys hold exactly the answers
    for k, v in needles:
        if k not in queried:  # distractors: other keys, never overlapping a queried key, other values
            assert all(k not in q and q not in k for q in queried) and v not in s.answers
    expect = {"niah_multivalue": (1, 4), "niah_multiquery": (4, 4)}.get(task, (1, 1))
    assert (len(queried), len(s.answers)) == expect
    if task == "niah_multikey_1":
        assert len(needles) == 4
    if task in ("niah_multikey_2", "niah_multikey_3"):
        assert len(needles) > 20  # the haystack is made of distractor needles
    # The first target statement sits at the swept depth of the context.
    first = s.context.index(f"for {queried[0]} is: {s.answers[0]}")
    body = s.context.index("\n") + 1
    assert abs((first - body) / (len(s.context) - body) - s.depth) < 0.08


def test_vt_chain_and_distractor(tokenizer):
    s = make_sample(tokenizer, "vt", 2048, 1, 3)
    value = re.search(r"assigned the value (\d+) in", s.question).group(1)
    assigns = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", s.context))
    assert s.context.count(value) == 1
    chain, frontier = set(), {v for v, rhs in assigns.items() if rhs == value}
    while frontier:
        chain |= frontier
        frontier = {v for v, rhs in assigns.items() if rhs.removeprefix("VAR ") in frontier} - chain
    assert chain == set(s.answers) and len(s.answers) == 5
    assert len(assigns) == 10  # plus one distractor chain of 5 with another value
    others = [rhs for rhs in assigns.values() if rhs.isdigit() and rhs != value]
    assert len(others) == 1


def test_cwe_and_fwe_frequencies(tokenizer):
    s = make_sample(tokenizer, "cwe", 2048, 0, 3)
    words = re.findall(r"\d+\. (\w+)", s.context)
    counts = Counter(words)
    assert all(counts[w] == 30 for w in s.answers)
    assert all(c == 3 for w, c in counts.items() if w not in s.answers)
    f = make_sample(tokenizer, "fwe", 2048, 0, 3)
    counts = Counter(f.context.split("\n", 1)[1].split()).most_common(4)
    assert [w for w, _ in counts[:3]] == f.answers and counts[2][1] > counts[3][1]


def test_passkey_is_64_digits_stated_only_by_its_needle(tokenizer):
    s = make_sample(tokenizer, "passkey", 2048, 0, 4)
    key = s.answers[0]
    assert re.fullmatch(r"\d{64}", key)
    assert s.context.count(key) == 2  # "The pass key is K. Remember it. K is the pass key."
    assert s.context.count("The pass key is") == 1


def test_unknown_task_refused(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        make_sample(tokenizer, "qa_squad", 1024, 0, 1)


# ------------------------------------------------------------------------------------------------
# Scorers
# ------------------------------------------------------------------------------------------------


def test_scorers_on_hand_written_cases():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The numbers are 123.", ["123", "456"]) == 0.5
    assert string_match_all("nothing", ["123"]) == 0.0
    assert string_match_all("ABC-Def", ["abc-def"]) == 1.0  # case-insensitive
    assert string_match_part("it is 456", ["123", "456"]) == 1.0
    assert string_match_part("it is 789", ["123", "456"]) == 0.0
    assert score("x 1 y", ["1", "2", "3", "4"], "all") == 0.25
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], "exact")
    with pytest.raises(ValueError, match="references"):
        string_match_all("x", [])


# ------------------------------------------------------------------------------------------------
# Runner end to end on a tiny random model (with the real tokenizer's vocabulary)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def _plan(calibration_dir, **kw):
    specs = method_specs(["full", "streaming", "puzzle", "kivi"], [0.5, 0.05],
                         {"puzzle": {"page_size": 16}})
    specs.append(MethodSpec("kvtc", None, {"calibration": calibration_dir, "ratio": 4.0}))
    return EvalPlan(tasks=["niah_single_1", "vt"], lengths=[256], samples=2, specs=specs,
                    settings=["query-aware", "query-agnostic"], **kw)


@pytest.fixture(scope="module")
def tiny_calibration(tiny_model, tmp_path_factory):
    from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 1000, (96,), generator=g) for _ in range(4)]
    calib = calibrate(tiny_model, None, CalibrationSettings(tokens=384, chunk_tokens=96, sinks=2, window=8, pca_dim=32,
                                                            dp_samples=256, ratios=(4,)), chunks=chunks, progress=False)
    return str(calib.save(tmp_path_factory.mktemp("tinycal") / "c"))


def test_runner_end_to_end_and_resume(tiny_model, tokenizer, tiny_calibration, tmp_path, monkeypatch):
    plan = _plan(tiny_calibration)
    rows = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False)
    n_specs = len(plan.specs)
    assert n_specs == 1 + 3 * 2 + 1
    assert len(rows) == 2 * 1 * 2 * n_specs * 2
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(rows)
    need = {"task", "length", "depth", "method", "config", "ratio", "prediction", "answers", "score", "compress_s",
            "decode_s", "kv_bytes", "dense_kv_bytes", "kl_answer", "kl_continuation", "kl", "top1",
            "ppl_continuation"}
    ok = [r for r in rows if r.get("error") is None]
    assert all(need <= set(r) for r in ok)
    refused = [r for r in rows if r.get("error")]
    # Budgets below a codec's fixed cost are refused and recorded, not crashed on: KIVI's and
    # PuzzleKV's at 5% (their dense/scale regions alone exceed it); StreamingLLM just keeps fewer.
    assert {r["method"] for r in refused} == {"kivi", "puzzle"}
    assert all(r["budget"] == 0.05 and "budget" in r["error"] and r["score"] is None for r in refused)
    for r in ok:
        if r["method"] == "full":
            # FullKV keeps the fp32 model's own cache: twice the bf16 reference.
            assert r["kl_answer"] == pytest.approx(0.0, abs=1e-6) and r["ratio"] == pytest.approx(2.0)
            assert r["kl"] == pytest.approx(0.0, abs=1e-6) and r["top1"] == 1.0
        else:
            assert r["ratio"] < 1.0 and r["kl_answer"] >= -1e-6 and r["kl_continuation"] >= -1e-6
            assert min(r["kl_answer"], r["kl_continuation"]) - 1e-6 <= r["kl"] <= max(r["kl_answer"],
                                                                                    r["kl_continuation"]) + 1e-6
            assert 0.0 <= r["top1"] <= 1.0
        assert r["ppl_continuation"] > 1.0
        assert r["config"]["version"] >= 1
        if r["method"] == "puzzle":
            assert r["config"]["rank_k"] >= 1  # the ranks the budget resolved to
        if r["method"] == "kvtc":
            assert len(r["config"]["calibration_id"]) == 24
    kvtc_rows = [r for r in ok if r["method"] == "kvtc"]
    assert kvtc_rows and all(r["kv_bytes"] > 0 for r in kvtc_rows)
    agnostic = next(r for r in ok if r["setting"] == "query-agnostic")
    aware = next(r for r in ok if r["setting"] == "query-aware" and r["task"] == agnostic["task"]
                 and r["sample"] == agnostic["sample"])
    assert agnostic["compressed_tokens"] < aware["compressed_tokens"] == aware["prompt_tokens"] - 1

    from kvpack.eval.runner import rows_in_plan

    narrower = EvalPlan(tasks=["vt"], lengths=[256], samples=2, specs=plan.specs[:2], settings=["query-aware"])
    assert {(r["task"], r["method"]) for r in rows_in_plan(rows, narrower)} == {("vt", "full"), ("vt", "streaming")}
    assert len(rows_in_plan(rows, plan)) == len(rows)
    summary = write_report(rows, tmp_path)
    for name in ("summary.json", "summary.md", "score_vs_ratio.png", "heatmap_query-aware.png",
                 "heatmap_query-agnostic.png"):
        assert (tmp_path / name).stat().st_size > 0
    s = summary["query-aware"]["methods"]
    assert s["full"]["retention"] in (None, 1.0) and s["kivi@0.05"]["refused"] == 4
    assert json.loads((tmp_path / "summary.json").read_text())["query-aware"]["tasks"] == ["niah_single_1", "vt"]

    # Resume: nothing is recomputed (no prefill happens), nothing is appended.
    import kvpack.eval.runner as runner

    def no_prefill(*a, **k):
        raise AssertionError("a finished sample was prefilled again")

    monkeypatch.setattr(runner, "exact_prefill", no_prefill)
    again = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False)
    assert len(again) == len(rows) and (tmp_path / "results.jsonl").read_text().splitlines() == lines
    monkeypatch.undo()
    # A run cut short (torn last line) recomputes exactly the missing row.
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    final = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False)
    assert len(final) == len(rows)
    last = json.loads(lines[-1])
    redo = [r for r in final if (r["setting"], r["task"], r["sample"], r["method"], r["budget"]) ==
            (last["setting"], last["task"], last["sample"], last["method"], last["budget"])]
    assert len(redo) == 1 and redo[0].get("prediction") == last.get("prediction")


def test_rows_split_by_method_resume_like_one_file(tiny_model, tokenizer, tmp_path, monkeypatch):
    """``rows_by_method``: one ``rows/<name>.jsonl`` per method name (a named variant in its own), read back by
    ``load_results``; a rerun recomputes nothing; a torn last line stays a line of its own, and only its row
    is computed again."""
    from kvpack.eval.runner import MethodSpec, has_results, load_results

    specs = [*method_specs(["full", "streaming"], [0.5], {}),
             MethodSpec("streaming", 0.5, {"sink_tokens": 2}, name="streaming-2sinks")]
    plan = EvalPlan(tasks=["vt"], lengths=[256], samples=1, specs=specs, settings=["query-aware"], fidelity=False)
    assert not has_results(tmp_path)
    rows = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False, rows_by_method=True)
    files = sorted(p.name for p in (tmp_path / "rows").iterdir())
    assert files == ["full.jsonl", "streaming-2sinks.jsonl", "streaming.jsonl"]
    assert not (tmp_path / "results.jsonl").exists()
    assert has_results(tmp_path) and sorted(map(json.dumps, load_results(tmp_path))) == sorted(map(json.dumps, rows))
    import kvpack.eval.runner as runner

    monkeypatch.setattr(runner, "exact_prefill", lambda *a, **k: pytest.fail("a finished sample was prefilled"))
    assert len(run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False, rows_by_method=True)) == len(rows)
    monkeypatch.undo()
    path = tmp_path / "rows" / "streaming.jsonl"
    line = path.read_text()
    path.write_text(line[:20])  # an interrupted write
    again = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False, rows_by_method=True)
    assert len(again) == len(rows) and path.read_text().splitlines()[0] == line[:20]
    assert [json.loads(x)["method"] for x in path.read_text().splitlines()[1:]] == ["streaming"]
    assert len(load_results(tmp_path)) == len(rows)


def test_reference_timing_is_fullkv_decode_of_the_same_sample_in_the_same_run(tiny_model, tokenizer, tmp_path,
                                                                               monkeypatch):
    """``reference_timing``: every row carries FullKV's decode ms/token of its sample timed in its run — FullKV's own
    row's when FullKV runs too (nothing timed twice), else one FullKV decode per sample that its rows share."""
    import kvpack.eval.runner as runner

    specs = method_specs(["full", "streaming"], [0.5, 0.25], {})
    plan = EvalPlan(tasks=["vt"], lengths=[256], samples=2, specs=specs, settings=["query-aware"], fidelity=False,
                    reference_timing=True)
    monkeypatch.setattr(runner, "_reference_decode_ms", lambda *a: pytest.fail("FullKV's decode timed twice"))
    rows = run_eval(tiny_model, tokenizer, plan, tmp_path / "with-full", progress=False)
    for sample in (0, 1):
        mine = [r for r in rows if r["sample"] == sample]
        full = next(r for r in mine if r["method"] == "full")
        assert len(mine) == 3 and full["decode_ms"] > 0
        assert all(r["reference_decode_ms"] == full["decode_ms"] for r in mine)
    monkeypatch.undo()
    calls = []
    timed = runner._reference_decode_ms
    monkeypatch.setattr(runner, "_reference_decode_ms", lambda *a: calls.append(1) or timed(*a))
    later = EvalPlan(**{**plan.__dict__, "specs": specs[1:]})  # FullKV's rows made by an earlier run
    rows = run_eval(tiny_model, tokenizer, later, tmp_path / "without-full", progress=False)
    assert len(rows) == 4 and len(calls) == 2  # once per sample
    for sample in (0, 1):
        times = {r["reference_decode_ms"] for r in rows if r["sample"] == sample}
        assert len(times) == 1 and next(iter(times)) > 0
    plain = run_eval(tiny_model, tokenizer, EvalPlan(**{**later.__dict__, "reference_timing": False}),
                     tmp_path / "plain", progress=False)
    assert len(calls) == 2 and not any("reference_decode_ms" in r for r in plain)


@pytest.mark.parametrize("fidelity", [True, False])
def test_a_length_that_does_not_fit_the_context_is_refused_before_anything_runs(tiny_model, tokenizer, tmp_path,
                                                                                fidelity):
    """The tiny model's context is 2,048 tokens: prompts of 2,048 leave no room for the answer. The run is
    refused up front (no row, no prefill), naming the longest length that fits — which then runs."""
    plan = EvalPlan(tasks=["niah_single_1"], lengths=[2048], samples=1, specs=method_specs(["full"], [0.5], {}),
                    settings=["query-aware"], fidelity=fidelity)
    with pytest.raises(ValueError, match=r"--lengths 2048: niah_single_1's prompts of up to \d+ tokens .* exceed "
                                         r"the model's context of 2048 tokens; use a length of at most (\d+)") as err:
        run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False)
    assert not (tmp_path / "results.jsonl").exists()
    fits = int(re.search(r"at most (\d+)", str(err.value)).group(1))
    rows = run_eval(tiny_model, tokenizer, EvalPlan(**{**plan.__dict__, "lengths": [fits]}), tmp_path, progress=False)
    assert len(rows) == 1 and rows[0].get("error") is None and rows[0]["score"] is not None


def test_resume_computes_again_under_other_overrides(tiny_model, tokenizer, tmp_path):
    """Rows are keyed by their config overrides too: rerunning a method with other ``--set`` values
    in the same directory computes it again, and the plan's rows are the new ones."""
    def plan(overrides):
        return EvalPlan(tasks=["niah_single_2"], lengths=[200], samples=1, fidelity=False,
                        specs=method_specs(["snapkv"], [0.5], overrides))

    first = run_eval(tiny_model, tokenizer, plan({}), tmp_path, progress=False)
    second = run_eval(tiny_model, tokenizer, plan({"snapkv": {"kernel": 3}}), tmp_path, progress=False)
    assert len(first) == 1 and len(second) == 2  # computed again, appended
    assert second[1]["overrides"] == {"kernel": 3} and second[1]["config"]["kernel"] == 3
    assert rows_in_plan(second, plan({"snapkv": {"kernel": 3}})) == [second[1]]
    again = run_eval(tiny_model, tokenizer, plan({}), tmp_path, progress=False)
    assert len(again) == 2  # the first configuration's row is still there: nothing recomputed


def test_deterministic_predictions(tiny_model, tokenizer, tmp_path):
    plan = EvalPlan(tasks=["niah_single_2"], lengths=[200], samples=1, specs=method_specs(["full", "snapkv"], [0.5]),
                    fidelity=False)
    a = run_eval(tiny_model, tokenizer, plan, tmp_path / "a", progress=False)
    b = run_eval(tiny_model, tokenizer, plan, tmp_path / "b", progress=False)
    assert [r["prediction"] for r in a] == [r["prediction"] for r in b]


@pytest.mark.parametrize("kwargs,match", [
    ({"tasks": ["nope"]}, "unknown task"), ({"settings": ["online"]}, "unknown setting"),
    ({"samples": 0}, "samples"), ({"lengths": [10]}, "lengths"),
])
def test_bad_plans_refused(kwargs, match):
    base = {"tasks": ["vt"], "lengths": [256], "samples": 1, "specs": method_specs(["full"], [])}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        EvalPlan(**base)


def test_unknown_method_refused_before_running():
    with pytest.raises(ValueError, match="unknown method"):
        EvalPlan(tasks=["vt"], lengths=[256], samples=1, specs=method_specs(["full", "magic"], [0.5]))


def test_one_model_run_per_sample_gives_the_rows_of_separate_runs(tiny_model, tokenizer, tmp_path, monkeypatch):
    """Issue 16: with both settings, the query-agnostic prefill is cut from the query-aware one (one
    model run per sample); its rows equal those of a run of the query-agnostic setting alone."""
    import kvpack.eval.runner as runner
    from kvpack.hf.prefill import exact_prefill

    calls = []

    def counted(model, ids):
        calls.append(len(ids))
        return exact_prefill(model, ids)

    monkeypatch.setattr(runner, "exact_prefill", counted)
    specs = method_specs(["full", "streaming", "puzzle"], [0.5], {"puzzle": {"page_size": 16}})
    both = run_eval(tiny_model, tokenizer, EvalPlan(tasks=["niah_single_1"], lengths=[256], samples=2, specs=specs,
                                                    settings=["query-aware", "query-agnostic"]),
                    tmp_path / "both", progress=False)
    assert len(calls) == 2  # one per sample (before: one per sample and setting)
    alone = run_eval(tiny_model, tokenizer, EvalPlan(tasks=["niah_single_1"], lengths=[256], samples=2, specs=specs,
                                                     settings=["query-agnostic"]), tmp_path / "alone", progress=False)
    shared = [r for r in both if r["setting"] == "query-agnostic"]
    keep = ("sample", "method", "budget", "prediction", "kv_bytes", "score")
    assert [{k: r[k] for k in keep} for r in shared] == [{k: r[k] for k in keep} for r in alone]
    # matmuls over 255 vs 240 rows round differently in the last bits: the fidelity figures agree
    # to rounding (ExactPrefill.leading)
    for a, b in zip(shared, alone):
        assert a["kl_answer"] == pytest.approx(b["kl_answer"], abs=1e-6)
        assert a["ppl_continuation"] == pytest.approx(b["ppl_continuation"], rel=1e-4)


def test_prefill_cut_equals_a_prefill_of_the_leading_tokens(tiny_model):
    from kvpack.hf.prefill import exact_prefill

    ids = torch.randint(0, 1000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    whole, part = exact_prefill(tiny_model, ids), exact_prefill(tiny_model, ids[:61])
    cut = whole.leading(61)
    assert cut.token_ids == ids[:61] and cut.seconds == 0.0
    for i, tensors in part.layers.items():
        for got, want in zip(cut.layers[i][:4], tensors[:4]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert whole.leading(0) is None and whole.leading(91) is None


def test_greedy_stops_once_asked(tiny_model, tokenizer):
    from kvpack.hf.dense import new_dense_cache
    from kvpack.hf.generation import greedy_generate

    ids = list(range(5, 40))
    free = greedy_generate(tiny_model, tokenizer, new_dense_cache(tiny_model), ids, 10)
    stopped = greedy_generate(tiny_model, tokenizer, new_dense_cache(tiny_model), ids, 10,
                              stop_when=lambda new: len(new) >= 3)
    assert len(free) == 10 and stopped == free[:3]


def test_the_exact_cache_fidelity_shortcut_equals_running_the_pass(tiny_model, tokenizer):
    """FullKV's fidelity figures are taken from the unit's reference log-probabilities instead of a
    second teacher-forced pass: they equal that pass over a fresh FullKV copy."""
    from kvpack.eval import runner
    from kvpack.methods import get_method

    plan = EvalPlan(tasks=["niah_single_1"], lengths=[256], samples=1, specs=method_specs(["full"], [0.5], {}))
    unit = runner._prepare_unit(tiny_model, tokenizer, plan, "query-aware", "niah_single_1", 256, 0, None)
    copy = get_method("full").from_prefill(tiny_model, unit.prefill).copy()
    ran, shortcut = runner._fidelity(tiny_model, unit, copy), runner._fidelity(tiny_model, unit, None)
    assert ran["kl_answer"] == pytest.approx(0.0, abs=1e-6) and shortcut["kl_answer"] == 0.0
    assert ran["kl"] == pytest.approx(0.0, abs=1e-6) and ran["top1"] == shortcut["top1"] == 1.0
    assert shortcut["ppl_continuation"] == pytest.approx(ran["ppl_continuation"], rel=1e-5)


def test_fidelity_counts_the_answer_and_continuation_positions(tiny_model, tokenizer):
    """Over a lossy cache (StreamingLLM keeping a tenth), the KL over answer + continuation is the
    token-weighted mean of its two parts, and top-1 agreement is a share of those positions."""
    from kvpack.eval import runner
    from kvpack.methods import get_method

    plan = EvalPlan(tasks=["niah_single_1"], lengths=[256], samples=1, specs=method_specs(["full"], [0.5], {}))
    unit = runner._prepare_unit(tiny_model, tokenizer, plan, "query-aware", "niah_single_1", 256, 0, None)
    lossy = get_method("streaming", budget=0.1).from_prefill(tiny_model, unit.prefill)
    f = runner._fidelity(tiny_model, unit, lossy)
    n_cont = len(unit.tf_chunk) - (len(unit.ids) - unit.n_pre) - unit.ans_len
    assert f["kl_answer"] > 0 and f["kl_continuation"] > 0
    expected = (f["kl_answer"] * unit.ans_len + f["kl_continuation"] * n_cont) / (unit.ans_len + n_cont)
    assert f["kl"] == pytest.approx(expected, rel=1e-4)
    assert (f["top1"] * (unit.ans_len + n_cont)) == pytest.approx(round(f["top1"] * (unit.ans_len + n_cont)))


def test_spec_name_labels_rows_without_changing_their_identity():
    a = method_specs(["hf_quantized"], [0.5], {"hf_quantized": {"nbits": 2}})[0]
    named = type(a)(a.method, a.budget, a.config, name="hf_quantized-2bit")
    assert a.label == "hf_quantized" and named.label == "hf_quantized-2bit" and named.key == a.key
    assert type(a)("kivi", 0.25, name="kivi-x").label == "kivi-x@0.25"


def test_h2o_at_several_budgets_of_one_sample_scores_its_prefill_once(tiny_model, tokenizer, tmp_path, monkeypatch):
    """The runner builds a sample's methods inside shared_prefill_scores: H2O's attention-mass scores are
    computed once per layer and setting, not once per budget, and the rows whose build reused them say so
    (their compress_s leaves the scoring out); the kept tokens are those of a build on its own."""
    import kvpack.attention.scores as scores_module

    calls, real = [], scores_module._accumulated_attention
    monkeypatch.setattr(scores_module, "_accumulated_attention", lambda *a: calls.append(1) or real(*a))
    specs = method_specs(["h2o"], [0.6, 0.4, 0.3], {})
    plan = EvalPlan(tasks=["vt"], lengths=[256], samples=1, specs=specs, settings=["query-aware"], fidelity=False)
    rows = run_eval(tiny_model, tokenizer, plan, tmp_path, progress=False)
    layers = len(tiny_model.model.layers)
    assert len(calls) == layers  # one scoring per layer, shared by the three budgets
    assert [r.get("prefill_scores_reused", False) for r in rows] == [False, True, True]
    alone = run_eval(tiny_model, tokenizer, EvalPlan(tasks=["vt"], lengths=[256], samples=1, specs=specs[2:],
                                                     settings=["query-aware"], fidelity=False), tmp_path / "alone",
                     progress=False)
    assert alone[0]["prediction"] == rows[2]["prediction"] and alone[0]["kv_bytes"] == rows[2]["kv_bytes"]
