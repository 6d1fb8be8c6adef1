#!/usr/bin/env bash
# Creates benchmarks/peers/.venv-llamacpp with llama-cpp-python (llama.cpp's Python bindings),
# compiled from PyPI's sdist for this CPU (-march=native, OpenMP, no BLAS), for side-by-side
# benchmarks with llamacpp_runner.py. No torch. The compile takes several minutes on 2 cores;
# it needs cmake (>= 3.21) and a C/C++ compiler with OpenMP (gcc/g++), nothing else.
# LLAMA_CPP_PYTHON_VERSION overrides the version; the multimodal (mtmd/llava) library is not
# built, since the runner only uses the text API. Never committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-llamacpp"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q numpy
# The build's flags are this machine's (GGML_NATIVE), so never reuse a cached wheel.
# On CPUs with AMX the build leaves ggml's AMX backend out (explicit -mno-amx-* flags win
# over -march=native in GCC): in 0.3.36 its matmul segfaults on the embedded SmolLM2's
# Q4_1 GGUF (seen on a 2-core Sapphire Rapids VM, backtrace in ggml_backend_amx_mul_mat),
# and the AVX-512/VNNI kernels and the repacked layouts stay. LLAMA_CPP_AMX=1 keeps it.
extra_flags=""
if grep -q amx_int8 /proc/cpuinfo && [ "${LLAMA_CPP_AMX:-0}" != "1" ]; then
    extra_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" \
    CFLAGS="$extra_flags" CXXFLAGS="$extra_flags" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$venv/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$version"
"$venv/bin/python" - <<'EOF'
import importlib.util

import llama_cpp

assert importlib.util.find_spec("torch") is None, "torch must not be in this venv"
print("llama_cpp", llama_cpp.__version__)
print(llama_cpp.llama_print_system_info().decode().strip())
EOF
