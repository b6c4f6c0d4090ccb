"""`max_staleness=1` on two CPU processes under `accelerate launch` (`dist_overlap_job.py`): DDP (gloo)
and DeepSpeed ZeRO-2 run it; ZeRO-3 and FSDP refuse it (the check, in-process).

Under DDP one launch trains a plain step, a four-step overlap run, the same run stopped at its
step-2 checkpoint and that run resumed, and must show: no collective issued from the background
rollout, which generated while DDP all-reduced the update's gradients; every generation after
the first played in the background on every rank (staleness 1), each rank on its own tasks;
the ranks' parameters equal after every step; the importance ratio logged and away from 1; the
first step as the plain run's; the same seed repeating the run; and the resume, from one
prefetched rollout per rank, ending as the uninterrupted run (and, with one rank's file lost,
every rank playing that generation afresh instead of waiting on each other). `ddp_timeout` (90 s) and the
subprocess timeout turn a deadlock into a failure instead of a hung suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .test_distributed import ROOT, cpu_config

JOB = ROOT / "tests" / "trainer" / "dist_overlap_job.py"


def launch(mode, tmp_path, model_dir, *extra):
    config = cpu_config(mode, tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(JOB),
           "--out", str(tmp_path), "--model", str(model_dir), *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)


def ranks_of(tmp_path, run):
    return [json.loads((tmp_path / f"{run}_rank{r}.json").read_text()) for r in range(2)]


def check_overlap_run(ranks, distributed_type):
    """What every overlap run on two ranks must show, whatever the backend."""
    assert all(r["world"] == 2 and r["distributed_type"].endswith(distributed_type) for r in ranks)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    for rank in ranks:
        # the background rollout issued no collective (`CollectiveThreads` sees the main thread's, so it works)
        assert rank["collectives"].get("bipace-rollout-overlap", 0) == 0 and rank["collectives"]["main"] > 0
        # generation 1 plays now, every later one in the background with the weights of one step before
        assert [g["behaviour_step"] for g in rank["generations"]] == [None, 0, 1, 2]
        assert [g["step"] for g in rank["generations"]] == [0, 1, 2, 3]
        logs = rank["logs"]
        assert [e["rollout/staleness"] for e in logs] == [0.0, 1.0, 1.0, 1.0]
        assert [e["rollout/prefetched"] for e in logs] == [0.0, 1.0, 1.0, 1.0]  # averaged over ranks: on both
        assert all(e["train/skipped_batches"] == 0.0 for e in logs)  # every step updated the weights
        for entry in logs[1:]:
            low, high = entry["sampling/importance_sampling_ratio/min"], entry["sampling/importance_sampling_ratio/max"]
            assert low <= entry["sampling/importance_sampling_ratio/mean"] <= high
        assert any(e["sampling/importance_sampling_ratio/min"] < 1 or e["sampling/importance_sampling_ratio/max"] > 1
                   for e in logs[1:])  # the weights moved between playing and training: the correction is active
    # the ranks hold the same parameters after every step, and they moved at every step
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(set(ranks[0]["digests"])) == 4
    # each rank played its own shard of tasks, with its own samples
    for mine, theirs in zip(ranks[0]["generations"], ranks[1]["generations"]):
        assert mine["tasks"] and not set(mine["tasks"]) & set(theirs["tasks"])
        assert mine["completions"] != theirs["completions"]


@pytest.mark.slow
def test_overlap_under_ddp(warm_policy_dir, tmp_path):
    proc = launch("ddp", tmp_path, warm_policy_dir, "--hold")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plain, straight, stopped, resumed = (ranks_of(tmp_path, run) for run in ("plain", "straight", "stopped", "resumed"))
    check_overlap_run(straight, "MULTI_CPU")
    for rank in straight:  # `--hold`: every update's all-reduce ran while a background rollout was generating
        assert rank["allreduces_beside_background"] == [4, 4] and rank["collectives_beside_background"] > 0

    # step 1 has nothing prefetched: the plain run's step, sample for sample and bit for bit
    for overlap, alone in zip(straight, plain):
        assert overlap["generations"][0]["completions"] == alone["generations"][0]["completions"]
        assert overlap["logs"][0]["loss"] == alone["logs"][0]["loss"]
        assert overlap["digests"][0] == alone["digests"][0]
    # the same seed repeats the run (the stopped run is the same run up to step 2)
    for again, first in zip(stopped, straight):
        assert again["generations"] == first["generations"][:2]
        assert [e["loss"] for e in again["logs"]] == [e["loss"] for e in first["logs"][:2]]
        assert again["digests"] == first["digests"][:2]

    # the step-2 checkpoint holds each rank's prefetched generation: its own rows, played by step 1's weights
    checkpoint = tmp_path / "stopped" / "checkpoint-2"
    saved = [torch.load(checkpoint / f"overlap_rollout_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [s["snapshot_step"] for s in saved] == [1, 1]
    for state, rank in zip(saved, straight):
        assert sorted({row["task_id"] for row in state["rows"]}) == rank["generations"][2]["tasks"]
        assert [s.completion_ids for s in state["rollout"].steps] == rank["generations"][2]["completions"]
    # resumed, each rank trains on its stored rollout first (staleness 1), then goes on as the straight run
    for after, first in zip(resumed, straight):
        assert after["generations"] == first["generations"][2:]
        assert [e["rollout/staleness"] for e in after["logs"][-2:]] == [1.0, 1.0]
        assert [e["loss"] for e in after["logs"][-2:]] == [e["loss"] for e in first["logs"][2:]]
        assert after["digests"] == first["digests"][2:]
    # rank 1's file lost: rank 0 drops its stored rollout, both play step 3 now (no rank waits on the other's gathers)
    partial = ranks_of(tmp_path, "partial")
    for rank in partial:
        assert rank["global_step"] == 4
        assert [g["behaviour_step"] for g in rank["generations"]] == [None, 2]
        assert [e["rollout/staleness"] for e in rank["logs"][-2:]] == [0.0, 1.0]
    assert partial[0]["digests"] == partial[1]["digests"]


@pytest.mark.slow
def test_overlap_under_zero2(warm_policy_dir, tmp_path):
    proc = launch("zero2", tmp_path, warm_policy_dir, "--runs", "straight")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_overlap_run(ranks_of(tmp_path, "straight"), "DEEPSPEED")


def test_overlap_is_refused_under_zero3_and_fsdp_and_with_trls_tool_envs(monkeypatch):
    """The check `BiPACETrainer.__init__` makes when max_staleness=1 (a 2-process ZeRO-3 launch
    reached it in 49 s; what it reads is the accelerator's DeepSpeed plugin and FSDP flag)."""
    from types import SimpleNamespace

    from bipace_trainer import BiPACETrainer
    from bipace_trainer.update.overlap import RolloutOverlap

    def trainer(zero_stage=None, fsdp=False):
        plugin = SimpleNamespace(zero_stage=zero_stage) if zero_stage else None
        return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
                               is_fsdp_enabled=fsdp, collector=None, batch_spec=None, num_generations=2)

    for sharded in (trainer(3), trainer(fsdp=True)):
        with pytest.raises(ValueError, match=r"max_staleness=1 cannot run under ZeRO-3 or FSDP.*Set max_staleness=0\."):
            BiPACETrainer._rollout_overlap(sharded, trl_envs=False)
    with pytest.raises(ValueError, match=r"max_staleness=1 plays the project's TextEnvs.*Set max_staleness=0\."):
        BiPACETrainer._rollout_overlap(trainer(2), trl_envs=True)
    # ZeRO-2 passes the check (its 2-process run is above)
    monkeypatch.setattr(RolloutOverlap, "__init__", lambda self, collector, *rest: setattr(self, "collector", collector))
    assert isinstance(BiPACETrainer._rollout_overlap(trainer(2), trl_envs=False), RolloutOverlap)
