"""The training path with the real vLLM engine (CPU build), in its own venv.

Builds the venv once (tests/vllm/make_venv.sh, ~3 min and ~3.8 GB on a fresh machine),
then runs tests/vllm/vllm_job.py there: 2 LoRA steps of `bipace_q` with
`use_vllm=True, vllm_mode="colocate"` on the tiny env, evaluations before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    if sys.platform != "linux":
        pytest.skip("vLLM's CPU build is for Linux")
    build = subprocess.run(
        ["bash", str(ROOT / "tests" / "vllm" / "make_venv.sh")], capture_output=True, text=True, timeout=1200
    )
    assert build.returncode == 0, f"building the vLLM venv failed:\n{build.stderr[-4000:]}"
    python = build.stdout.strip().splitlines()[-1]
    work = tmp_path_factory.mktemp("vllm_job")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    job = subprocess.run(
        [python, str(ROOT / "tests" / "vllm" / "vllm_job.py"), "--out", str(work / "result.json"), "--workdir", str(work)],
        capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT,
    )
    assert job.returncode == 0, f"the vLLM job failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    return json.loads((work / "result.json").read_text())


@pytest.mark.slow
def test_the_loss_runs_with_the_importance_sampling_correction(engine_run):
    trained = engine_run["generations"][:2]  # the third ran with the correction switched off
    for generation in trained:
        assert generation["nonzero_advantages"] > 0 and not generation["skip_update"]
        # TRL's default mode, sequence_mask: one ratio per sample
        assert generation["is_ratio_shape"] == [generation["completion_shape"][0], 1]
        assert generation["sampling_logprobs_per_step"]
    assert engine_run["lora_changed"]
    assert len(engine_run["losses"]) == 2 and all(loss != 0 for loss in engine_run["losses"])
    for metrics in engine_run["is_metrics"]:
        assert 0 < metrics["sampling/importance_sampling_ratio/min"] <= metrics["sampling/importance_sampling_ratio/max"]
        assert metrics["sampling/sampling_logp_difference/mean"] >= 0
    # --vllm_importance_sampling_correction false: no ratio, no sampling logprobs in the batch
    assert engine_run["generations"][2]["is_ratio_shape"] is None
    assert "importance_sampling_ratio" not in engine_run["uncorrected_keys"]
    assert "old_per_token_logps" in engine_run["uncorrected_keys"]


@pytest.mark.slow
def test_hidden_states_come_from_the_old_logprob_pass(engine_run):
    for generation in engine_run["generations"]:
        assert generation["all_steps_have_hidden"]
    # the same states an extra forward pass over the prompts gives
    assert max(engine_run["hidden_gaps"]) < 1e-4


@pytest.mark.slow
def test_weights_move_to_the_engine_once_per_step(engine_run):
    # cumulative pushes after each of the 2 steps (4 turns each): the evaluation before
    # training pushes step 0's weights, step 1 pushes once more; never once per turn
    assert engine_run["weight_syncs"] == [1.0, 2.0]
    probe = engine_run["probe"]
    after = max(abs(a - b) for a, b in zip(probe["engine_after"], probe["trainer_after"]))
    before = max(abs(a - b) for a, b in zip(probe["engine_before"], probe["trainer_after"]))
    # after a sync the engine scores a fixed completion as the trained policy does (vLLM's
    # CPU kernels and bf16 attention: ~0.02 nats), which the initial weights do not
    assert after < 0.05 and before > 4 * after


@pytest.mark.slow
def test_evaluation_samples_at_the_eval_temperature(engine_run):
    temperatures = {tuple(t) for t in engine_run["temperatures"]}
    assert temperatures == {("train", engine_run["train_temperature"]), ("eval", engine_run["eval_temperature"])}
    assert [e["tag"] for e in engine_run["eval_history"]] == ["before", "final"]
    assert all(e["num_tasks"] > 0 for e in engine_run["eval_history"])
