"""Kill a run (SIGTERM, SIGKILL, SIGKILL during a save), resume it, and get the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from bipace_trainer import BiPACETrainer  # noqa: F401  (imports the package once here, not per subprocess check)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "reliability" / "run_tiny.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))


def start(model_dir, out, *flags):
    cmd = [sys.executable, str(SCRIPT), "--model", str(model_dir), "--out", str(out), *flags]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=300):
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]


def wait_for(path: Path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def result(out):
    return json.loads((out / "result.json").read_text())


def weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(warm_policy_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    finish(start(warm_policy_dir, out))
    return out


def assert_same_run(resumed, straight):
    got, want = result(resumed), result(straight)
    assert got["global_step"] == want["global_step"] == 4
    assert got["cluster_eps"] == want["cluster_eps"]
    by_step = {s["step"]: s for s in want["steps"]}
    for step in got["steps"]:  # the steps the resumed process ran itself
        assert step == by_step[step["step"]]
    for name, tensor in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[name], tensor, rtol=0, atol=0)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_matches(uninterrupted, warm_policy_dir, tmp_path):
    proc = start(warm_policy_dir, tmp_path, "--pause-after-step", "3")
    wait_for(tmp_path / "step-2", proc)
    proc.send_signal(signal.SIGTERM)  # arrives during step 2's callbacks: the run stops after step 3
    finish(proc)
    stopped = result(tmp_path)
    assert stopped["interrupted"] and stopped["global_step"] == 3
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-3"
    finish(start(warm_policy_dir, tmp_path, "--resume"))
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.slow
def test_sigkill_then_resume_from_the_last_checkpoint_matches(uninterrupted, warm_policy_dir, tmp_path):
    proc = start(warm_policy_dir, tmp_path, "--pause-after-step", "3")
    wait_for(tmp_path / "step-3", proc)
    proc.kill()
    proc.wait()
    last = get_last_checkpoint(str(tmp_path))
    assert Path(last).name == "checkpoint-2"  # step 3 never reached its save
    finish(start(warm_policy_dir, tmp_path, "--resume"))
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.slow
def test_a_kill_during_a_save_never_leaves_a_broken_checkpoint(uninterrupted, warm_policy_dir, tmp_path):
    proc = start(warm_policy_dir, tmp_path, "--slow-save-at", "3")
    wait_for(tmp_path / "saving", proc)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "checkpoint-3").exists()  # the half-written save is not a checkpoint
    assert (tmp_path / ".staging" / "checkpoint-3").exists()
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-2"
    finish(start(warm_policy_dir, tmp_path, "--resume"))
    assert not (tmp_path / ".staging").exists()  # cleared by the next save
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.slow
def test_resuming_a_finished_run_from_its_last_checkpoint_trains_no_step_more(uninterrupted, warm_policy_dir, tmp_path):
    """A requeued job resumes its last checkpoint, that of max_steps: transformers trained one step more (a
    checkpoint-5, the final weights moved). A script's `trainer.train(resume_from_checkpoint=...)`, no train.py."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    finish(start(warm_policy_dir, out, "--resume"))
    assert result(out)["global_step"] == 4 and not (out / "checkpoint-5").exists()  # not one step trained
    assert_same_run(out, uninterrupted)


@pytest.mark.slow
def test_sigterm_while_an_env_hangs_on_the_default_backend_stops_after_the_step_timeout(warm_policy_dir, tmp_path):
    marker = tmp_path / "hanging"
    env = dict(ENV, HANG_MARKER=str(marker))
    cmd = [sys.executable, str(SCRIPT), "--model", str(warm_policy_dir), "--out", str(tmp_path),
           "--env", "tests.reliability.faulty_envs:HangOnceEnv", "--env-step-timeout", "5"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)  # the env hangs for an hour; the serial backend gives up after 5 s
    finish(proc, timeout=90)
    stopped = result(tmp_path)
    assert stopped["interrupted"] and stopped["global_step"] == 1
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-1"


def run_main(model_dir, out, monkeypatch, sigterm_at, **overrides):
    """train.py's main() on the tiny setup with SigtermEnv; pushes go to a recording stand-in."""
    import transformers.trainer
    from trl import ModelConfig

    from bipace_trainer.cli import train
    from tests.reliability.faulty_envs import SigtermEnv
    from tests.trainer.test_checkpoints import RecordingHubApi
    from tests.trainer.tiny_setup import tiny_args

    hub = RecordingHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    # the stand-in is the Hub here: the pre-flight's token and network check has nothing to reach
    monkeypatch.setattr(train.preflight, "check_hub_access", lambda repo: None)
    monkeypatch.setenv("SIGTERM_AT", sigterm_at)
    monkeypatch.setattr(SigtermEnv, "sent", False)
    args = tiny_args(out, env_name="tests.reliability.faulty_envs:SigtermEnv", env_kwargs={}, preset="grpo",
                     max_steps=2, save_strategy="steps", save_steps=1, evaluate_before_training=False, eval_tasks=2,
                     push_to_hub=True, hub_model_id="tiny-agent", hub_strategy="end", **overrides)
    summary = train.main(train.ScriptArguments(), args, ModelConfig(model_name_or_path=str(model_dir)))
    return summary, hub


def assert_nothing_final(out, hub):
    assert not hub.uploads  # nothing pushed
    assert not list(Path(out).glob("*.safetensors"))  # no final model saved in output_dir
    assert not any(e.get("tag") == "final" for e in json.loads((Path(out) / "eval_results.json").read_text())) \
        if (Path(out) / "eval_results.json").exists() else True


@pytest.mark.slow
@pytest.mark.parametrize("sigterm_at,steps,checkpoint", [
    ("step", 1, "checkpoint-1"),  # the step finishes, is saved, and the run stops
    ("step_twice", 0, None),  # a second SIGTERM does not wait for the step
    ("eval", 2, "checkpoint-2"),  # the final evaluation is cut short: training was saved already
])
def test_a_stopped_run_says_so_saves_no_final_model_and_pushes_nothing(
    sigterm_at, steps, checkpoint, warm_policy_dir, tmp_path, monkeypatch, capsys
):
    summary, hub = run_main(warm_policy_dir, tmp_path, monkeypatch, sigterm_at)
    assert summary["stopped"] and summary["steps"] == steps
    assert "stopped by SIGTERM" in capsys.readouterr().out
    assert_nothing_final(tmp_path, hub)
    last = get_last_checkpoint(str(tmp_path))
    assert (Path(last).name if last else None) == checkpoint
    assert summary["success_after"] is None  # no final evaluation result


@pytest.mark.slow
def test_train_py_exits_143_after_sigterm(warm_policy_dir, tmp_path):
    cmd = [sys.executable, "train.py", "--model_name_or_path", str(warm_policy_dir), "--output_dir", str(tmp_path),
           "--env", "tests.reliability.faulty_envs:SigtermEnv", "--env_kwargs", "{}", "--use_peft", "false",
           "--max_steps", "2", "--tasks_per_iteration", "2", "--num_generations", "2", "--per_device_train_batch_size", "2",
           "--max_completion_length", "16", "--history_length", "1", "--max_turns", "3", "--use_cpu", "true",
           "--evaluate_before_training", "false", "--eval_tasks", "1", "--save_strategy", "steps", "--save_steps", "1",
           "--preset", "grpo"]
    proc = subprocess.run(cmd, env=dict(ENV, SIGTERM_AT="step"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped by SIGTERM at step 1" in proc.stdout
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-1"


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes_exactly(
    uninterrupted, warm_policy_dir, tmp_path
):
    proc = start(warm_policy_dir, tmp_path, "--fsize-limit-at", "2")  # no file may grow past 64 KiB from step 2
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("run_tiny.py: error:")]  # (progress bars share the stream)
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert errors[0].startswith(f"run_tiny.py: error: no space left on device while writing checkpoint-2 in {tmp_path}")
    assert "the previous checkpoint checkpoint-1 is intact" in errors[0]
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-1" and not (tmp_path / ".staging").exists()
    finish(start(warm_policy_dir, tmp_path, "--resume"))
    assert_same_run(tmp_path, uninterrupted)
