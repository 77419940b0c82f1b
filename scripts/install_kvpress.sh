#!/usr/bin/env bash
# NVIDIA kvpress in its own virtual environment, for benchmarks/peer_kvpress.py. kvpress 0.5.5 pins
# transformers < 5.3 and kvpack needs >= 5.20, so the two never share an environment; the worker loads
# kvpack's converted model directory (SmolLM2 or Qwen2.5, made by kvpack in its own environment) and needs no network.
# Usage: bash scripts/install_kvpress.sh [VENV_DIR (default .kvpress-venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.kvpress-venv}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
# The CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build), then kvpress.
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "kvpress==0.5.5"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import transformers
assert md.version("kvpress") == "0.5.5", md.version("kvpress")
assert tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 3), transformers.__version__
print("kvpress", md.version("kvpress"), "with transformers", transformers.__version__)
PY
