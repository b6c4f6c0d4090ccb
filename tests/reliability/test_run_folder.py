"""One folder, one run (issue 56), checked before any weights load, on folders laid out as runs leave them:
another run's files refused or cleared whole, the main job's default folder numbered, a restart that
keeps only the warm start, a finished run that cannot go further, resume advice that names the value to
pass, and the title a rebuilt report keeps. Fast: `prepare_output_dir` and the files, no model. The runs
themselves are in test_run_life.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bipace_trainer.cli import preflight, train
from bipace_trainer.reports import report
from bipace_trainer.reports.model_card import CARD_MARKER
from bipace_trainer.run import run_dir
from bipace_trainer.run.run_dir import STATE_FILE

TINY = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--use_cpu", "true", "--use_peft", "false",
        "--warm_start_from", ""]  # fmt: skip
# what a finished run without checkpoints (the main job: save_strategy no) leaves
FINISHED_FILES = ("adapter_model.safetensors", "adapter_config.json", "eval_results.json", "trainer_state.json",
                  "report.html", "learning_curve.png", "tokenizer.json", "training_args.bin")  # fmt: skip


def finished_run(folder: Path, step: int = 3, checkpoints: tuple[int, ...] = (), run: str = "old") -> Path:
    """A folder as a finished run leaves it: its record (finished at `step`), final model, evaluations,
    report, card, dumps and TensorBoard log, and the user's own notes."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run, "tensorboard_dir": "runs/old", "title": "m on tiny, grpo",
              "finished": {"step": step, "max_steps": step, "num_train_epochs": 3.0}}  # fmt: skip
    (folder / run_dir.RUN_FILE).write_text(json.dumps(record))
    for name in FINISHED_FILES:
        (folder / name).write_text("{}")
    (folder / "README.md").write_text(f"{CARD_MARKER}\n# the card")
    for sub in ("rollouts", "runs/old", "bipace_eval"):
        (folder / sub).mkdir(parents=True)
    (folder / "rollouts" / "step-000003.jsonl").write_text("{}\n")
    (folder / "bipace_eval" / "bipace_eval.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    for number in checkpoints:
        (folder / f"checkpoint-{number}").mkdir()
        (folder / f"checkpoint-{number}" / "trainer_state.json").write_text("{}")
        (folder / f"checkpoint-{number}" / STATE_FILE).write_text(json.dumps({"run_id": run, "config": None}))
    return folder


def test_a_new_run_in_a_folder_holding_a_run_without_checkpoints_is_refused_in_one_line(tmp_path):
    out = finished_run(tmp_path / "out")
    args = train.parse_args([*TINY, "--output_dir", str(out)])
    with pytest.raises(preflight.ConfigError) as refused:
        train.prepare_output_dir(*args)
    message = str(refused.value)
    assert "\n" not in message and "holds another run's files (README.md, adapter_config.json" in message
    assert all(choice in message for choice in ("--resume_from_checkpoint true", "--overwrite_output_dir true",
                                                "pick another --output_dir"))  # fmt: skip
    assert run_dir.run_id(out) == "old" and (out / "eval_results.json").exists()  # nothing touched


def test_overwrite_output_dir_clears_everything_the_earlier_run_wrote_and_nothing_else(tmp_path, capsys):
    out = finished_run(tmp_path / "out", checkpoints=(1, 2, 3))
    (out / ".staging").mkdir()
    train.prepare_output_dir(*train.parse_args([*TINY, "--output_dir", str(out), "--overwrite_output_dir", "true"]))
    left = sorted(p.name for p in out.iterdir())
    assert left == [run_dir.RUN_FILE, "notes.txt"], left  # dumps, evaluations, report, model, card, checkpoints: gone
    assert run_dir.run_id(out) != "old" and run_dir.finished_step(out) is None
    assert "overwrite_output_dir: removed " in capsys.readouterr().out


def test_the_main_jobs_default_folder_taken_by_an_earlier_run_gives_the_next_free_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    default = train.MAIN_JOB_DEFAULTS["output_dir"]
    finished_run(tmp_path / default)
    args = train.parse_args(["--env", "tiny", "--env_kwargs", '{"size": 4}', "--use_cpu", "true"])
    train.prepare_output_dir(*args)
    assert args[1].output_dir == f"{default}-2" and run_dir.run_id(f"{default}-2") not in (None, "old")
    printed = capsys.readouterr().out
    assert f"output_dir: {default} holds an earlier run, so this one writes to {default}-2" in printed
    finished_run(tmp_path / f"{default}-2", run="second")
    args = train.parse_args(["--env", "tiny", "--env_kwargs", '{"size": 4}', "--use_cpu", "true"])
    train.prepare_output_dir(*args)
    assert args[1].output_dir == f"{default}-3"
    # a resume, or a folder the user named, keeps the folder
    resumed = train.parse_args(["--env", "tiny", "--env_kwargs", '{"size": 4}', "--resume_from_checkpoint", "true"])
    assert train.prepare_output_dir(*resumed) == 3 and resumed[1].output_dir == default  # finished: nothing to train
    named = train.parse_args(["--env", "tiny", "--env_kwargs", '{"size": 4}', "--output_dir", default])
    with pytest.raises(preflight.ConfigError, match="holds another run's files"):
        train.prepare_output_dir(*named)


def test_a_resume_with_nothing_to_resume_starts_over_and_keeps_only_the_warm_start(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / run_dir.RUN_FILE).write_text(json.dumps({"run_id": "try", "tensorboard_dir": "runs/try"}))
    for name in ("eval_results.json", "rollouts/eval-before-step-000000.jsonl", "warm_start/adapter_config.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    args = train.parse_args([*TINY, "--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert train.prepare_output_dir(*args) is None and args[1].resume_from_checkpoint is None
    assert sorted(p.name for p in out.iterdir()) == [run_dir.RUN_FILE, "warm_start"]
    assert "no checkpoint in" in capsys.readouterr().out


def test_a_finished_run_without_checkpoints_asked_to_go_further_is_refused(tmp_path):
    out = finished_run(tmp_path / "out", step=3)
    args = train.parse_args([*TINY, "--output_dir", str(out), "--resume_from_checkpoint", "true", "--max_steps", "3"])
    assert train.prepare_output_dir(*args) == 3  # as far as it was asked: nothing to train
    args = train.parse_args([*TINY, "--output_dir", str(out), "--resume_from_checkpoint", "true", "--max_steps", "6"])
    with pytest.raises(preflight.ConfigError, match=r"finished at step 3 and saved no checkpoint .* cannot train on to "
                       r"max_steps=6: start a new run"):  # fmt: skip
        train.prepare_output_dir(*args)
    assert (out / "eval_results.json").exists()  # and nothing was removed


def test_resuming_an_empty_checkpoint_folder_is_refused_before_any_weights_load(tmp_path):
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out"),
                             "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-3")])  # fmt: skip
    with pytest.raises(preflight.ConfigError, match="holds no complete checkpoint .no trainer_state.json"):
        train.prepare_output_dir(*args)


@pytest.mark.parametrize("saved,flag", [(["--num_generations", "2", "--per_device_train_batch_size", "2"],
                                          "--num_generations 2"),
                                         (["--w_step", "0.5"], "--w_step 0.5"),
                                         (["--env_kwargs", '{"size": 5}'], """--env_kwargs '{"size": 5}'""")])
def test_a_refused_resume_names_the_value_that_resumes_it_and_that_value_is_accepted(saved, flag, tmp_path):
    """Before: "drop --num_generations (resume as saved)", refused again when the saved value was no default."""
    out = tmp_path / "out"
    config = run_dir.run_config(train.parse_args([*TINY, "--output_dir", str(out), *saved])[1], "tiny-model")
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-2" / STATE_FILE).write_text(json.dumps({"run_id": "r", "config": config}))
    resume = [*TINY, "--output_dir", str(out), "--model_name_or_path", "tiny-model", "--resume_from_checkpoint", "true"]
    with pytest.raises(preflight.ConfigError) as refused:
        train.prepare_output_dir(*train.parse_args(resume))  # the flag dropped: the defaults differ from the saved run
    assert f"resume as saved with {flag}" in str(refused.value)
    import shlex

    args = train.parse_args([*resume, *shlex.split(flag), *saved[2:]])
    assert train.prepare_output_dir(*args) is None and args[1].resume_from_checkpoint.endswith("checkpoint-2")


def test_a_rebuilt_report_keeps_the_title_train_py_gave_it(tmp_path):
    out = tmp_path / "out"
    args = train.parse_args([*TINY, "--output_dir", str(out), "--preset", "gigpo"])
    train.prepare_output_dir(*args)
    page = report.build_report(out)  # what `bipace-report OUT` writes
    assert "<title>embedded SmolLM2-135M-Instruct on tiny, gigpo</title>" in page
    assert "<title>t</title>" in report.build_report(out, title="t")  # --title still wins
