"""Whose run an `output_dir` holds, checked before any weights load; and what a stopped run left there.

    run_id = begin_run(args.output_dir, resume, overwrite)    # train.py, before the model loads
    problems, notes = compare_with_checkpoint(checkpoint, args, model_name)
    print(stop_message(args.output_dir))                      # what is really there

One output_dir holds one run. `begin_run` refuses a new run in a folder that holds another
run's files (`run_files`: checkpoints, rollout dumps, evaluations, report, final model: the
new run would overwrite some and leave the others, its report would list the old run's dumps,
and `--resume_from_checkpoint true` would pick up the old run's last checkpoint): resume it,
pass `--overwrite_output_dir true` (all of them are removed first), or pick another folder
(train.py gives the main job's default folder the next free name instead: `free_folder`). Each
run gets an id in `<output_dir>/bipace_run.json`; every checkpoint records the id and the
config of the run that saved it (`checkpointing`), so a resume can tell a checkpoint of this
run from another's, and a changed setting from the saved one. The record also keeps the run's
title (the report's) and, once its final model is saved, the step it finished at
(`finish_run`, `finished`): a finished run resumed trains nothing.

A checkpoint carries its run's identity, so it resumes wherever it is: copied with or
without its folder to new storage, or passed as `--resume_from_checkpoint PATH` with a
fresh `--output_dir`, the resumed run takes the checkpoint's id (and TensorBoard folder
name) and saves on as the same run. What is refused is a resume that would mix two runs'
checkpoints in one folder (`mixed_runs`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

__all__ = [
    "RUN_FILE",
    "STATE_FILE",
    "RunDirError",
    "checkpoints",
    "last_checkpoint",
    "begin_run",
    "run_id",
    "run_identity",
    "mixed_runs",
    "tensorboard_dir",
    "keep_tensorboard_dir",
    "run_config",
    "compare_with_checkpoint",
    "stop_message",
    "clean_stale_files",
    "run_files",
    "free_folder",
    "finish_run",
    "finished",
    "finished_step",
    "run_title",
    "flag_setting",
]

RUN_FILE = "bipace_run.json"
STATE_FILE = "bipace_state.json"  # in each checkpoint: the run's id and config, and its own state (`checkpointing`)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# What a run writes into its output_dir besides checkpoints (train.py, the trainer, `bipace-eval OUTPUT_DIR`):
# a folder holding any of them holds a run, and `--overwrite_output_dir` removes all of them. Weights,
# tokenizer and config files are the final model's (`save_model`); README.md counts only as the run's card.
RUN_FILE_NAMES = (
    "eval_results.json", "trainer_state.json", "report.html", "learning_curve.png", "training_args.bin",
    "adapter_model.safetensors", "adapter_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
)  # fmt: skip
RUN_FOLDERS = ("rollouts", "runs", "bipace_eval", "warm_start", ".staging", ".final.staging", ".warm_start.staging")
_RUN_PATTERNS = ("model-*-of-*.safetensors", "bipace_eval*.json", "bipace_eval*.md")

# Settings that make a resumed run another run: refused.
REFUSED_CHANGES = (
    "model", "env_name", "env_kwargs", "train_split", "preset", "estimator", "num_generations", "tasks_per_iteration",
)  # fmt: skip
# Bookkeeping a resume may change freely (where and how often it saves, logs and evaluates, how long it runs).
FREE_CHANGES = {
    "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "max_steps", "num_train_epochs", "run_name",
    "report_to", "logging_dir", "logging_steps", "logging_strategy", "logging_first_step", "logging_nan_inf_filter",
    "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_on_each_node", "push_to_hub",
    "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
    "disable_tqdm", "rollout_dump_steps", "log_completions", "num_completions_to_print", "eval_interval",
    "eval_tasks", "eval_rollouts_per_task", "evaluate_before_training", "eval_temperature", "env_backend",
    "env_workers", "env_step_timeout", "dataloader_num_workers", "ddp_timeout", "local_rank", "use_cpu",
    "trust_remote_code", "include_num_input_tokens_seen", "eval_split",
}  # fmt: skip
# Why a changed setting does not take effect as the user may think.
_CHANGE_NOTES = {
    "learning_rate": "the restored scheduler continues the checkpoint's learning rate",
    "seed": "the RNG state is the checkpoint's; task draws follow the new seed",
}


class RunDirError(ValueError):
    """An output_dir or checkpoint that does not fit the run asked for; the message says what to pass."""


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, by N."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def last_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The latest complete checkpoint (transformers' choice), or None."""
    if not Path(output_dir).is_dir():
        return None
    found = get_last_checkpoint(str(output_dir))
    return Path(found) if found else None


def run_id(output_dir: str | os.PathLike) -> str | None:
    """The id of the run `output_dir` belongs to, or None (no run started there by train.py)."""
    return _run_record(output_dir).get("run_id")


def run_identity(output_dir: str | os.PathLike) -> dict[str, str]:
    """What a checkpoint records of whose run it is (`run_id`, `tensorboard_dir`), so that it
    resumes as the same run wherever it is copied (`begin_run`)."""
    record = _run_record(output_dir)
    return {key: record[key] for key in ("run_id", "tensorboard_dir") if isinstance(record.get(key), str)}


def _names(paths: list[Path]) -> str:
    names = [p.name for p in paths]
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]} ({len(names)})"


def _listed(paths: list[Path]) -> str:
    """'checkpoint-1/, eval_results.json, rollouts/': folders marked, at most six named."""
    names = [f"{p.name}/" if p.is_dir() else p.name for p in paths]
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])}, ... ({len(names)} in all)"


def run_files(output_dir: str | os.PathLike) -> list[Path]:
    """What an earlier run wrote in `output_dir` (`RUN_FILE_NAMES`, `RUN_FOLDERS`, checkpoints, its
    card), sorted; [] for a folder that holds no run (empty, the user's own files, a refused try's record)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    from ..reports.model_card import CARD_MARKER

    found = [*checkpoints(folder), *(folder / name for name in (*RUN_FILE_NAMES, *RUN_FOLDERS))]
    found += [path for pattern in _RUN_PATTERNS for path in folder.glob(pattern)]
    card = folder / "README.md"
    if card.is_file() and CARD_MARKER in card.read_text(errors="replace"):
        found.append(card)
    return sorted({path for path in found if path.exists()})


def free_folder(output_dir: str | os.PathLike) -> Path:
    """`output_dir` if it holds no run, else the first of `<output_dir>-2`, `-3`, ... that holds none
    (the convention of tools that number their runs: a second `python train.py` does not overwrite the first)."""
    folder = Path(output_dir)
    number = 2
    while run_files(folder):
        folder = Path(f"{output_dir}-{number}")
        number += 1
    return folder


def begin_run(
    output_dir: str | os.PathLike, resume: str | bool | None, overwrite: bool = False, write: bool = True,
    *, restart: bool = False, title: str | None = None,
) -> str | None:
    """Check that `output_dir` can take this run and record its id (and `title`); returns the id.

    A new run (`resume` None) in a folder holding another run's files (`run_files`) is refused
    unless `overwrite`, which removes them all first; `restart` (a resume asked for where there is
    no checkpoint: the run starts over from step 0) removes the earlier try's files but its warm
    start. A resumed run (`resume`: the checkpoint, or True for the folder's last) takes the id the
    checkpoint carries, wherever the checkpoint is (`_resumed_record`), unless that would mix two
    runs' checkpoints in the folder (`mixed_runs`: refused); it will train, so the record's
    `finished` step goes. Only the process with `write` (the main one) removes and records anything.
    """
    folder = Path(output_dir)
    found = [p for p in run_files(folder) if not (restart and p.name == "warm_start")]
    if not resume and found:
        if not (overwrite or restart):
            raise RunDirError(
                f"output_dir={str(folder)!r} holds another run's files ({_listed(found)}): a new run there would "
                "overwrite some and leave the others. Resume it with --resume_from_checkpoint true, start over with "
                "--overwrite_output_dir true (removes them), or pick another --output_dir."
            )
        if write:
            _remove(found)
            what = "the earlier try" if restart and not overwrite else "the earlier run"
            print(f"{'overwrite_output_dir' if overwrite else 'restart'}: removed {_listed(found)} of {what} in {folder}.")
    current = _run_record(folder) if resume else {}
    if resume:
        checkpoint = last_checkpoint(folder) if resume is True else Path(resume)
        current = _resumed_record(folder, checkpoint, current) if checkpoint is not None else current
        current.pop("finished", None)
    if title:
        current = {**current, "title": title}
    if write and (current.get("run_id") is None or current != _run_record(folder)):
        from transformers.integrations.integration_utils import default_logdir

        if current.get("run_id") is None:
            current = {"run_id": uuid.uuid4().hex, "tensorboard_dir": default_logdir(), **current}
        folder.mkdir(parents=True, exist_ok=True)
        _write_record(folder, current)
    return current.get("run_id")


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    """`bipace_run.json`, replaced whole (a reader never sees half of it)."""
    partial = folder / f".{RUN_FILE}.{os.getpid()}.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, folder / RUN_FILE)


def finish_run(output_dir: str | os.PathLike, step: int, max_steps: int, epochs: float) -> None:
    """Record that the run in `output_dir` reached its end at optimizer step `step` and its final model is
    saved (`max_steps`, `epochs`: the settings it ended under); main process, after the final save."""
    folder = Path(output_dir)
    record = {**_run_record(folder), "finished": {"step": step, "max_steps": max_steps, "num_train_epochs": epochs}}
    _write_record(folder, record)


def finished_step(output_dir: str | os.PathLike) -> int | None:
    """The step the run in `output_dir` finished at with its final model saved (`finish_run`), or None."""
    done = _run_record(output_dir).get("finished")
    return done["step"] if isinstance(done, dict) and isinstance(done.get("step"), int) else None


def finished(output_dir: str | os.PathLike, max_steps: int, epochs: float) -> int | None:
    """`finished_step`, if the run also went as far as `max_steps` (or, without one, `epochs`) asks;
    else None (still running, stopped, or asked to go further)."""
    step, done = finished_step(output_dir), _run_record(output_dir).get("finished")
    if step is None:
        return None
    if max_steps > 0:
        return step if step >= max_steps else None
    reached = done.get("max_steps", 0) <= 0 and epochs <= float(done.get("num_train_epochs") or 0)
    return step if reached else None


def run_title(output_dir: str | os.PathLike) -> str | None:
    """The title train.py gave the run (model, env, preset), recorded when it began; None if none."""
    title = _run_record(output_dir).get("title")
    return title if isinstance(title, str) else None


def _resumed_record(folder: Path, checkpoint: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The run record `folder` takes when `checkpoint` resumes into it: the checkpoint's own
    identity (whatever the folder's record says: a run that saved no checkpoint there, or a
    folder copied without its record, is no other run); the folder's record for a checkpoint
    from before run ids were recorded. Refused (`RunDirError`) if it would mix two runs."""
    problem = mixed_runs(folder, checkpoint)
    if problem:
        raise RunDirError(problem)
    carried = _saved_state(checkpoint)
    if not isinstance(carried.get("run_id"), str):
        return record
    same = record.get("run_id") == carried["run_id"]
    board = carried.get("tensorboard_dir") or (record.get("tensorboard_dir") if same else None)
    if board is None:
        from transformers.integrations.integration_utils import default_logdir

        board = default_logdir()
    return {**record, "run_id": carried["run_id"], "tensorboard_dir": board}


def mixed_runs(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> str | None:
    """Why resuming `checkpoint` with `output_dir` would mix two runs' checkpoints in one folder
    (the resumed run's saves beside another run's, `--resume_from_checkpoint true` then picking
    whichever is newest), or None. Judged by the run id each checkpoint carries (`checkpointing`),
    not by the folder's record; checkpoints from before run ids were recorded are no evidence."""
    folder, checkpoint = Path(output_dir), Path(checkpoint)
    carried = _saved_state(checkpoint).get("run_id")
    if not carried:
        return None
    here = checkpoint.resolve()
    others = [p for p in checkpoints(folder) if p.resolve() != here and _saved_state(p).get("run_id") not in (None, carried)]
    if not others:
        return None
    if here.parent == folder.resolve():
        return (
            f"{folder} holds checkpoints of two runs ({checkpoint.name} and {_names(others)} were saved by different "
            f"runs): move {checkpoint.name} to a folder of its own and resume it there with --output_dir NEW_FOLDER "
            f"--resume_from_checkpoint NEW_FOLDER/{checkpoint.name} (a checkpoint carries its run's identity), "
            f"or move the other run's checkpoints out."
        )
    return (
        f"{checkpoint} was saved by another run than the checkpoints in --output_dir {folder} ({_names(others)}): "
        "resuming it there would mix two runs. Give it a folder of its own: --output_dir NEW_OR_EMPTY_FOLDER "
        f"--resume_from_checkpoint {checkpoint} resumes it exactly (a checkpoint carries its run's identity); "
        f"--resume_from_checkpoint true resumes the run in {folder}."
    )


def _run_record(output_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        record = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def tensorboard_dir(output_dir: str | os.PathLike) -> Path:
    """The run's TensorBoard folder, `<output_dir>/runs/<time>_<host>` as transformers names it,
    chosen when the run began (`begin_run`), so a resumed run writes on in the same one."""
    from transformers.integrations.integration_utils import default_logdir

    return Path(output_dir) / (_run_record(output_dir).get("tensorboard_dir") or default_logdir())


def keep_tensorboard_dir(trainer) -> None:
    """Point the trainer's TensorBoard callback at the run's folder (`tensorboard_dir`) instead of a
    new `runs/<time>_<host>` per process start; $TENSORBOARD_LOGGING_DIR, when set, still wins."""
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = str(tensorboard_dir(trainer.args.output_dir))


def run_config(args, model_name: str) -> dict[str, Any]:
    """What a checkpoint records of its run's settings: the model, every config field, and
    the estimator settings the preset resolved to (JSON values)."""
    config = {"model": str(model_name), **json.loads(json.dumps(args.to_dict(), default=str))}
    estimator = getattr(args, "estimator", None)
    if estimator is not None:
        config["estimator"] = json.loads(json.dumps(asdict(estimator), default=str))
    return config


def _saved_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def compare_with_checkpoint(
    checkpoint: str | os.PathLike, args, model_name: str, output_dir: str | os.PathLike | None = None
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for resuming `checkpoint` with `args` and `model_name`.

    Refused: a resume that would mix two runs' checkpoints in `output_dir` (`mixed_runs`),
    and a change of what the run is (`REFUSED_CHANGES`: model, env, preset and the estimator
    it resolves to, group size). Warned: every other changed setting that is not bookkeeping
    (`FREE_CHANGES`), with what it does on a resume. A checkpoint from before run ids and
    configs were recorded gives neither.
    """
    checkpoint = Path(checkpoint)
    state = _saved_state(checkpoint)
    refusals, warnings = [], []
    mixed = mixed_runs(output_dir, checkpoint) if output_dir is not None else None
    if mixed:
        refusals.append(mixed)
    saved = state.get("config")
    if not saved:
        return refusals, warnings
    now = run_config(args, model_name)
    changed = {name for name in set(saved) & set(now) if saved[name] != now[name]}
    if "preset" in changed:
        changed.discard("estimator")  # the preset's settings: one change, named once
    for name in [name for name in REFUSED_CHANGES if name in changed]:
        if name == "estimator":  # an estimator flag (step_partition, w_step, ...) over the same preset
            keys = [key for key in now[name] if now[name].get(key) != saved[name].get(key)]
            what = ", ".join(f"{key}={now[name].get(key)!r}" for key in keys)
            refusals.append(
                f"the estimator settings {what} differ from {checkpoint.name}'s "
                f"({', '.join(f'{key}={saved[name].get(key)!r}' for key in keys)}): resuming would continue another run; "
                f"resume as saved with {' '.join(flag_setting(key, saved[name].get(key)) for key in keys)}, "
                "or start a new run in another --output_dir."
            )
            continue
        flag = "model_name_or_path" if name == "model" else name
        refusals.append(
            f"{flag}={now[name]!r} differs from {checkpoint.name}'s {saved[name]!r}: resuming would continue another run; "
            f"resume as saved with {flag_setting(flag, saved[name])}, or start a new run in another --output_dir."
        )
    for name in sorted(changed - set(REFUSED_CHANGES)):
        if name not in FREE_CHANGES:
            note = _CHANGE_NOTES.get(name)
            warnings.append(f"{name}={now[name]!r} (checkpoint: {saved[name]!r}{'; ' + note if note else ''})")
    return refusals, warnings


def flag_setting(name: str, value: Any) -> str:
    """The command-line words that set field `name` to `value` (a checkpoint's), ready to paste:
    `--num_generations 4`, `--env_kwargs '{"size": 4}'`, `--level_weights 1.0 2.0`."""
    if isinstance(value, dict):
        words = [json.dumps(value)]
    elif isinstance(value, (list, tuple)):
        words = [str(item) for item in value]
    else:
        words = [str(value)]
    return " ".join([f"--{name}", *(shlex.quote(word) for word in words)])


def stop_message(output_dir: str | os.PathLike) -> str:
    """What a stopped run left to resume from, as it is on disk."""
    found = last_checkpoint(output_dir)
    if found is None:
        return f"no checkpoint was saved in {output_dir}: a restart begins from step 0."
    return f"the last complete checkpoint is {found} (resume with --resume_from_checkpoint true)."


def clean_stale_files(output_dir: str | os.PathLike) -> None:
    """What a run cleans when it starts: the `.partial` files of a killed rollout dump, and a
    README.md the user wrote, kept under another name before the run's card replaces it."""
    from ..reports.model_card import keep_foreign_readme
    from ..rollout.trajectories import clean_partial_dumps

    clean_partial_dumps(output_dir)
    keep_foreign_readme(output_dir)
