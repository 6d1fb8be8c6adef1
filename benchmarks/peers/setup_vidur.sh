#!/usr/bin/env bash
# Creates benchmarks/peers/.venv-vidur with Vidur (MLSys'24 LLM inference simulator; PyPI
# `vidur==0.0.26`, MIT) for benchmarks/simulate_vidur.py. CPU only: Vidur's simulator needs
# no torch (only its GPU profilers import it, and they are not used). About 1.3 GB; never
# committed. The benchmark keeps Vidur's predictor cache (about 0.65 GB after the two setups)
# and its work files in the venv too.
#
# Profiling data. The 0.0.26 wheel ships no per-op GPU profiles: at run time its
# execution-time predictor calls huggingface_hub.snapshot_download for two datasets,
#   compute: project-vajra/dev-staging-meta-llama-llama-3-8b-h100  (mlp.csv.xz, attention.csv.xz, config.json)
#   network: project-vajra/dev-staging-h100-dgx                     (all_reduce.csv.xz, send_recv.csv.xz, config.json)
# On a machine that reaches the Hugging Face hub, fetch them once into $VIDUR_DATA:
#   huggingface-cli download --repo-type dataset project-vajra/dev-staging-meta-llama-llama-3-8b-h100 --local-dir "$VIDUR_DATA/compute"
#   huggingface-cli download --repo-type dataset project-vajra/dev-staging-h100-dgx --local-dir "$VIDUR_DATA/network"
# and run the benchmark with VIDUR_DATA set (or --vidur-data): it lays them into the offline
# cache layout Vidur reads (HF_HUB_OFFLINE=1), so nothing is downloaded at run time.
#
# The GitHub repository microsoft/vidur keeps an older copy under data/profiling/ (plain
# .csv; at its newest commit, 7d47513, there is no h100/meta-llama/Meta-Llama-3-8B folder, and
# every attention.csv is over 4 MB). Its measured A100 Llama-3-8B MLP profile is what the
# benchmark's A100 setup uses; extracted from a bare clone with
#   git --git-dir=vidur.git show 7d47513:data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv \
#     > /tmp/vidur-data/a100_llama3_8b_mlp.csv
# and passed as --a100-mlp-profile /tmp/vidur-data/a100_llama3_8b_mlp.csv (1.2 MB; not committed).
# Without VIDUR_DATA the H100 setup feeds Vidur a profile generated from tandem's roofline,
# op by op (see docs/simulate.md, "Against Vidur").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-vidur"
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vidur==0.0.26"
"$venv/bin/python" -c "import vidur.main, vidur.config; from vidur._version import __version__ as v; print('vidur', v)"
if [ -n "${VIDUR_DATA:-}" ]; then
  test -d "$VIDUR_DATA" || { echo "VIDUR_DATA=$VIDUR_DATA is not a directory" >&2; exit 1; }
  echo "profiling data: $VIDUR_DATA"
fi
