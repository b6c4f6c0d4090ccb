#!/usr/bin/env bash
# The GPU check of issue 41: bf16 LoRA train steps on the HF path with random-initialised
# Qwen2.5-0.5B and -1.5B (no Hub), lockstep against continuous rollouts; step time, tokens/s and
# peak GPU memory in one JSON ($OUT/gpu_check.json when OUT is set, else
# outputs/gpu_check/gpu_check.json). Under 10 minutes on one GPU (bench/gpu_check.py --budget_s
# starts no run after 8 min). On a machine without a GPU it says so and exits 0.
#
#   bash bench/gpu_check.sh [bench/gpu_check.py flags: --sizes 0.5b --steps 3 ...]
#
# Wheels the GPU machine lacks are installed from bench/gpu_wheels/ when that folder holds any
# (git ignores it; nothing there is committed). Prepare it on a machine with pip's index, once:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d bench/gpu_wheels \
#     trl==1.16.0 transformers==5.24.0 peft==0.21.2 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# (all pure Python, ~15 MB), and carry bench/gpu_wheels with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: needs a GPU (torch.cuda.is_available() is False here); nothing was run."
  exit 0
fi

shopt -s nullglob
wheels=(bench/gpu_wheels/*.whl)
if (( ${#wheels[@]} )); then
  site=${TMPDIR:-/tmp}/gpu_check_site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 PYTHONUNBUFFERED=1
exec timeout 570 "$PYTHON" -m bench.gpu_check "$@"
