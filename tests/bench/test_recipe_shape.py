"""bench.recipe_shape at CI size: the ALFWorld recipe's settings (sizes cut) through `accelerate launch`
with accelerate_config_cpu.yaml, 2 processes, DeepSpeed ZeRO-2, bf16 as the recipe writes it, on a
model of Qwen2.5's vocabulary (151936) and the recipe's cluster layer; one step, each rank's peak
memory recorded. The full Qwen2.5-0.5B shape is the bench's default (docs/tutorials/scaling.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two processes build DeepSpeed and train a step
def test_the_alfworld_recipe_runs_one_step_on_two_cpu_processes(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("alfworld")
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.recipe_shape", "--quick", "--workdir", str(tmp_path / "work"),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 1 and result["zero_stage"] == 2 and result["precision"] == "bf16"
    assert sorted(result["peak_rss_gib_per_rank"]) == ["0", "1"]
    assert all(gib > 0.2 for gib in result["peak_rss_gib_per_rank"].values())  # each rank loaded torch and a model
    recipe = (tmp_path / "work" / "recipe.yaml").read_text()
    assert "preset: bipace_q" in recipe and "cluster_layer: -12" in recipe and "env_backend: process" in recipe
