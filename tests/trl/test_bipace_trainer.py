"""`BiPACETrainer` trains our envs' TRL classes (`envs.as_trl_environment`) with step credit (slow).

The same class `GRPOTrainer` trains in tests/trl/test_grpo_trainer.py, passed to
`BiPACETrainer(environment_factory=...)`: each assistant turn is a sample, the text `act`
returns is the next state, and steps in one state share a cell of the hash partition.
"""

from __future__ import annotations

import pytest

from bipace_trainer import BiPACEConfig
from envs import as_trl_environment, trl_task_dataset
from tests.trainer.test_trl_environment import Recording
from tests.trl.tool_model import TINY_KWARGS


def bipace_args(output_dir, **overrides) -> BiPACEConfig:
    values = dict(
        output_dir=str(output_dir), preset="gigpo", w_ep=0.0,  # the advantage is the step term alone
        max_steps=1, tasks_per_iteration=2, num_generations=8, per_device_train_batch_size=4,
        max_turns=4, max_turn_length=48, max_completion_length=1024,  # each reply 48 tokens; the episode (TRL's cap) never 1024
        max_tool_calling_iterations=4, learning_rate=1e-3,
        temperature=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
        disable_tqdm=True, shuffle_dataset=False,
    )
    values.update(overrides)
    return BiPACEConfig(**values)


def cells_with_credit(rollout, estimate) -> list[list[int]]:
    """Indices of the steps of each cell of more than one step whose advantages are not all 0."""
    members: dict[int, list[int]] = {}
    for index in range(len(rollout.steps)):
        members.setdefault(int(estimate.cell[index]), []).append(index)
    return [
        indices for indices in members.values()
        if len(indices) > 1 and any(float(estimate.advantage[i]) != 0.0 for i in indices)
    ]


@pytest.mark.slow
def test_bipace_trainer_trains_the_tiny_class_with_step_credit(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    # Tasks 2 (cell 0 to 3) and 6 (cell 2 to 0) take 3 and 2 moves; the first iteration plays rows 0 and 1
    # (no shuffle). BiPACETrainer needs more rows than one iteration takes to have a training step at all.
    dataset = trl_task_dataset("tiny", **TINY_KWARGS).filter(lambda row: row["task_id"] in (2, 6)).select([0, 1] * 3)
    trainer = Recording(
        model=model, processing_class=tokenizer, args=bipace_args(tmp_path), train_dataset=dataset,
        environment_factory=as_trl_environment("tiny", **TINY_KWARGS),
    )
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 1
    rollout, estimate = trainer.recorded[0]
    assert {episode.task_id for episode in rollout.episodes} == {2, 6}
    assert len(rollout.steps) > len(rollout.episodes)  # one sample per assistant turn, several turns
    for step in rollout.steps:  # a step's state is the text the env returned: reset's, or act's
        assert step.anchor.startswith(("You are an agent", "You ", "Nothing happens.", "The episode is over"))
    credited = cells_with_credit(rollout, estimate)
    assert credited, "no cell of several steps got step credit"
    for indices in credited:
        assert len({rollout.steps[i].anchor for i in indices}) == 1  # exact match: one state per cell
        assert len({rollout.steps[i].group for i in indices}) == 1
