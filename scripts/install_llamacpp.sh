#!/usr/bin/env bash
# llama.cpp (llama-cpp-python, built from source) in its own virtual environment, for
# benchmarks/peer_llamacpp.py. It is not a kvpack dependency and shares nothing with kvpack's environment.
# About 25 minutes on 2 cores. Usage: bash scripts/install_llamacpp.sh [VENV_DIR (default .llamacpp-venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.llamacpp-venv}
VERSION=0.3.36
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
# CPU build for this machine's vector ISA. AMX is left out: ggml's AMX matmul (on by default where the CPU
# reports AMX) dies with SIGILL on `tilezero` here even after the process asks the kernel for the tile
# state (measured on the project's Xeon, llama-cpp-python 0.3.36); AVX-512 (VNNI, BF16) stays on.
if grep -q avx512f /proc/cpuinfo; then
  ISA="-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
else
  ISA="-DGGML_AVX512=OFF"
fi
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON $ISA \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$VENV/bin/pip" install --quiet --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; assert llama_cpp.__version__ == '$VERSION', llama_cpp.__version__; print('llama-cpp-python', llama_cpp.__version__, 'in $VENV')"
