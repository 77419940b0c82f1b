"""kvtc on SmolLM2 (bf16): ratios, throughput, time to first token vs recomputing, needles, vs lossless.

For each calibrated ratio, on a ~4K-token needle prompt:
  * blob size and the honest ratio (dense bf16 cache ÷ whole blob, header/scales/sinks/window
    included), and the ratio of the coded middle alone;
  * encode and decode throughput in MB/s of dense bf16 KV (medians);
  * time to first token of a follow-up question: decompress + prefill the question + first decode
    step, vs recomputing the whole prefix + question (median of runs, same process);
  * relative squared error of the restored keys and values;
and the lossless baselines on the same raw bf16 cache (zlib level 6 = DEFLATE, zstd level 3), plus
needle retrieval at ~2K tokens (--needles prompts per ratio).

Usage: python benchmarks/bench_kvtc.py --calibration DIR [--tokens 4096] [--needles 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _util import machine  # noqa: E402

from kvpack.generate import generate  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import QUESTION, needle_prompt  # noqa: E402
from kvpack.storage.kvtc.codec import load_calibration  # noqa: E402
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache  # noqa: E402
from kvpack.storage.kvtc.session import continue_from_blob, prefill  # noqa: E402
from kvpack.store.format import Blob  # noqa: E402


def _rel_err(restored, cache, attr):
    num = sum(float((getattr(a, attr).float() - getattr(b, attr).float()).pow(2).sum())
              for a, b in zip(restored.layers, cache.layers))
    return num / sum(float(getattr(b, attr).float().pow(2).sum()) for b in cache.layers)


def _raw_bf16(cache) -> bytes:
    parts = []
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            parts.append(t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return b"".join(parts)


def _median(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--needles", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    calib = load_calibration(args.calibration)
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    calib.check_model(model)
    print(f"# bench_kvtc ({machine()}), model bf16, calibration {calib.calibration_id} "
          f"({calib.stats['chunks']} x {calib.settings['chunk_tokens']} tokens, pca_dim {calib.settings['pca_dim']})")
    t = calib.stats["timings"]
    print(f"calibration time: prefill {t['prefill_s']:.1f} s, PCA {t['pca_keys_s'] + t['pca_values_s']:.1f} s, "
          f"DP {t['dp_keys_s'] + t['dp_values_s']:.1f} s, total {t['total_s']:.1f} s")

    prompt, answer = needle_prompt(tok, args.tokens, depth=0.5, seed=1)
    haystack = prompt[: prompt.index(QUESTION)]
    prefix = tok(haystack).input_ids
    question = tok(QUESTION, add_special_tokens=False).input_ids
    full_ids = prefix + question
    cache = prefill(model, prefix)
    raw = _raw_bf16(cache)
    dense_mb = len(raw) / 1e6
    z = len(zlib.compress(raw, 6))
    import zstandard

    zs = len(zstandard.ZstdCompressor(level=3).compress(raw))
    print(f"\nprefix {len(prefix)} tokens, dense bf16 KV {len(raw):,} bytes; lossless: zlib-6 {len(raw) / z:.3f}x, "
          f"zstd-3 {len(raw) / zs:.3f}x")

    def recompute():
        x = torch.tensor([full_ids])
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                              pad_token_id=tok.pad_token_id)

    ttft_recompute, _ = _median(recompute, args.repeats)
    print(f"TTFT recomputing {len(full_ids)} tokens: {ttft_recompute:.3f} s (median of {args.repeats})")
    print("\nratio  blob bytes   total x   coded x  vs zlib  rel.err K  rel.err V  enc MB/s  dec MB/s  "
          "TTFT s  speed-up  answer")
    for ratio in calib.ratios():
        enc_s, blob = _median(lambda: compress_cache(cache, calib, ratio, prefix, model=model), args.repeats)
        dec_s, (restored, _) = _median(lambda: decompress_cache(blob, calib, model), args.repeats)
        parsed = Blob(blob)
        coded = sum(s["size"] for name, s in parsed.sections.items()
                    if name.startswith(("keys_", "values_")))
        coded_dense = parsed.meta["coded_tokens"] * calib.features * 2 * 2
        ttft, cont = _median(lambda: continue_from_blob(model, tok, calib, blob, question, max_new_tokens=1),
                             args.repeats)
        more = continue_from_blob(model, tok, calib, blob, question, max_new_tokens=10)
        print(f"{ratio:>5g}  {len(blob):>10,}  {len(raw) / len(blob):>8.2f}  {coded_dense / coded:>8.2f}  "
              f"{(len(raw) / len(blob)) / (len(raw) / z):>7.1f}  {_rel_err(restored, cache, 'keys'):>9.4f}  "
              f"{_rel_err(restored, cache, 'values'):>9.4f}  {dense_mb / enc_s:>8.1f}  {dense_mb / dec_s:>8.1f}  "
              f"{ttft:>6.3f}  {ttft_recompute / ttft:>8.2f}  {'yes' if answer in more.text else 'no'}")

    print(f"\nneedles at ~2K tokens ({args.needles} per ratio, depths 0.1..0.9):")
    cases = [(100 + i, 0.1 + 0.8 * i / max(1, args.needles - 1)) for i in range(args.needles)]
    prompts = [needle_prompt(tok, 2048, depth, seed) for seed, depth in cases]
    for ratio in calib.ratios():
        hits, ratios = 0, []
        for p, a in prompts:
            r = generate(model, tok, p, "kvtc", {"calibration": args.calibration, "ratio": ratio}, max_new_tokens=10)
            hits += a in r.text
            ratios.append(r.dense_kv_bytes / r.kv_bytes)
        print(f"  kvtc {ratio:g}x: {hits}/{len(prompts)} retrieved, mean measured ratio {statistics.mean(ratios):.2f}x")
    hits = sum(a in generate(model, tok, p, "full", max_new_tokens=10).text for p, a in prompts)
    print(f"  full: {hits}/{len(prompts)} retrieved")


if __name__ == "__main__":
    main()
