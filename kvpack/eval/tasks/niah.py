"""RULER's needle-in-a-haystack family (Hsieh et al., 2024) and the long passkey.

RULER's definitions (keys are two-word phrases here, RULER uses wonderwords adjective-noun pairs):

| task | haystack | key | value | needles |
|---|---|---|---|---|
| niah_single_1 | noise | words | 7-digit number | 1 |
| niah_single_2 | essay | words | number | 1 |
| niah_single_3 | essay | words | UUID | 1 |
| niah_multikey_1 | essay | words | number | 1 + 3 distractor keys |
| niah_multikey_2 | needles (every filler unit is a distractor) | words | number | 1 |
| niah_multikey_3 | needles | UUID | UUID | 1 |
| niah_multivalue | essay | words | number | 4 values of one key |
| niah_multiquery | essay | words | number | 4 keys, all queried |

The long passkey (AnchorKV's stress test): a 64-digit pass key in the noise haystack.
Every target statement appears exactly once; distractor keys never overlap a target key and
distractor values never equal a target value.
"""

from __future__ import annotations

import random

from .base import (
    Sample,
    essay_units,
    fit_to_length,
    insert_at_depths,
    noise_units,
    random_key,
    random_number,
    random_uuid,
    register_task,
)

INSTRUCTION = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the {kind} afterwards.\n")
NEEDLE = "One of the special magic {kind_one} for {key} is: {value}."
QUESTION = ("\nWhat are all the special magic {kind} for {query} mentioned in the provided text? "
            "The special magic {kind} for {query} mentioned in the provided text are")


def _value(rng: random.Random, kind: str) -> str:
    return random_number(rng) if kind == "number" else random_uuid(rng)


def _key(rng: random.Random, kind: str, taken: set[str]) -> str:
    if kind == "uuid":
        key = random_uuid(rng)
        taken.add(key)
        return key
    return random_key(rng, taken)


def _niah(tokenizer, length: int, depth: float, rng: random.Random, *, task: str, haystack: str, key_kind: str,
          value_kind: str, n_queries: int = 1, n_values: int = 1, n_distractors: int = 0) -> Sample:
    kind = "numbers" if value_kind == "number" else "uuids"
    kind_one = "number" if value_kind == "number" else "uuid"
    taken: set[str] = set()
    used_values: set[str] = set()

    def fresh_value() -> str:
        while True:
            v = _value(rng, value_kind)
            if v not in used_values:
                used_values.add(v)
                return v

    queries = [_key(rng, key_kind, taken) for _ in range(n_queries)]
    answers, statements = [], []
    for qi, key in enumerate(queries):
        for vi in range(n_values):
            value = fresh_value()
            answers.append(value)
            d = depth if (qi, vi) == (0, 0) else rng.random()
            statements.append((d, NEEDLE.format(kind_one=kind_one, key=key, value=value)))
    for _ in range(n_distractors):
        key = _key(rng, key_kind, taken)
        statements.append((rng.random(), NEEDLE.format(kind_one=kind_one, key=key, value=fresh_value())))
    essay_seed = rng.random()
    filler_rng = random.Random(rng.random())
    filler_cache: list[str] = []

    def filler(n: int) -> list[str]:
        if haystack == "noise":
            return noise_units(n)
        if haystack == "essay":
            return essay_units(random.Random(essay_seed), n)
        while len(filler_cache) < n:  # haystack of distractor needles, generated once in order
            key = _key(filler_rng, key_kind, taken)
            filler_cache.append(NEEDLE.format(kind_one=kind_one, key=key, value=fresh_value()))
        return filler_cache[:n]

    query = ", ".join(queries[:-1]) + (" and " if len(queries) > 1 else "") + queries[-1]
    instruction = INSTRUCTION.format(kind=kind)
    question = QUESTION.format(kind=kind, query=query)

    def build(n: int) -> tuple[str, str]:
        return instruction + " ".join(insert_at_depths(filler(n), statements)), question

    context, question, tokens = fit_to_length(tokenizer, length, build)
    continuation = " ".join(essay_units(random.Random(rng.random()), 4)) if haystack != "noise" \
        else " ".join(noise_units(3))
    per_answer = 24 if value_kind == "uuid" else 10
    return Sample(task=task, length=length, depth=depth, seed=0, context=context, question=question,
                  answers=answers, metric="all", continuation=" " + continuation,
                  max_new_tokens=per_answer * len(answers) + 4, tokens=tokens)


# RULER's NIAH variants (the table in the module docstring).
NIAH_VARIANTS = {
    "niah_single_1": dict(haystack="noise", key_kind="words", value_kind="number"),
    "niah_single_2": dict(haystack="essay", key_kind="words", value_kind="number"),
    "niah_single_3": dict(haystack="essay", key_kind="words", value_kind="uuid"),
    "niah_multikey_1": dict(haystack="essay", key_kind="words", value_kind="number", n_distractors=3),
    "niah_multikey_2": dict(haystack="needle", key_kind="words", value_kind="number"),
    "niah_multikey_3": dict(haystack="needle", key_kind="uuid", value_kind="uuid"),
    "niah_multivalue": dict(haystack="essay", key_kind="words", value_kind="number", n_values=4),
    "niah_multiquery": dict(haystack="essay", key_kind="words", value_kind="number", n_queries=4),
}


def _register_variant(name: str, spec: dict) -> None:
    @register_task(name)
    def make(tokenizer, length, depth, rng):
        return _niah(tokenizer, length, depth, rng, task=name, **spec)


for _name, _spec in NIAH_VARIANTS.items():
    _register_variant(_name, _spec)


PASSKEY_INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                       "it. I will quiz you about the important information there.\n")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@register_task("passkey")
def passkey(tokenizer, length, depth, rng):
    """A 64-digit pass key at ``depth`` in the noise haystack (the AnchorKV paper's stress test)."""
    key = "".join(rng.choice("0123456789") for _ in range(64))
    statement = PASSKEY_NEEDLE.format(key=key)

    def build(n: int) -> tuple[str, str]:
        return PASSKEY_INSTRUCTION + " ".join(insert_at_depths(noise_units(n), [(depth, statement)])), \
            PASSKEY_QUESTION

    context, question, tokens = fit_to_length(tokenizer, length, build)
    return Sample(task="passkey", length=length, depth=depth, seed=0, context=context, question=question,
                  answers=[key], metric="all", continuation=" " + " ".join(noise_units(3)),
                  max_new_tokens=80, tokens=tokens)
