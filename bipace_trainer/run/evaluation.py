"""Evaluation on held-out tasks: which tasks, what each episode reports, the summary, and when it runs.

    result = trainer.evaluate_policy()              # on `eval_split`, logged and kept in eval_history
    result = trainer.evaluate_policy(split="test")  # another split, same tasks per split every time

Every rank plays its share of the split's tasks (`RolloutCollector.eval_task_refs`:
`eval_tasks` of them, stratified over task types, each `eval_rollouts_per_task` times) at
`eval_temperature`, through a rollout collector and its policy (`play_evaluation`: the trainer's,
or a plain model's for `bipace-eval`), sampling from the run's `seed`: every evaluation of a run draws
the same stream (its before and final evaluations are paired on it), and `bipace-eval OUTPUT_DIR`, which
reads the seed and the settings back from `eval_results.json`, plays the final one again. The result (success rate overall and per
`report_key` value, episode length, valid-action rate, the env's score if it reports one)
is logged by the trainer, appended to `trainer.eval_history` and, by the main process, written to
`<output_dir>/eval_results.json` (`write_history`). `EvaluationCallback` runs it before training and every
`eval_interval` steps, `FinalEvaluationCallback` once training ends.

An evaluation leaves the process's random streams as it found them (`untouched_random_streams`): the
training after it draws what it would have drawn without it, so a script with an `eval_dataset` trains
on the same seed as GRPOTrainer trains it (GRPOTrainer has no such evaluation).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback, set_seed

from ..rollout.loop import Episode

if TYPE_CHECKING:
    from torch import nn

    from ..rollout.collector import RolloutCollector
    from ..rollout.loop import TaskRef

__all__ = [
    "EVAL_FILE",
    "Evaluates",
    "play_evaluation",
    "evaluation_settings",
    "logged_values",
    "keep_result",
    "write_history",
    "summarise_evaluation",
    "EvaluationCallback",
    "FinalEvaluationCallback",
    "untouched_random_streams",
]

EVAL_FILE = "eval_results.json"
# `BiPACEConfig` fields that change what an evaluation samples or counts as valid, and have no `bipace-eval`
# flag: recorded with each evaluation, and played with again by `bipace-eval OUTPUT_DIR`.
REPLAYED_FIELDS = (
    "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation", "generation_kwargs", "max_turn_length",
    "require_think", "action_key_tokens",
)  # fmt: skip


def evaluation_settings(args) -> dict[str, Any]:
    """The settings an evaluation was played with, in `bipace-eval`'s flag names (`cli.evaluate`
    reads them back as its defaults for the run's output dir). A dict inside the result: not logged."""
    env_kwargs = json.loads(json.dumps(args.env_kwargs, default=str))  # eval_results.json takes JSON values only
    generation = json.loads(json.dumps({name: getattr(args, name) for name in REPLAYED_FIELDS}, default=str))
    return {
        "env": args.env_name, "env_kwargs": env_kwargs, "max_turns": args.max_turns,
        "history_length": args.history_length, "max_completion_length": args.max_completion_length,
        "temperature": args.eval_temperature, "tasks": args.eval_tasks, "episodes_per_task": args.eval_rollouts_per_task,
        "seed": args.seed, "rollout_batch_size": args.rollout_batch_size, "generation": generation,
    }  # fmt: skip


def episode_record(episode: Episode, reports_score: bool) -> dict[str, Any]:
    """What `summarise_evaluation` reads of one episode (plus its task attributes)."""
    record = {"task_id": episode.task_id, "won": episode.won, "length": episode.length, "failed": episode.failed}
    record |= episode.attributes | {"invalid_steps": episode.invalid_steps}
    return record | ({"score": episode.score or 0.0} if reports_score else {})


def summarise_evaluation(records: list[dict[str, Any]], report_key: str | None) -> dict[str, Any]:
    """Success rate overall and per value of `report_key` (e.g. ALFWorld task type)."""
    n = max(len(records), 1)
    result: dict[str, Any] = {
        "success_rate": sum(r["won"] for r in records) / n,
        "episode_length": sum(r["length"] for r in records) / n,
        "env_failures": sum(r["failed"] for r in records),
        "num_tasks": len(records),
    }
    turns = sum(r["length"] for r in records)
    if turns and all("invalid_steps" in r for r in records):  # replies that parsed to an action
        result["valid_action_rate"] = 1.0 - sum(r["invalid_steps"] for r in records) / turns
    if records and "score" in records[0]:  # envs with a graded outcome (WebShop) report its mean too
        result["score"] = sum(r["score"] for r in records) / n
    if report_key:
        by_type: dict[str, list[bool]] = {}
        for r in records:
            by_type.setdefault(f"{report_key}={r.get(report_key)}", []).append(r["won"])
        # keyed as logged ("depth=2", "task_type=pick_and_place_simple"): a bare "2" says nothing
        result["per_type"] = {k: sum(v) / len(v) for k, v in sorted(by_type.items())}
        for key, value in result["per_type"].items():
            result[f"success_rate/{key}"] = value
    return result


class Evaluates(Protocol):
    """What the evaluation callbacks call: the trainer's `evaluate_policy`, skipped once interrupted."""

    interrupted: bool

    def evaluate_policy(self, tag: str = ..., split: str | None = ...) -> dict[str, Any]: ...


@contextlib.contextmanager
def untouched_random_streams() -> Iterator[None]:
    """Run a block, then put Python's, NumPy's and torch's random streams (CPU, and every CUDA
    device's once CUDA is in use) back where they were: what the block sampled is not taken from
    the draws of what follows."""
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@torch.no_grad()
def play_evaluation(
    collector: RolloutCollector, tasks: list[TaskRef], *, temperature: float, step: int, tag: str, split: str,
    seed: int | None = None, model: nn.Module | None = None, recorded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Play `tasks` (every rank its share) with `collector`'s policy at `temperature`; the summary over
    ranks (`summarise_evaluation`) with the result's `step`, `tag`, `split` and `seconds`, or {} when
    there are no tasks. `model` (the trainer's) is put in eval mode while it plays, then back.
    Every rank must call it. No trainer: `bipace-eval` calls it with a plain model's policy.
    `seed` (Python's, NumPy's and torch's, as `transformers.set_seed`) is what the sampling draws from,
    the same on every rank; None: the streams as they are. Either way they are left as they were
    (`untouched_random_streams`). `recorded` (`evaluation_settings`) goes into the result as its "settings"."""
    with untouched_random_streams():
        if seed is not None:
            set_seed(seed)
        result = _play_evaluation(collector, tasks, temperature=temperature, step=step, tag=tag, split=split, model=model)
    if result and recorded is not None:
        result["settings"] = recorded
    return result


def _play_evaluation(collector, tasks, *, temperature, step, tag, split, model) -> dict[str, Any]:
    accelerator = collector.accelerator
    world, rank = accelerator.num_processes, accelerator.process_index
    if not tasks:  # TRL's envs without an eval_dataset: nothing to evaluate on
        return {}
    shard = tasks[rank::world]
    model = model if model is not None else collector.policy.module
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with collector.sampling_temperature(temperature):
            rollout = collector.collect("eval", shard, traj_offset=rank * -(-len(tasks) // world))  # ids unique across ranks
    finally:
        model.train(was_training)
    records = [episode_record(e, collector.source.reports_score) for e in rollout.episodes[: len(shard)]]
    collector.record(rollout, tag=tag, step=step)
    records = gather_object(records) if world > 1 else records
    result = summarise_evaluation(records, collector.source.report_key)
    result.update(step=step, tag=tag, split=split, seconds=time.perf_counter() - start)
    return result


def logged_values(result: dict[str, Any]) -> dict[str, float]:
    """What an evaluation logs: each number of `result` but its step, as `eval/<name>`."""
    return {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float)) and k not in ("step",)}


def keep_result(
    result: dict[str, Any], history: list[dict[str, Any]], *, log_now, log_later: dict[str, list[float]],
    output_dir: str | Path | None,
) -> None:
    """Append `result` to the run's `history` and log it: a "final" result at once (`log_now`, the run is
    ending), the others with the next training log (appended to TRL's metric buffers, `log_later`). With
    `output_dir` (the main process) the whole history is written there (`write_history`)."""
    history.append(result)
    logs = logged_values(result)
    if result.get("tag") == "final":
        log_now(logs)
    else:
        for key, value in logs.items():
            log_later[key].append(float(value))
    if output_dir is not None:
        write_history(output_dir, history)


def write_history(output_dir: str | Path, history: list[dict[str, Any]]) -> None:
    """Every evaluation of the run so far, as `<output_dir>/eval_results.json` (main process only)."""
    path = Path(output_dir) / EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history, indent=2))


class EvaluationCallback(TrainerCallback):
    """Evaluates before training (`evaluate_before_training`) and every `eval_interval` steps
    (the last step is left to `FinalEvaluationCallback`)."""

    def __init__(self, trainer: Evaluates):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if args.evaluate_before_training and state.global_step == 0:
            self.trainer.evaluate_policy(tag="before")

    def on_step_end(self, args, state, control, **kwargs):
        if args.eval_interval and state.global_step % args.eval_interval == 0 and state.global_step < state.max_steps:
            self.trainer.evaluate_policy(tag="interval")


class FinalEvaluationCallback(TrainerCallback):
    """The final evaluation, placed before every other callback: the trackers' own
    `on_train_end` finishes their runs, and the evaluation still logs (TRL's profiling too)."""

    def __init__(self, trainer: Evaluates):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        if not self.trainer.interrupted:  # a preempted run saves and leaves; it evaluates after resuming
            self.trainer.evaluate_policy(tag="final")
