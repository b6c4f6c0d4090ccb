"""A run is one run, start to finish (issue 56), as a user launches it: train.py as a process on the tiny
model, a real SIGTERM or SIGKILL, a real full disk (a small tmpfs in a private mount namespace).

One uninterrupted 2-step run is the reference; each case below ends, after at most one resume, with its
final weights (bit for bit), its final evaluation and its summary. The final save is stalled on purpose
(`stalled_train.py`) so that a signal lands inside it. The env is the tiny env (`SigtermEnv` only
signals when $SIGTERM_AT asks, else it is `TinyEnv`)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STALLED = ROOT / "tests" / "reliability" / "stalled_train.py"
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "SIGTERM_"))}
ENV.update(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))

pytestmark = pytest.mark.slow  # each case starts train.py


def flags(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--output_dir", str(out), "--env",
            "tests.reliability.faulty_envs:SigtermEnv", "--env_kwargs", "{}", "--use_peft", "false", "--warm_start_from", "",
            "--preset", "grpo", "--max_steps", "2", "--tasks_per_iteration", "2", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_turns", "4", "--max_completion_length", "16", "--history_length", "1",
            "--eval_tasks", "2", "--evaluate_before_training", "false", "--learning_rate", "2e-3",
            "--summary_file", str(out.parent / f"{out.name}-summary.json"), *extra]  # fmt: skip


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=600)


def train_py(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "train.py", *argv], env)


def shell_words(argv: list[str]) -> str:
    return " ".join(shlex.quote(arg) for arg in argv)


def start_stalled(argv: list[str], seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(STALLED), *argv], cwd=ROOT, env={**ENV, "STALL_FINAL_SAVE": str(seconds)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(folder: Path, reference: Path) -> None:
    want = weights(reference)
    got = weights(folder)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def evaluations(folder: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "seconds"} for e in json.loads((folder / "eval_results.json").read_text())]


def summary(out: Path) -> dict:
    saved = json.loads((out.parent / f"{out.name}-summary.json").read_text())
    return {key: saved[key] for key in ("steps", "success_before", "success_after", "per_type_after", "after", "curve")}


def assert_same_run(out: Path, reference: Path) -> None:
    assert_same_weights(out, reference)
    assert evaluations(out) == evaluations(reference)
    assert summary(out) == summary(reference)
    assert not (out / "checkpoint-3").exists() and not (out / ".final.staging").exists()


@pytest.fixture(scope="module")
def straight(warm_policy_dir, tmp_path_factory) -> Path:
    """The uninterrupted run: 2 steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("life") / "straight"
    done = train_py(flags(warm_policy_dir, out, "--save_strategy", "steps", "--save_steps", "1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FutureWarning" not in done.stdout + done.stderr  # TRL's gradient-checkpointing names, silenced
    assert json.loads((out / "bipace_run.json").read_text())["finished"]["step"] == 2
    return out


def test_a_finished_run_resumed_trains_nothing_and_writes_only_what_is_missing(straight, warm_policy_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    (out / "report.html").unlink()
    (out / "learning_curve.png").unlink()
    model_bytes = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    # what a scheduler's requeue runs; `exec` after a pause: the process is older than the program in it
    argv = flags(warm_policy_dir, out, "--save_strategy", "steps", "--save_steps", "1", "--resume_from_checkpoint", "true")
    began = time.monotonic()
    done = run(["bash", "-c", f"sleep 3; exec {shell_words([sys.executable, 'train.py', *argv])}"])
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resume: the run in {out} finished at step 2 and its final model is saved: nothing to train" in done.stdout
    assert "on tests.reliability.faulty_envs:SigtermEnv with grpo, 2 steps" in done.stdout
    assert not (out / "checkpoint-3").exists() and summary(out) == summary(straight)
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == model_bytes
    assert (out / "learning_curve.png").is_file()
    assert f"<title>{warm_policy_dir} on tests.reliability.faulty_envs:SigtermEnv, grpo</title>" in (out / "report.html").read_text()
    wall = int(done.stdout.split("time: ")[1].split(" s wall")[0])
    assert wall <= took - 3 + 1, (wall, took)  # from the program's start, not the process's (3 s of sleep before)

    again = train_py(flags(warm_policy_dir, out))  # a new run into the finished run's folder
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines() == [again.stderr.strip()] and "holds another run's files" in again.stderr
    assert "--resume_from_checkpoint true" in again.stderr and "--overwrite_output_dir true" in again.stderr


def test_sigterm_during_the_final_save_finishes_it_and_the_resume_writes_the_rest(straight, warm_policy_dir, tmp_path):
    out = tmp_path / "run"
    argv = flags(warm_policy_dir, out, "--save_strategy", "steps", "--save_steps", "1")
    proc = start_stalled(argv, seconds=4)
    wait_for(out / "saving-final", proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-4000:]
    assert "=== stopped by SIGTERM after the final model was saved (step 2) ===" in output
    assert "Not written: the learning curve, the report" in output
    assert_same_weights(out, straight)  # the save went on to its end
    assert not (out / "report.html").exists()
    done = train_py([*argv, "--resume_from_checkpoint", "true"])
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "report.html").is_file() and (out / "learning_curve.png").is_file()
    assert_same_run(out, straight)


def test_sigkill_during_the_final_save_leaves_no_half_file_and_the_resume_ends_as_the_straight_run(
    straight, warm_policy_dir, tmp_path
):
    out = tmp_path / "run"
    argv = flags(warm_policy_dir, out, "--save_strategy", "steps", "--save_steps", "1")
    proc = start_stalled(argv, seconds=600)
    wait_for(out / "saving-final", proc)
    proc.kill()
    proc.communicate()
    assert (out / ".final.staging" / "model.safetensors").is_file()  # written there, in full, by the stalled save
    assert not (out / "model.safetensors").exists()  # never under its final name before it is complete
    done = train_py([*argv, "--resume_from_checkpoint", "true"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_run(out, straight)  # trained nothing, played the final evaluation as the straight run did


def test_sigterm_in_the_final_evaluation_of_a_run_without_checkpoints_keeps_one_and_resumes_exactly(
    straight, warm_policy_dir, tmp_path
):
    out = tmp_path / "run"
    argv = flags(warm_policy_dir, out, "--save_strategy", "no")  # the main job's setting
    stopped = train_py(argv, env={"SIGTERM_AT": "eval"})
    assert stopped.returncode == 143, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in stopped.stdout
    assert not (out / "model.safetensors").exists()
    done = train_py([*argv, "--resume_from_checkpoint", "true"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_run(out, straight)


def _private_mounts() -> bool:
    probe = subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


@pytest.mark.skipif(not _private_mounts(), reason="needs `unshare -r -m` (a user and mount namespace) for a small tmpfs")
def test_a_full_disk_during_the_final_save_is_one_line_and_the_trained_weights_are_kept(straight, warm_policy_dir, tmp_path):
    out, spare = tmp_path / "small-disk", tmp_path / "spare"
    out.mkdir()
    spare.mkdir()
    # 256 KiB: the run's evaluations, dumps and log fit; its 0.4 MB of weights do not
    train = shell_words([sys.executable, "train.py", *flags(warm_policy_dir, out, "--save_strategy", "no")])
    script = f"mount -t tmpfs -o size=256k tmpfs {shlex.quote(str(out))} && exec {train}"
    done = run(["unshare", "-r", "-m", "bash", "-c", script], env={"TMPDIR": str(spare)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith(f"train.py: error: no space left on device while writing the final model in {out} (")
    kept = Path(errors[0].split("kept: the final model in ")[1].split(" (move its files")[0])
    assert kept.parent == spare and f"the run's evaluations and log (eval_results.json, trainer_state.json) in {out}" in errors[0]
    assert_same_weights(kept, straight)  # the trained weights are not lost


def test_bipace_eval_of_a_run_writes_into_the_run_and_its_rebuilt_report_shows_it_under_its_title(
    straight, warm_policy_dir, tmp_path
):
    """Before: the tables went to ./outputs/bipace_eval (the current folder), the report never showed them, no
    threads line was printed, and a report rebuilt by bipace-report was titled by the folder's name."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    done = run([sys.executable, "-m", "bipace_trainer.cli.evaluate", str(out), "--seeds", "1", "--no_progress", "--use_cpu"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("threads: torch uses ")
    assert (out / "bipace_eval" / "bipace_eval.json").is_file() and not (ROOT / "outputs" / "bipace_eval" / "run").exists()
    rebuilt = run([sys.executable, "-m", "bipace_trainer.reports.report", str(out)])
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    page = (out / "report.html").read_text()
    assert "<h3>bipace_eval/bipace_eval.json: run</h3>" in page
    assert f"<title>{warm_policy_dir} on tests.reliability.faulty_envs:SigtermEnv, grpo</title>" in page  # not "Run run"
