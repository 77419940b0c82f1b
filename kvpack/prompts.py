"""Deterministic needle-in-a-haystack prompts measured in the model's own tokens.

The haystack is RULER's repeated-sentence noise; the needle is a 7-digit number stated once at a
chosen depth, and the prompt ends with a cue the model completes greedily with the number.
"""

from __future__ import annotations

import random

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The special magic number is: {value}. Remember it. "
QUESTION = "\nWhat is the special magic number mentioned in the text above? The special magic number is"


def needle_prompt(tokenizer, n_tokens: int = 2048, depth: float = 0.5, seed: int = 0) -> tuple[str, str]:
    """A prompt of about ``n_tokens`` tokens (within one noise sentence) and its answer.

    Args:
        tokenizer: the model's tokenizer (lengths are counted in its tokens).
        n_tokens: target prompt length.
        depth: needle position as a fraction of the haystack, in [0, 1].
        seed: picks the 7-digit value.

    Returns:
        ``(prompt, answer)``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    value = str(random.Random(seed).randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(value=value)
    fixed = len(tokenizer(needle + QUESTION).input_ids)
    per_noise = len(tokenizer(NOISE * 20).input_ids) / 20
    n_noise = max(1, int((n_tokens - fixed) / per_noise))
    at = round(depth * n_noise)
    prompt = NOISE * at + needle + NOISE * (n_noise - at) + QUESTION
    return prompt, value
