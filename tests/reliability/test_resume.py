"""Resume equals the uninterrupted run, in weights and in every logged metric but timings,
across epoch boundaries (TRL's sampler order) and from a checkpoint taken while one
generation still feeds further optimizer steps (the buffered samples)."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from bipace_trainer import BiPACETrainer
from bipace_trainer.models import load_tokenizer
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
