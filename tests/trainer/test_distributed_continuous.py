"""`rollout_mode="continuous"` on two CPU processes: per rank under DDP (a rank whose episodes
end early makes fewer generate calls, and training still steps together), refused under ZeRO-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .test_distributed import JOB, ROOT, cpu_config


def launch(mode, tmp_path):
    config = cpu_config(mode, tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(JOB),
           "--out", str(tmp_path), "--rollout_mode", "continuous"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_continuous_rollouts_play_per_rank_under_ddp(tmp_path):
    proc = launch("ddp", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 2
    for generation in zip(ranks[0]["rollouts"], ranks[1]["rollouts"]):
        assert max(generation[0]["episode_lengths"]) == 1 and min(generation[1]["episode_lengths"]) == 4
        # no cross-rank lockstep: rank 0 stops calling generate once its episodes are over
        assert generation[0]["generate_calls"] == 1 and generation[1]["generate_calls"] == 4
    assert ranks[0]["final_eval"]["num_tasks"] == 2


@pytest.mark.slow
def test_continuous_rollouts_are_refused_under_zero3(tmp_path):
    proc = launch("zero3", tmp_path)
    assert proc.returncode != 0
    assert "rollout_mode='continuous' cannot run under ZeRO-3" in proc.stdout + proc.stderr
