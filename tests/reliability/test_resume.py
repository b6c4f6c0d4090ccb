"""Resume equals the uninterrupted run, in weights and in every logged metric but timings,
across epoch boundaries (TRL's sampler order), from a checkpoint taken while one
generation still feeds further optimizer steps (the buffered samples), and from
checkpoints moved to new storage (a checkpoint carries its run's identity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bipace_trainer import BiPACETrainer
from bipace_trainer.models import load_tokenizer
from bipace_trainer.run import run_dir
from bipace_trainer.run.checkpointing import BUFFER_FILE
from tests.trainer.tiny_setup import StopAfter, tiny_args

STEPS = 6


class RecordingTrainer(BiPACETrainer):
    """Records the task ids of each training generation."""

    def on_rollout(self, rollout, advantages, diagnostics):
        self.generations.append(sorted(e.task_id for e in rollout.episodes))


def make(model_dir, run_dir, **settings):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
    args = tiny_args(run_dir, preset="bipace_q", max_steps=STEPS, save_strategy="steps", save_steps=1,
                     evaluate_before_training=False, eval_tasks=1, learning_rate=2e-3, **settings)
    trainer = RecordingTrainer(model, args=args, processing_class=tokenizer)
    trainer.generations = []
    return trainer


def timing(key: str) -> bool:
    """A wall-clock measurement, which no resume can reproduce (the rollout's idle and env-wait shares are ones too)."""
    return key.startswith("time/") or key.endswith(("seconds", "_per_second", "step_time", "runtime", "_share"))


def logs(trainer):
    return [{k: v for k, v in e.items() if not timing(k)} for e in trainer.state.log_history]


@pytest.mark.slow
@pytest.mark.parametrize("case,settings,stop_at", [
    # one generation per optimizer step, 4 tasks = 2 steps per epoch: resume in epoch 1 of 3
    ("epochs", dict(train_tasks=4), 3),
    # one generation feeds 2 optimizer steps, 8 tasks = 4 steps per epoch: resume in epoch 1,
    # half-way through the generation of steps 5-6
    ("mid-generation", dict(train_tasks=8, tasks_per_iteration=4, steps_per_generation=4), 5),
])
def test_resume_equals_the_uninterrupted_run(case, settings, stop_at, warm_policy_dir, tmp_path):
    straight = make(warm_policy_dir, tmp_path / "straight", **settings)
    straight.train()
    straight.close_envs()

    stopped = make(warm_policy_dir, tmp_path / "resumed", **settings)
    stopped.add_callback(StopAfter(stop_at))
    stopped.train()
    stopped.close_envs()
    checkpoint = tmp_path / "resumed" / f"checkpoint-{stop_at}"
    assert (checkpoint / BUFFER_FILE.format(rank=0)).exists() == (case == "mid-generation")

    resumed = make(warm_policy_dir, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close_envs()

    assert resumed.state.global_step == straight.state.global_step == STEPS
    # the resumed process generated only what the straight run generated after the checkpoint
    assert resumed.generations == straight.generations[len(stopped.generations):]
    assert len(set(map(tuple, straight.generations))) > 1  # the order changes between epochs: the test can tell
    # every step's metrics (the resumed state's log holds the steps before the checkpoint too)
    resumed_steps = [e for e in logs(resumed) if "loss" in e]
    straight_steps = [e for e in logs(straight) if "loss" in e]
    assert [e["step"] for e in resumed_steps] == list(range(1, STEPS + 1))
    for got, want in zip(resumed_steps, straight_steps):
        assert got == want, got["step"]
    final_eval = [[e for e in logs(run) if "eval/success_rate" in e] for run in (resumed, straight)]
    assert final_eval[0] == final_eval[1] and final_eval[0]
    final_straight = {n: p.detach() for n, p in straight.model.named_parameters()}
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), final_straight[name], rtol=0, atol=0)


def _through_train_py(model_dir, out, resume=None, **settings):
    """A trainer for `out` after train.py's checks of the folder (`prepare_output_dir`: the run's
    identity recorded or taken from the checkpoint), and the checkpoint it resumes from."""
    from trl import ModelConfig

    from bipace_trainer.cli import train

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
    args = tiny_args(out, preset="bipace_q", save_strategy="steps", save_steps=1, evaluate_before_training=False,
                     eval_tasks=1, learning_rate=2e-3, resume_from_checkpoint=resume, **settings)
    train.prepare_output_dir(train.ScriptArguments(), args, ModelConfig(model_name_or_path=str(model_dir)))
    return RecordingTrainer(model, args=args, processing_class=tokenizer), args.resume_from_checkpoint


@pytest.mark.slow
def test_checkpoints_moved_to_new_storage_resume_as_the_uninterrupted_run(warm_policy_dir, tmp_path):
    settings = dict(max_steps=3, train_tasks=4)
    straight, _ = _through_train_py(warm_policy_dir, tmp_path / "straight", **settings)
    straight.generations = []
    straight.train()
    straight.close_envs()
    first = tmp_path / "straight"
    # the run as it stood after 2 steps, moved three ways: checkpoints alone, the whole output_dir, one checkpoint's path
    (tmp_path / "copied").mkdir()
    for name in ("checkpoint-1", "checkpoint-2"):
        shutil.copytree(first / name, tmp_path / "copied" / name)
    shutil.copytree(first, tmp_path / "whole", ignore=shutil.ignore_patterns("checkpoint-3"))
    (tmp_path / "whole" / run_dir.RUN_FILE).write_text((first / run_dir.RUN_FILE).read_text())
    moves = {"copied": "true", "whole": "true", "fresh": str(tmp_path / "copied" / "checkpoint-2")}
    want = [e for e in logs(straight) if "loss" in e]
    for out, resume in moves.items():
        resumed, checkpoint = _through_train_py(warm_policy_dir, tmp_path / out, resume, **settings)
        assert Path(checkpoint).name == "checkpoint-2", out
        resumed.generations = []
        resumed.train(resume_from_checkpoint=checkpoint)
        resumed.close_envs()
        assert resumed.state.global_step == 3 and len(resumed.generations) == 1, out
        assert [e for e in logs(resumed) if "loss" in e] == want, out
        for name, param in resumed.model.named_parameters():
            torch.testing.assert_close(param.detach(), dict(straight.model.named_parameters())[name].detach(), rtol=0, atol=0)
        # it saved on as the same run: its checkpoint-3 carries the first run's id
        saved = json.loads((tmp_path / out / "checkpoint-3" / "bipace_state.json").read_text())
        assert saved["run_id"] == run_dir.run_id(first) == run_dir.run_id(tmp_path / out), out
