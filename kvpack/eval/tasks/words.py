"""RULER's aggregation tasks: common words extraction (``cwe``) and frequent words extraction (``fwe``).

cwe: a numbered list where 10 common words appear 30 times each and every other word 3 times;
answer the 10 common words. fwe: "coded" words drawn from a Zipf distribution (alpha = 2); answer
the three most frequent. Neither has a needle depth (recorded as None).
"""

from __future__ import annotations

import random
from collections import Counter

from .base import ResampleError, Sample, essay_units, fit_to_length, register_task, word_list

CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.\n")
CWE_QUESTION = ("\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words that "
                "appear most often in the list are:")
CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE = 10, 30, 3

FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three "
                   "most frequently appeared coded words.\n")
FWE_QUESTION = ("\nQuestion: What are the three most frequently appeared words in the above coded text? Answer: "
                "According to the coded text above, the three most frequently appeared words are:")
FWE_ALPHA, FWE_VOCAB = 2.0, 800


@register_task("cwe")
def common_words(tokenizer, length, depth, rng):
    words = list(word_list())
    rng.shuffle(words)
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    order_seed = rng.random()

    def build(n: int) -> tuple[str, str]:
        if n > len(rare):
            raise ValueError(f"cwe needs {n} distinct rare words, the word list has {len(rare)}")
        entries = common * CWE_FREQ_COMMON + rare[:n] * CWE_FREQ_RARE
        random.Random(order_seed).shuffle(entries)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
        return CWE_INSTRUCTION + listing, CWE_QUESTION

    context, question, tokens = fit_to_length(tokenizer, length, build)
    return Sample(task="cwe", length=length, depth=None, seed=0, context=context, question=question,
                  answers=common, metric="all", continuation=" " + " ".join(essay_units(rng, 3)),
                  max_new_tokens=64, tokens=tokens)


def _coded_vocab(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < FWE_VOCAB:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(4, 6)))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    return vocab


@register_task("fwe")
def frequent_words(tokenizer, length, depth, rng):
    vocab = _coded_vocab(rng)
    weights = [1.0 / (rank + 1) ** FWE_ALPHA for rank in range(len(vocab))]
    draw_seed = rng.random()

    def draws(n: int) -> list[str]:
        return random.Random(draw_seed).choices(vocab, weights=weights, k=n)

    def build(n: int) -> tuple[str, str]:
        return FWE_INSTRUCTION + " ".join(draws(n)), FWE_QUESTION

    context, question, tokens = fit_to_length(tokenizer, length, build)
    n = len(context[len(FWE_INSTRUCTION):].split())
    counts = Counter(draws(n)).most_common(4)
    if len(counts) < 4 or counts[2][1] == counts[3][1]:
        raise ResampleError("fwe: the third and fourth most frequent words tie; use another seed")
    return Sample(task="fwe", length=length, depth=None, seed=0, context=context, question=question,
                  answers=[w for w, _ in counts[:3]], metric="all",
                  continuation=" " + " ".join(draws(n + 40)[n:]), max_new_tokens=24, tokens=tokens)
