"""Rebuild the warm-start adapter the main job ships, bit for bit, from the embedded model.

    OMP_NUM_THREADS=1 python -m bench.warm_start_adapter            # rebuild warm_starts/smollm2-135m-textcraft
    OMP_NUM_THREADS=1 python -m bench.warm_start_adapter --check    # rebuild in a temp dir, compare with the shipped one

`python train.py` loads `warm_starts/smollm2-135m-textcraft` (MAIN_JOB_DEFAULTS'
`warm_start_from`) instead of training it, which would take most of its 10 minutes.
This script runs the very code `python train.py --warm_start_steps N` runs
(`bipace_trainer.run.warm_start`: the main job's env, splits, history, turn budget and LoRA
settings, the expert's play on the training goals, TRL's SFTTrainer) with the settings
in WARM_START below, on one thread and with PYTHONHASHSEED=0: a CPU run is deterministic for
a fixed thread count, so the adapter's tensors come out identical (`--check` compares their SHA-256). It writes
`warm_start.json` next to the adapter: the settings, loss curve, timings and the hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# TextCraft's task text no longer follows Python's per-process string hashing (envs/textcraft.py);
# the hash seed is pinned anyway (re-exec under PYTHONHASHSEED=0) so that nothing else iterating a set
# of strings can change the demonstrations between runs.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import get_peft_config  # noqa: E402

from bench.common import machine  # noqa: E402
from bipace_trainer.models import load_tokenizer, resolve_model_name  # noqa: E402
from bipace_trainer.run.warm_start import demonstration_rows, train_warm_start, WARM_START_DIR  # noqa: E402
from bipace_trainer.cli.train import MAIN_JOB_DEFAULTS, SHIPPED_WARM_START, parse_args  # noqa: E402

# The flags of `python train.py --warm_start_steps N ...` that rebuild the shipped adapter.
WARM_START = ["--warm_start_steps", "32", "--warm_start_tasks", "0", "--warm_start_batch_size", "4",
              "--warm_start_learning_rate", "1e-3"]
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, flags: list[str]) -> dict:
    torch.set_num_threads(1)
    script_args, training_args, model_args = parse_args([*flags, "--output_dir", str(out / "run")])
    start_cpu, start = time.process_time(), time.perf_counter()
    model_name = resolve_model_name(model_args.model_name_or_path)
    tokenizer = load_tokenizer(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    rows = demonstration_rows(training_args, script_args)
    _, report = train_warm_start(model, tokenizer, rows, get_peft_config(model_args), script_args, training_args)
    out.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copy(out / "run" / WARM_START_DIR / name, out / name)
    shutil.rmtree(out / "run")
    report.pop("adapter")
    report.update(
        flags=flags,
        main_job_lora={k: MAIN_JOB_DEFAULTS[k] for k in ("lora_r", "lora_alpha", "lora_target_modules")},
        wall_seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - start_cpu,
        sha256=sha256(out / "adapter_model.safetensors"),
        machine=machine(),
    )
    (out / "warm_start.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(SHIPPED_WARM_START), help="where the adapter goes")
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    parser.add_argument("--steps", type=int, help="override warm_start_steps (a quick determinism check)")
    args = parser.parse_args()
    flags = list(WARM_START)
    if args.steps is not None:
        flags[1] = str(args.steps)
    if args.check:
        shipped = json.loads((Path(args.out) / "warm_start.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            report = build(Path(tmp) / "adapter", flags)
        same = report["sha256"] == shipped["sha256"]
        print(f"rebuilt sha256 {report['sha256']}\nshipped sha256 {shipped['sha256']}\n"
              f"{'identical' if same else 'DIFFERENT'}; {report['wall_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU")
        sys.exit(0 if same else 1)
    report = build(Path(args.out), flags)
    print(json.dumps({k: report[k] for k in ("rows", "steps", "wall_seconds", "cpu_seconds", "sha256")}, indent=2))
    print(f"adapter written to {args.out}")


if __name__ == "__main__":
    main()
