"""Measure a :class:`~kvpack.resident.pca_quant.layer_budgets.LayerProfile`: how much coding each layer alone costs
the model, at a grid of budgets (``kvpack calibrate --method pca_quant``).

Per calibration chunk (``chunk_tokens`` of the calibration corpus, the same standard-library text kvtc
calibrates on, then ``continuation`` more): one exact prefill of the chunk; the exact cache's next-token
log-probabilities over the continuation, teacher-forced; then for every layer and budget a cache whose
only coded layer is that one (every other layer exact, from the same prefill) and the KL of its
log-probabilities to the exact ones, averaged over the continuation's positions and the chunks.
A layer's coding sees only its own tokens, so the coded layer is built from the one prefill exactly as
if it had been coded during it (``kvpack.hf.prefill``).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..divergence import kl_per_position
from ..hf.attach import attach
from ..hf.cache import cache_kwargs
from ..hf.fingerprint import full_attention_layers, model_fingerprint
from ..hf.prefill import exact_prefill, resident_cache_from
from ..resident import LayerLayout, LayerStore, StoreFactory, get_resident_method
from ..resident.full import FullConfig, FullStore
from ..resident.pca_quant.layer_budgets import LayerProfile
from ..storage.kvtc.corpus import corpus_token_ids

PROFILE_BUDGETS = (0.05, 0.075, 0.1, 0.15, 0.2, 0.28, 0.4, 0.6)
PROFILED_METHODS = ("pca_quant",)


class OneLayerCoded(StoreFactory):
    """A method's stores for layer ``layer`` only; exact (FullKV) stores for every other layer."""

    def __init__(self, coded: StoreFactory, layer: int | None):
        super().__init__(coded.store_cls, coded.config)
        self.layer = layer
        self.exact = StoreFactory(FullStore, FullConfig(storage_dtype="auto"))

    def new_group(self, layouts: list[LayerLayout]):
        return None

    def new_store(self, layout: LayerLayout, group=None) -> LayerStore:
        if layout.layer_idx == self.layer:
            return self.store_cls(layout, self.config)
        return self.exact.new_store(layout)


def _continuation_logprobs(model, cache, ids: list[int], total: int) -> torch.Tensor:
    """``[len(ids), vocab]`` fp32 log-probabilities of ``ids`` teacher-forced after the cache's tokens."""
    x = torch.tensor([ids], device=model.device)
    mask = torch.ones(1, total, dtype=torch.long, device=model.device)
    with attach(model, cache=cache):
        out = model(x, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _token_chunks(tokenizer, n: int, length: int, documents: list[str] | None) -> list[list[int]]:
    ids = corpus_token_ids(tokenizer, n * length, documents)
    if len(ids) < n * length:
        raise ValueError(f"the calibration corpus gave {len(ids)} tokens, fewer than {n} chunks of {length}")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


@torch.no_grad()
def profile_layers(model, tokenizer, method: str = "pca_quant", budgets: tuple[float, ...] = PROFILE_BUDGETS,
                   chunks: int = 2, chunk_tokens: int = 4096, continuation: int = 64,
                   documents: list[str] | None = None, token_chunks: list[list[int]] | None = None,
                   progress: bool = True, **config) -> LayerProfile:
    """The layer profile of ``model`` for ``method`` (its other options in ``config``).

    Args:
        token_chunks: token-id sequences to use instead of the corpus (each ``chunk_tokens + continuation``
            long; ``tokenizer`` may then be None).
    """
    if method not in PROFILED_METHODS:
        raise ValueError(f"a layer profile is made for {', '.join(PROFILED_METHODS)}, not {method!r}")
    if chunks < 1 or chunk_tokens < 16 or continuation < 1:
        raise ValueError(f"need chunks >= 1, chunk_tokens >= 16 and continuation >= 1; got {chunks}, "
                         f"{chunk_tokens}, {continuation}")
    if "budget" in config or "calibration" in config:
        raise ValueError("the profile measures every budget of its grid, without a calibration: do not set "
                         "budget or calibration")
    start = time.perf_counter()
    corpus = "given" if documents is not None or token_chunks is not None else "kvtc's standard-library corpus"
    if token_chunks is None:
        token_chunks = _token_chunks(tokenizer, chunks, chunk_tokens + continuation, documents)
    elif any(len(c) != chunk_tokens + continuation for c in token_chunks):
        raise ValueError(f"token_chunks must each be chunk_tokens + continuation = {chunk_tokens + continuation} ids")
    layers = full_attention_layers(model)
    codecs = {b: get_resident_method(method, budget=b, **config) for b in budgets}
    kl = torch.zeros(len(layers), len(budgets), dtype=torch.float64)
    bar = tqdm(total=len(token_chunks) * len(layers) * len(budgets), desc="[kvpack] layer profile", unit="cache",
               disable=not progress)
    for ids in token_chunks:
        prefix, cont = ids[:chunk_tokens], ids[chunk_tokens:]
        prefill = exact_prefill(model, prefix)
        exact = resident_cache_from(model, OneLayerCoded(codecs[budgets[0]], None), prefill)
        ref = _continuation_logprobs(model, exact, cont, len(ids))
        for i, layer in enumerate(layers):
            for j, b in enumerate(budgets):
                cache = resident_cache_from(model, OneLayerCoded(codecs[b], layer), prefill)
                logp = _continuation_logprobs(model, cache, cont, len(ids))
                # clamped at 0 per position: the profile refuses negative KL (kl_per_position's numerics)
                per_position = kl_per_position(ref, logp)
                kl[i, j] += per_position.mean() / len(token_chunks)
                bar.update(1)
    bar.close()
    settings = {"config": codecs[budgets[0]].config.to_dict() | {"budget": None}, "chunks": len(token_chunks),
                "chunk_tokens": chunk_tokens, "continuation": continuation,
                "corpus": corpus}
    return LayerProfile(method=method, fingerprint=model_fingerprint(model), layers=layers, budgets=list(budgets),
                        kl=kl.tolist(), settings=settings,
                        stats={"seconds": round(time.perf_counter() - start, 1)})
