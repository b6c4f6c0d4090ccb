"""Issue 29, end to end on the tiny model: a resampling run that never finds signal stops
within its step on SIGTERM, and a warm-started run resumed (after a kill during its SFT,
and again after a checkpoint) keeps its warm start, its run, its TensorBoard folder and
the user's README. The fast checks of the same faults are in test_hostile_use.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import preflight, train  # noqa: E402

SCRIPT = ROOT / "tests" / "reliability" / "run_tiny.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
TINY = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--max_turns", "4", "--max_completion_length", "16",
        "--use_cpu", "true", "--cluster_layer", "-1", "--dtype", "float32", "--eval_tasks", "2"]  # fmt: skip
LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj",
        "--lora_modules_to_save", "lm_head", "embed_tokens"]  # fmt: skip


@pytest.mark.slow
def test_resampling_that_never_finds_signal_is_logged_and_stops_within_the_step_on_sigterm(raw_tiny_dir, tmp_path):
    env = dict(ENV, SIGTERM_AT_RESET="12")  # 8 resets per generation: SIGTERM in the first redraw
    cmd = [sys.executable, str(SCRIPT), "--model", str(raw_tiny_dir), "--out", str(tmp_path), "--steps", "3",
           "--env", "tests.reliability.faulty_envs:ResampleForeverEnv", "--resample", "1000000"]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "step 1: no signal (every advantage 0); resampling on fresh tasks, attempt 1 of at most 1000000" in output
    assert "resampling ended for the stop request (SIGTERM) without signal" in output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["interrupted"] and result["global_step"] == 1
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_a_warm_started_run_resumes_after_a_kill_in_its_sft_and_keeps_its_warm_start(raw_tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    # What a SIGKILL during the warm start's SFT leaves: a half-saved adapter in its staging folder and no
    # checkpoint; and what an earlier killed dump left, next to the user's own notes.
    (out / ".warm_start.staging").mkdir(parents=True)
    (out / ".warm_start.staging" / "adapter_config.json").write_text("{")
    (out / "rollouts").mkdir()
    (out / "rollouts" / ".step-000001.jsonl.99.partial").write_bytes(b"")
    (out / "README.md").write_text("my notes | <b>keep</b>")
    flags = [*TINY, *LORA, "--model_name_or_path", str(raw_tiny_dir), "--output_dir", str(out), "--warm_start_steps", "4",
             "--warm_start_tasks", "2", "--save_strategy", "steps", "--save_steps", "1", "--report_to", "tensorboard",
             "--rollout_dump_steps", "1", "--resume_from_checkpoint", "true"]  # fmt: skip

    first = train.main(*train.parse_args([*flags, "--max_steps", "1"]))
    assert first["steps"] == 1 and first["warm_start"]["steps"] == 4 and "reused" not in first["warm_start"]
    assert (out / "warm_start" / "warm_start.json").is_file() and not (out / ".warm_start.staging").exists()
    assert not list((out / "rollouts").glob(".*.partial")) and (out / "rollouts" / "step-000001.jsonl").is_file()
    assert (out / "README.previous.md").read_text() == "my notes | <b>keep</b>"
    assert "bipace-trainer" in (out / "README.md").read_text()
    capsys.readouterr()

    second = train.main(*train.parse_args([*flags, "--max_steps", "2", "--seed", "7"]))
    printed = capsys.readouterr().out
    assert second["steps"] == 2 and second["warm_start"]["reused"] is True
    assert "not trained again" in printed and "seed=7 (checkpoint: 0;" in printed
    assert len(list((out / "runs").iterdir())) == 1  # the resumed run wrote on in its TensorBoard folder

    with pytest.raises(preflight.ConfigError, match="num_generations=2 differs from checkpoint-2's 4"):
        train.main(*train.parse_args([*flags, "--max_steps", "3", "--num_generations", "2",
                                      "--per_device_train_batch_size", "2"]))  # fmt: skip
    with pytest.raises(preflight.ConfigError, match="holds another run's files"):
        train.main(*train.parse_args([*flags[:-2], "--max_steps", "3"]))
