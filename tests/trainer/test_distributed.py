"""Two CPU processes under `accelerate launch`: plain DDP, DeepSpeed ZeRO-2 and ZeRO-3.

The project's accelerate configs are switched to CPU (use_cpu, no mixed precision, two
processes); DDP uses accelerate's torchrun launcher with gloo. Each run trains two
steps of `dist_job.py` and must show that task groups stay on one rank, that both
ranks take the same number of optimizer steps, and that rank 0, whose episodes all end
after one turn, still joins every generate call of rank 1 (under ZeRO-3 a missing
call would hang the collective parameter gather; the timeout turns a hang into a
failure).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "trainer" / "dist_job.py"


def free_port() -> int:
    """A port nobody listens on now: the launcher's default (29500) may be another job's on a shared machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_config(mode: str, path: Path) -> Path:
    """An accelerate config for two CPU processes, with a free `main_process_port` (not the default 29500)."""
    if mode == "ddp":
        config = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "MULTI_GPU",  # torchrun launcher; the job's use_cpu=True picks gloo
            "mixed_precision": "no",
            "num_machines": 1,
            "machine_rank": 0,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": False,
        }
    else:
        source = "accelerate_config.yaml" if mode == "zero2" else "accelerate_config_zero3.yaml"
        config = yaml.safe_load((ROOT / source).read_text())
        config.update(use_cpu=True, mixed_precision="no")
    config["num_processes"] = 2
    config["main_process_port"] = free_port()
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_two_process_training(mode, tmp_path):
    config = cpu_config(mode, tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(JOB), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    assert all(r["world"] == 2 for r in ranks)
    expected_type = "MULTI_CPU" if mode == "ddp" else "DEEPSPEED"
    assert all(r["distributed_type"].endswith(expected_type) for r in ranks)
    # the same number of optimizer steps on both ranks
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 2
    for generation in zip(ranks[0]["rollouts"], ranks[1]["rollouts"]):
        # every task group holds one task, and no task appears on both ranks
        for record in generation:
            assert all(len(group) == 1 for group in record["groups"])
        tasks0 = {t for g in generation[0]["groups"] for t in g}
        tasks1 = {t for g in generation[1]["groups"] for t in g}
        assert not tasks0 & tasks1
        # rank 0's episodes end after one turn, rank 1's run the whole budget ...
        assert max(generation[0]["episode_lengths"]) == 1
        assert min(generation[1]["episode_lengths"]) == 4
        # ... yet rank 0 made every generate call rank 1 made
        assert generation[0]["generate_calls"] == generation[1]["generate_calls"] == 4
    # the final evaluation gathered both ranks' tasks
    assert ranks[0]["final_eval"]["num_tasks"] == 2
