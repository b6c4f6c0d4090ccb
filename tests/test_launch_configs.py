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
    assert (tmp_path / "run" / "model.safetensors").exists() or list((tmp_path / "run").glob("*.safetensors"))
