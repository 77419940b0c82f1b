"""What every RULER-style task shares: the sample record, the registry, haystacks, length fitting.

A task is a generator ``make(tokenizer, length, depth, rng) -> Sample`` registered under its RULER
name. Samples are built offline and deterministically from a seed, to a target length in the
model's own tokens (±2 %): the generator describes the prompt as ``instruction + context +
question`` where the context is made of ``n`` filler units with the task's statements inserted,
and :func:`fit_to_length` searches ``n``.

Haystacks: ``noise`` is RULER's repeated sentence; ``essay`` is sentences of the Python standard
library's documentation (the pydoc topics; RULER uses Paul Graham's essays, which need a
download); ``needle`` haystacks are made of distractor statements themselves (RULER's multikey_2/3).
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

NOISE_SENTENCE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
LENGTH_TOLERANCE = 0.02


class ResampleError(ValueError):
    """A task generator's draw that cannot make a valid sample (e.g. tied word counts): the caller
    draws again with another seed."""


@dataclass
class Sample:
    """One evaluation prompt.

    Attributes:
        task: registered task name.
        length: target prompt length in tokens; ``tokens`` is the measured one.
        depth: relative position of the (first) target statement in the context, in [0, 1].
        context: instruction + haystack with the statements (what query-agnostic runs compress).
        question: the query and answer prefix appended after the context.
        answers: reference strings; ``metric`` says how they are scored (``all``: fraction found,
            ``part``: any found).
        continuation: held-out text (more haystack) whose perplexity measures fidelity.
        max_new_tokens: generation length the answer needs.
    """

    task: str
    length: int
    depth: float
    seed: int
    context: str
    question: str
    answers: list[str]
    metric: str = "all"
    continuation: str = ""
    max_new_tokens: int = 16
    tokens: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


TaskFn = Callable[..., Sample]
TASKS: dict[str, TaskFn] = {}


def register_task(name: str):
    def deco(fn: TaskFn) -> TaskFn:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = fn
        return fn

    return deco


# ------------------------------------------------------------------------------------------------
# Haystack material
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Prose sentences of the pydoc topic pages, in a fixed order, without digits (so that no number
    in the haystack can be mistaken for an answer) and of moderate length."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = re.sub(r"\s+", " ", topics[key])
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            if 40 <= len(sentence) <= 160 and not re.search(r"\d", sentence) and sentence[0].isupper():
                out.append(sentence)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """Distinct lowercase English words (5-10 letters) from the essay sentences, sorted."""
    words = set()
    for sentence in essay_sentences():
        for w in re.findall(r"\b[a-z]{5,10}\b", sentence):
            words.add(w)
    return tuple(sorted(words))


def essay_units(rng: random.Random, n: int) -> list[str]:
    """``n`` consecutive essay sentences from a seeded starting point (wrapping around)."""
    sentences = essay_sentences()
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(n)]


_NOISE_PARTS = [s + "." for s in NOISE_SENTENCE.rstrip(".").split(". ")]


def noise_units(n: int) -> list[str]:
    """``n`` sentences of RULER's noise block, cycling (sentence granularity fits lengths closely)."""
    return [_NOISE_PARTS[i % len(_NOISE_PARTS)] for i in range(n)]


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_key(rng: random.Random, taken: set[str]) -> str:
    """An ``adjective-noun``-style two-word key not overlapping any key in ``taken``."""
    words = word_list()
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if all(key not in t and t not in key for t in taken):
            taken.add(key)
            return key


def insert_at_depths(units: list[str], statements: list[tuple[float, str]]) -> list[str]:
    """Insert each ``(depth, statement)`` between units at ``round(depth * len(units))``."""
    out = list(units)
    for depth, statement in sorted(statements, key=lambda s: s[0], reverse=True):
        out.insert(round(depth * len(units)), statement)
    return out


# ------------------------------------------------------------------------------------------------
# Fitting to a length in tokens
# ------------------------------------------------------------------------------------------------


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def fit_to_length(tokenizer, length: int, build: Callable[[int], tuple[str, str]]) -> tuple[str, str, int]:
    """Find the number of filler units ``n`` whose prompt ``context + question`` is ``length``
    tokens within ±2 %.

    Args:
        build: ``n -> (context, question)``; more units make a longer prompt.

    Returns:
        ``(context, question, tokens)``.

    Raises:
        ValueError: the fixed part alone exceeds the length, or no ``n`` lands within tolerance.
    """
    def total(n: int) -> tuple[int, str, str]:
        context, question = build(n)
        return count_tokens(tokenizer, context + question), context, question

    base, _, _ = total(0)
    if base > length * (1 + LENGTH_TOLERANCE):
        raise ValueError(f"the task's fixed text alone is {base} tokens, more than the target {length}")
    one, _, _ = total(1)
    per_unit = max(1, one - base)
    lo, hi = 0, max(1, 2 * (length - base) // per_unit + 2)
    while total(hi)[0] < length:
        hi *= 2
    # Largest n with tokens <= length.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid)[0] <= length:
            lo = mid
        else:
            hi = mid - 1
    best = min((total(n) for n in (lo, lo + 1)), key=lambda t: abs(t[0] - length))
    tokens, context, question = best
    if abs(tokens - length) > LENGTH_TOLERANCE * length:
        raise ValueError(f"cannot fit the task to {length} tokens within 2% (closest {tokens})")
    return context, question, tokens
