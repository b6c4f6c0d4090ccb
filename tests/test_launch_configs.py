"""The shipped accelerate configs, one per machine users have (docs/tutorials/scaling.md): each parses
as accelerate reads it and says what its name says, and the CPU one trains a real step with two
processes, as a laptop user would try the multi-process path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file

ROOT = Path(__file__).resolve().parents[1]
# file -> (distributed_type, DeepSpeed ZeRO stage or None, mixed precision, processes, use_cpu)
CONFIGS = {
    "accelerate_config_1gpu.yaml": ("NO", None, "bf16", 1, False),
    "accelerate_config.yaml": ("DEEPSPEED", 2, "bf16", 8, False),
    "accelerate_config_zero3.yaml": ("DEEPSPEED", 3, "bf16", 8, False),
    "accelerate_config_cpu.yaml": ("DEEPSPEED", 2, "no", 2, True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_config_parses_as_accelerate_reads_it_and_is_what_its_name_says(name):
    config = load_config_from_file(str(ROOT / name))
    kind, stage, precision, processes, cpu = CONFIGS[name]
    assert str(config.distributed_type).endswith(kind)
    assert (config.deepspeed_config or {}).get("zero_stage") == stage
    assert str(config.mixed_precision).endswith(precision) and config.num_processes == processes and config.use_cpu is cpu


def test_every_config_is_documented_on_the_scaling_page_with_its_extra():
    page = (ROOT / "docs" / "tutorials" / "scaling.md").read_text()
    for name, (kind, *_) in CONFIGS.items():
        assert f"`{name}`" in page, name
    assert 'pip install -e ".[deepspeed]"' in page


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # two processes train a step
def test_the_cpu_config_trains_one_step_with_two_processes(raw_tiny_dir, tmp_path):
    pytest.importorskip("deepspeed")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_config_cpu.yaml",
        "--main_process_port", str(free_port()), "train.py", "--model_name_or_path", str(raw_tiny_dir),
        "--env", "tiny", "--env_kwargs", '{"size": 4}', "--preset", "gigpo", "--use_peft", "false", "--max_steps", "1",
        "--tasks_per_iteration", "2", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_turns", "2", "--eval_tasks", "2", "--output_dir", str(tmp_path / "run"),
        "--summary_file", str(tmp_path / "summary.json"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1
    assert proc.stdout.count("=== summary ===") == 1  # rank 0 prints the summary, once
    assert "FutureWarning" not in proc.stdout + proc.stderr  # TRL's and DeepSpeed's deprecated names, filtered
    assert (tmp_path / "run" / "model.safetensors").exists() or list((tmp_path / "run").glob("*.safetensors"))


def launch(config: str, *argv: str) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file CONFIG train.py ARGV` from the checkout, as the docs print it."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port",
           str(free_port()), "train.py", *argv]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "OMP_"))}
    env.update(PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def refusals(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("train.py: error: ")]


@pytest.mark.slow  # launches train.py
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_the_one_gpu_config_on_a_machine_without_a_gpu_is_refused_naming_the_cpu_config(raw_tiny_dir, tmp_path):
    """Before: it trained on the CPU under bf16 autocast, on one thread, saying nothing."""
    proc = launch("accelerate_config_1gpu.yaml", "--model_name_or_path", str(raw_tiny_dir), "--env", "tiny",
                  "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert len(refusals(proc)) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "mixed_precision=bf16 (the accelerate config's) is a GPU config's" in refusals(proc)[0]
    assert "--config_file accelerate_config_cpu.yaml" in refusals(proc)[0] and not (tmp_path / "run").exists()


@pytest.mark.slow  # launches two processes
def test_the_cpu_config_takes_the_main_job_and_a_batch_shape_refusal_names_the_one_flag_that_fixes_it(raw_tiny_dir):
    """Before: the main job under the CPU config was refused naming per_device_train_batch_size, following that
    advice gave a second refusal, and the fix (--tasks_per_iteration 2) was never named."""
    pytest.importorskip("deepspeed")
    printed = launch("accelerate_config_cpu.yaml", "--print_config")  # the main job, as the docs print it, resolved
    assert printed.returncode == 0, printed.stdout[-2000:] + printed.stderr[-3000:]
    assert printed.stdout.count("\ntasks_per_iteration: 2\n") == 1  # one goal per process; printed by rank 0 only
    refused = launch("accelerate_config_cpu.yaml", "--model_name_or_path", str(raw_tiny_dir), "--env", "tiny",
                     "--tasks_per_iteration", "1")  # fmt: skip
    assert len(refusals(refused)) == 1, refused.stderr[-3000:]
    assert refusals(refused)[0].endswith("tasks_per_iteration × num_generations = 1 × 4: pass --tasks_per_iteration 2.")
