"""RULER's variable tracking (``vt``): follow a chain of assignments through the noise haystack.

One target chain ``VAR A = 12345, VAR B = VAR A, ...`` of 4 hops (5 variables) and one distractor
chain with another value, their statements in order at increasing depths (the target's first at
``depth``); the answer is every variable of the target chain.
"""

from __future__ import annotations

import random
import string

from .base import Sample, fit_to_length, insert_at_depths, noise_units, register_task

INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
            "According to the chain(s) of variable assignment in the text above, {n} variables are assigned the "
            "value {value}, they are:")
HOPS = 4
DISTRACTOR_CHAINS = 1


def _chain(rng: random.Random, names: set[str], value: str) -> tuple[list[str], list[str]]:
    variables = []
    while len(variables) < HOPS + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.add(name)
            variables.append(name)
    statements = [f"VAR {variables[0]} = {value}."]
    statements += [f"VAR {variables[i]} = VAR {variables[i - 1]}." for i in range(1, len(variables))]
    return variables, statements


@register_task("vt")
def variable_tracking(tokenizer, length, depth, rng):
    names: set[str] = set()
    value = str(rng.randint(10000, 99999))
    target_vars, target = _chain(rng, names, value)
    placed = [(depth, target[0])]
    rest = sorted(depth + (1 - depth) * rng.random() for _ in target[1:])
    placed += list(zip(rest, target[1:]))
    for _ in range(DISTRACTOR_CHAINS):
        other = str(rng.randint(10000, 99999))
        while other == value:
            other = str(rng.randint(10000, 99999))
        _, statements = _chain(rng, names, other)
        placed += list(zip(sorted(rng.random() for _ in statements), statements))
    question = QUESTION.format(value=value, n=len(target_vars))

    def build(n: int) -> tuple[str, str]:
        return INSTRUCTION + " ".join(insert_at_depths(noise_units(n), placed)), question

    context, question, tokens = fit_to_length(tokenizer, length, build)
    return Sample(task="vt", length=length, depth=depth, seed=0, context=context, question=question,
                  answers=target_vars, metric="all", continuation=" " + " ".join(noise_units(3)),
                  max_new_tokens=32, tokens=tokens)
