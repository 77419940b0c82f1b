"""The evaluation runner: tasks × lengths × samples × methods × budgets on one model, resumable.

For each sample the prompt (instruction + context + question) is prefilled once with exact attention
(:mod:`kvpack.hf.prefill`) — in the *query-aware* setting everything but the last prompt token, in the
*query-agnostic* setting only instruction + context, cut from the query-aware prefill when both run (one model run
per sample) — and every method × budget is built from that same prefill and decoded greedily (the rest of the
prompt is prefilled over the compressed cache first). What a method derives from the prefill alone is computed
once per sample and setting (:func:`kvpack.attention.scores.shared_prefill_scores`: H2O's attention mass, the
same at every budget); a row whose build reused it says ``prefill_scores_reused`` (its ``compress_s`` leaves
that out). Decoding stops once the prediction holds every reference (its score can no longer change); each row
records the median milliseconds of its decode steps (after the first new token, which also prefills the rest
of the prompt), the report's speed column, and with ``reference_timing`` FullKV's median on the same sample
timed in the same run (``reference_decode_ms``). Rows are appended to ``results.jsonl`` (or, split by method
name, to ``rows/<name>.jsonl``) as they finish; a rerun skips every (setting, task, length, sample, method,
budget, config overrides) already there — a method rerun with other ``--set`` overrides is computed again, not
taken from the earlier rows.

Fidelity (``fidelity=True``), from a copy of each built cache taken before decoding (one build
per method and sample): the rest of the prompt, the gold answer and a held-out continuation (more
haystack) are teacher-forced in one pass; recorded are the mean next-token KL divergence
KL(FullKV ‖ method) over the answer positions (``kl_answer``), over the continuation's
(``kl_continuation``) and over both (``kl``), the share of those positions whose most likely next
token is FullKV's (``top1``), and the perplexity of the continuation.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from ..attention.scores import shared_prefill_scores
from ..divergence import kl_per_position
from ..hf.cache import cache_kwargs
from ..hf.generation import StepClock, context_limit, greedy_generate
from ..hf.prefill import ExactPrefill, exact_prefill
from ..methods import Method, PreparedCache, get_method, method_takes_budget, preset_config
from ..methods.recommend import AUTO, recommend
from ..presets import preset
from .scoring import score
from .tasks import TASKS, make_sample

SETTINGS = ("query-aware", "query-agnostic")
CONTINUATION_TOKENS = 64
REFERENCE_METHOD = "full"  # the exact cache every method's KL is measured against


@dataclass
class MethodSpec:
    """One method at one budget (``budget`` None: the method's own parameters, e.g. FullKV).

    ``name``: what reports call the method (default: the method's registry name), e.g. ``hf_quantized-2bit``
    for one configuration of a method that runs in several; a display name only, not part of a row's
    identity (:attr:`key`)."""

    method: str
    budget: float | None = None
    config: dict = field(default_factory=dict)
    name: str | None = None

    @property
    def label(self) -> str:
        name = self.name or self.method
        return name if self.budget is None else f"{name}@{self.budget:g}"

    @property
    def key(self) -> tuple:
        """``(method, budget, overrides as canonical JSON)``: the spec's part of a result row's identity
        (the last three fields of :func:`row_key`)."""
        return self.method, self.budget, _canonical(self.config)

    def method_config(self) -> dict:
        cfg = dict(self.config)
        if self.budget is not None:
            cfg["budget"] = self.budget
        return cfg


def method_specs(methods: list[str], budgets: list[float], overrides: dict[str, dict] | None = None,
                 model=None) -> list[MethodSpec]:
    """Methods without a byte budget (FullKV, the fixed-ratio presets) once; every other method at every budget.
    A preset (:mod:`kvpack.presets`) is its method with the preset's fields, named by the preset; ``auto`` is the
    recommended method at each budget for ``model`` (:func:`kvpack.methods.recommend.recommend`), named as that
    method or preset is, so its rows are that method's rows."""
    overrides = overrides or {}
    specs: list[MethodSpec] = []
    for m in methods:
        if m == AUTO:
            if model is None:
                raise ValueError("method 'auto' needs the model to choose for")
            for b in budgets:
                rec = recommend(model, b)
                specs += method_specs([rec.method], [b], overrides)
            continue
        p = preset(m)
        if p is not None:
            method, fixed, name = p.method, preset_config(p, overrides.get(m, {})), p.name
        else:
            method, fixed, name = m, overrides.get(m, {}), None
        if not method_takes_budget(m):
            specs.append(MethodSpec(method, None, fixed, name=name))
        else:
            specs.extend(MethodSpec(method, b, fixed, name=name) for b in budgets)
    return list({(s.key, s.name): s for s in specs}.values())  # auto's pick may also be named


@dataclass
class EvalPlan:
    tasks: list[str]
    lengths: list[int]
    samples: int
    specs: list[MethodSpec]
    settings: list[str] = field(default_factory=lambda: ["query-aware"])
    seed: int = 0
    fidelity: bool = True
    # Time FullKV's decode of every sample in the run (each row's ``reference_decode_ms``), so a row's speed has a
    # reference from the same process, sample and machine even when FullKV's own row was made by an earlier run.
    reference_timing: bool = False

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; known tasks: {', '.join(sorted(TASKS))}")
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise ValueError(f"unknown setting(s) {bad}; choose from {SETTINGS}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if any((not isinstance(n, int)) or n < 64 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 64 tokens, got {self.lengths}")
        if not self.specs:
            raise ValueError("no methods to evaluate")
        for spec in self.specs:  # refuse unknown methods, fields and budgets now, not hours into a run
            get_method(spec.method, **spec.method_config())

    def units(self) -> list[tuple[str, str, int, int]]:
        """Every ``(setting, task, length, sample)`` of the plan, in the order :func:`run_eval` runs them: sample
        index outermost, so a run cut short has every task and length at fewer samples rather than some not at
        all; both settings of a sample back to back, so its rows are comparable (and share one model run)."""
        return [(setting, task, length, index) for index in range(self.samples) for task in self.tasks
                for length in self.lengths for setting in self.settings]


def _canonical(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True)


def row_key(row: dict) -> tuple:
    """A row's identity: (setting, task, length, sample, method, budget, canonical overrides) — a rerun skips
    the rows whose key is already there; the last three are a :class:`MethodSpec`'s ``key``."""
    # Rows written before overrides were recorded had none.
    return (row["setting"], row["task"], row["length"], row["sample"], row["method"], row["budget"],
            _canonical(row.get("overrides", {})))


def rows_in_plan(rows: list[dict], plan: EvalPlan) -> list[dict]:
    """The rows a plan asks for (an output directory may also hold rows of earlier, wider runs)."""
    units = set(plan.units())
    specs = {s.key for s in plan.specs}
    return [r for r in rows if (r["setting"], r["task"], r["length"], r["sample"]) in units
            and row_key(r)[4:] in specs]


ROWS_BY_METHOD = "rows"  # the subdirectory of one rows file per method name (run_eval's rows_by_method)


def load_results(out_dir: str | Path) -> list[dict]:
    """Every row of an eval directory: ``results.jsonl`` and, where rows were split by method name
    (:func:`run_eval`'s ``rows_by_method``), ``rows/<name>.jsonl`` in name order."""
    out_dir = Path(out_dir)
    rows = load_rows(out_dir / "results.jsonl")
    for path in sorted((out_dir / ROWS_BY_METHOD).glob("*.jsonl")):
        rows += load_rows(path)
    return rows


def has_results(out_dir: str | Path) -> bool:
    """Whether an eval directory holds rows in either layout."""
    out_dir = Path(out_dir)
    return (out_dir / "results.jsonl").is_file() or any((out_dir / ROWS_BY_METHOD).glob("*.jsonl"))


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def load_rows(path: Path) -> list[dict]:
    """Rows of a results file (a torn last line from an interrupted run is ignored)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


@torch.no_grad()  # the fidelity pass ran with autograd on: every layer's activations kept for a backward
def teacher_forced_logprobs(model, prepared: PreparedCache, chunk: list[int], total: int) -> torch.Tensor:
    """Log-probabilities ``[len(chunk), vocab]`` (fp32) of a chunk appended to a prepared cache."""
    ids = torch.tensor([chunk], device=model.device)
    mask = torch.ones(1, total, dtype=torch.long, device=model.device)
    with prepared.active(model) as cache:
        out = model(ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _greedy(model, tokenizer, prepared: PreparedCache, ids: list[int], sample) -> tuple[str, float, list[float]]:
    """Greedy prediction, its seconds and the milliseconds of each decode step after the first new
    token. Decoding stops once the prediction holds every reference: RULER's string-match scores
    never fall as text is appended, so the score is already final (only the recorded prediction is
    shorter)."""
    def answered(new: list[int]) -> bool:
        return score(tokenizer.decode(new, skip_special_tokens=True), sample.answers, sample.metric) == 1.0

    clock = StepClock()
    start = time.perf_counter()
    with prepared.active(model) as cache:
        new = greedy_generate(model, tokenizer, cache, ids, sample.max_new_tokens, streamer=clock,
                              stop_when=answered)
    return tokenizer.decode(new, skip_special_tokens=True), time.perf_counter() - start, clock.decode_steps_ms()


@dataclass
class _Unit:
    """One sample in one setting: its prompt ids, how many of them are prefilled and compressed, and
    the reference for the fidelity pass (teacher-forced chunk, answer length, exact log-probs)."""

    sample: Any
    ids: list[int]
    n_pre: int
    prefill: ExactPrefill
    fresh: bool  # the prefill ran the model (rather than cutting the last unit's)
    tf_chunk: list[int] | None = None
    ans_len: int = 0
    ref_logprobs: torch.Tensor | None = None


def _sample_ids(tokenizer, sample) -> tuple[list[int], int]:
    """``(context + question token ids, context length)`` of a sample, as every run tokenizes it."""
    ctx_ids = tokenizer(sample.context).input_ids
    return ctx_ids + tokenizer(sample.question, add_special_tokens=False).input_ids, len(ctx_ids)


def _scored_ids(tokenizer, sample) -> tuple[list[int], list[int]]:
    """``(answer ids, continuation ids)`` the fidelity pass teacher-forces after the prompt."""
    ans_ids = tokenizer(" " + ", ".join(sample.answers), add_special_tokens=False).input_ids
    cont_ids = tokenizer(sample.continuation, add_special_tokens=False).input_ids[:CONTINUATION_TOKENS]
    return ans_ids, cont_ids


def _prepare_unit(model, tokenizer, plan: EvalPlan, setting: str, task: str, length: int, index: int,
                  last_prefill: ExactPrefill | None) -> _Unit:
    sample = make_sample(tokenizer, task, length, index, plan.samples, plan.seed)
    ids, n_ctx = _sample_ids(tokenizer, sample)
    n_pre = len(ids) - 1 if setting == "query-aware" else n_ctx
    # One model run per sample: the query-agnostic prefill is the leading tokens of the query-aware
    # one, which runs first (causal attention; see ExactPrefill.leading).
    prefill = None
    if last_prefill is not None and ids[:len(last_prefill.token_ids)] == last_prefill.token_ids:
        prefill = last_prefill.leading(n_pre)  # None when n_pre is longer than it
    fresh = prefill is None
    if fresh:
        prefill = exact_prefill(model, ids[:n_pre])
    unit = _Unit(sample, ids, n_pre, prefill, fresh)
    if plan.fidelity:
        ans_ids, cont_ids = _scored_ids(tokenizer, sample)
        unit.tf_chunk, unit.ans_len = ids[n_pre:] + ans_ids + cont_ids, len(ans_ids)
        ref = get_method(REFERENCE_METHOD).from_prefill(model, prefill)
        unit.ref_logprobs = teacher_forced_logprobs(model, ref, unit.tf_chunk, n_pre + len(unit.tf_chunk))
    return unit


def _fidelity(model, unit: _Unit, prepared: PreparedCache | None) -> dict:
    """KL against the exact cache's next-token distributions over the answer positions, the
    continuation's and both; top-1 agreement with the exact cache over both; the continuation's
    perplexity.

    ``prepared`` None: the method's cache is the exact cache itself (FullKV with its defaults), whose
    teacher-forced log-probabilities the unit already holds (the same cache, the same forward), so the
    pass is not run twice."""
    logp = (unit.ref_logprobs if prepared is None
            else teacher_forced_logprobs(model, prepared, unit.tf_chunk, unit.n_pre + len(unit.tf_chunk)))
    a = len(unit.ids) - unit.n_pre  # logits at a-1+j predict answer token j, then the continuation's
    targets = torch.tensor(unit.tf_chunk[a + unit.ans_len:], device=logp.device)
    scored = slice(a - 1, a - 1 + unit.ans_len + len(targets))  # answer positions, then continuation's
    ref = unit.ref_logprobs[scored]
    kl = kl_per_position(ref, logp[scored])  # [answer + continuation tokens]
    agree = (ref.argmax(-1) == logp[scored].argmax(-1)).float()
    nll = -logp[scored][unit.ans_len:].gather(1, targets[:, None]).mean()
    return {"kl_answer": float(kl[:unit.ans_len].mean()), "kl_continuation": float(kl[unit.ans_len:].mean()),
            "kl": float(kl.mean()), "top1": float(agree.mean()), "ppl_continuation": float(math.exp(float(nll)))}


def _evaluate(model, tokenizer, plan: EvalPlan, unit: _Unit, spec: MethodSpec, method: Method) -> dict:
    """One result row: the method's cache from the unit's prefill, its greedy answer and score, its
    measured bytes (a refused configuration is a row with its error). ``method``: the spec's method, made for the
    model once per run (its ``calibration="auto"`` resolved)."""
    sample = unit.sample
    row = {"task": sample.task, "depth": sample.depth, "seed": sample.seed, "prompt_tokens": len(unit.ids),
           "compressed_tokens": unit.n_pre, "method": spec.method, "budget": spec.budget, "label": spec.label,
           "overrides": spec.config, "answers": sample.answers, "metric": sample.metric,
           "prefill_s": unit.prefill.seconds}
    try:
        built = method.from_prefill(model, unit.prefill)
        # the fidelity pass runs on a copy of the same compressed cache (decoding mutates it); the
        # exact cache's pass is the unit's reference, already computed
        exact = _is_reference(spec)
        again = built.copy() if plan.fidelity and not exact else None
        prediction, decode_s, steps_ms = _greedy(model, tokenizer, built, unit.ids, sample)
        row.update(config=built.config, kv_bytes=built.kv_bytes, dense_kv_bytes=built.dense_kv_bytes,
                   ratio=built.kv_bytes / built.dense_kv_bytes, compress_s=built.seconds, decode_s=decode_s,
                   decode_steps=len(steps_ms), decode_ms=statistics.median(steps_ms) if steps_ms else None,
                   prediction=prediction, score=score(prediction, sample.answers, sample.metric))
        if plan.fidelity:
            row.update(_fidelity(model, unit, again))
    except (ValueError, NotImplementedError) as exc:
        row.update(error=f"{type(exc).__name__}: {exc}", score=None)
    return row


def _is_reference(spec: MethodSpec) -> bool:
    """The exact cache with its defaults: the spec whose rows are the KL's and the speed's reference."""
    return spec.method == REFERENCE_METHOD and not spec.method_config()


def _reference_decode_ms(model, tokenizer, unit: _Unit) -> float | None:
    """FullKV's median decode ms/token on the unit's sample (its greedy decode, as a FullKV row times it; None
    when it answers with its first token, which leaves no decode step)."""
    built = get_method(REFERENCE_METHOD).from_prefill(model, unit.prefill)
    steps_ms = _greedy(model, tokenizer, built, unit.ids, unit.sample)[2]
    return statistics.median(steps_ms) if steps_ms else None


@torch.no_grad()
def check_plan_fits(model, tokenizer, plan: EvalPlan) -> None:
    """Refuse, before anything runs, a plan whose prompts do not fit the model's context with the
    tokens each sample generates (and, with fidelity on, the answer and continuation it scores).

    Raises:
        ValueError: naming the task, the length, the tokens needed and the longest length that fits.
    """
    limit = context_limit(model)
    if limit is None:
        return
    for task in plan.tasks:
        for length in plan.lengths:
            need, prompt = 0, 0
            for index in range(plan.samples):
                sample = make_sample(tokenizer, task, length, index, plan.samples, plan.seed)
                n = len(_sample_ids(tokenizer, sample)[0])
                extra = sample.max_new_tokens
                if plan.fidelity:
                    extra = max(extra, sum(len(x) for x in _scored_ids(tokenizer, sample)))
                if n + extra > need:
                    need, prompt = n + extra, n
            if need > limit:
                raise ValueError(f"--lengths {length}: {task}'s prompts of up to {prompt} tokens + {need - prompt} "
                                 f"to generate{' and score' if plan.fidelity else ''} exceed the model's context of "
                                 f"{limit} tokens; use a length of at most {length - (need - limit)}")


def run_eval(model, tokenizer, plan: EvalPlan, out_dir: str | Path, progress: bool = True,
             row_fields: dict | None = None, rows_by_method: bool = False) -> list[dict]:
    """Run (or resume) ``plan``; returns every row of ``out_dir`` (:func:`load_results`). ``row_fields`` are
    written into each new row (e.g. the machine and commit that made it, when rows from several runs
    share one file). New rows go to ``out_dir/results.jsonl``, or with ``rows_by_method`` to
    ``out_dir/rows/<name>.jsonl`` (one file per method name — a named variant, e.g. ``pca_quant-head``, gets
    its own: a long plan's rows stay in files of a size a diff or a review can read); a run resumes from
    either layout.

    Raises:
        ValueError: a length whose prompts do not fit the model's context (:func:`check_plan_fits`).
    """
    check_plan_fits(model, tokenizer, plan)
    # each spec's method once per run, made for the model (a preset's calibration="auto": the model's own, made now
    # rather than in a row)
    methods = {spec.key: get_method(spec.method, **spec.method_config()).for_model(model, tokenizer, progress)
               for spec in plan.specs}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = load_results(out_dir)
    done = {row_key(r) for r in rows}
    units = plan.units()
    bar = tqdm(total=len(units) * len(plan.specs), desc="[kvpack] eval", unit="run", disable=not progress)
    bar.update(sum(1 for u in units for s in plan.specs if (*u, *s.key) in done))
    last_prefill = None
    with contextlib.ExitStack() as files:
        sinks: dict[str, TextIO] = {}

        def sink_for(spec: MethodSpec) -> TextIO:
            name = f"{ROWS_BY_METHOD}/{spec.name or spec.method}.jsonl" if rows_by_method else "results.jsonl"
            if name not in sinks:
                path = out_dir / name
                path.parent.mkdir(parents=True, exist_ok=True)
                torn = path.is_file() and path.stat().st_size and _last_byte(path) != b"\n"
                sinks[name] = files.enter_context(path.open("a"))
                if torn:  # a run cut short mid-line: the fragment stays a line of its own (load_rows skips it)
                    sinks[name].write("\n")
            return sinks[name]

        for setting, task, length, index in units:
            pending = [s for s in plan.specs if (setting, task, length, index, *s.key) not in done]
            if not pending:
                continue
            bar.set_postfix_str(f"{task} {length} #{index}")
            unit = _prepare_unit(model, tokenizer, plan, setting, task, length, index, last_prefill)
            if unit.fresh:
                last_prefill = unit.prefill
            timed, reference_ms = False, None
            # the unit's methods share what depends only on its prefill (H2O's scores at every budget)
            with shared_prefill_scores() as shared:
                for spec in sorted(pending, key=lambda s: not _is_reference(s)):  # FullKV first: it times decode
                    hits = shared["hits"]
                    row = {"setting": setting, "task": task, "length": length, "sample": index,
                           **_evaluate(model, tokenizer, plan, unit, spec, methods[spec.key]),
                           **(row_fields or {})}
                    if shared["hits"] > hits:  # its compress_s leaves out the scores an earlier build computed
                        row["prefill_scores_reused"] = True
                    if plan.reference_timing and "error" not in row:
                        if _is_reference(spec):
                            timed, reference_ms = True, row["decode_ms"]
                        elif not timed:
                            timed, reference_ms = True, _reference_decode_ms(model, tokenizer, unit)
                        row["reference_decode_ms"] = reference_ms
                    sink = sink_for(spec)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    rows.append(row)
                    done.add(row_key(row))
                    bar.update(1)
    bar.close()
    (out_dir / "plan.json").write_text(json.dumps({**asdict(plan), "specs": [asdict(s) for s in plan.specs]},
                                                  indent=1))
    return rows
