"""What the vLLM job scripts of this folder share: the environment set before vLLM is
imported, their two arguments and how they hand their result to the test.

The jobs run in the venv of make_venv.sh as `PYTHONPATH=. python tests/vllm/X_job.py --out
result.json ...` (all but eval_job.py with `--workdir DIR`, parsed by `job_arguments`); the test
that started one asserts on its JSON. server_job.py (under `accelerate launch`, a stand-in
for the server's HTTP client, no vLLM engine) keeps its own start.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

# Imported before vLLM: 1 GiB of KV cache is plenty for the tiny models (the default wants
# a share of the machine's memory), and TRL's experimental-API warnings stay out of the log.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def job_arguments(parser: argparse.ArgumentParser | None = None) -> tuple[argparse.Namespace, Path]:
    """`--out` (the result's JSON) and `--workdir` (models, checkpoints, dumps) added to
    `parser` (a job's own flags already on it), parsed; the work folder as a Path."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="where the job writes its result (JSON)")
    parser.add_argument("--workdir", required=True, help="the job's folder (models, checkpoints, dumps)")
    args = parser.parse_args()
    return args, Path(args.workdir)


def write_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    Path(args.out).write_text(json.dumps(result, indent=1))
