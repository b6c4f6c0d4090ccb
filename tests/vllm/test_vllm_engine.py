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

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(probe[a], probe[b]))

    # after a sync the engine scores a fixed completion as the trained policy does (vLLM's
    # CPU kernels: ~0.02 nats); 2 LoRA steps move it too little to tell a sync from none
    assert gap("engine_after", "trainer_after") < 0.05
    # a large, known push of every lora_B (> 2 nats on the probe) tells: before the next
    # sync the engine still scores the old weights, after it the pushed ones
    assert gap("trainer_pushed", "trainer_after") > 2.0
    assert gap("engine_stale", "trainer_pushed") > 1.0
    # (the pushed logits are larger, and so is the engine's rounding: the bound is relative)
    assert gap("engine_pushed", "trainer_pushed") < 0.1 * gap("engine_stale", "trainer_pushed")


@pytest.mark.slow
def test_evaluation_samples_at_the_eval_temperature(engine_run):
    temperatures = {tuple(t) for t in engine_run["temperatures"]}
    assert temperatures == {("train", engine_run["train_temperature"]), ("eval", engine_run["eval_temperature"])}
    assert [e["tag"] for e in engine_run["eval_history"]] == ["before", "final"]
    assert all(e["num_tasks"] > 0 for e in engine_run["eval_history"])
