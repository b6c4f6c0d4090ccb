"""A partition added with `register_partition` is a first-class estimator axis: the trainer
asks it what to capture from the rollout and trains with it, no file of the package edited."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from bipace_trainer import BiPACETrainer
from bipace_trainer.advantages import PARTITIONS, Partition, estimate_advantages, register_partition
from tests.trainer.tiny_setup import LORA, CapturingTrainer, make_model, make_tokenizer, tiny_args


@pytest.fixture(scope="module")
def tiny_policy():
    tokenizer = make_tokenizer()
    return make_model(tokenizer), tokenizer


@pytest.fixture
def by_turn():
    """Cells = the turn index within each task group (a toy: the same depth counts as the same state)."""
    register_partition("by_turn", lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.t))
    yield "by_turn"
    PARTITIONS.pop("by_turn")


@pytest.fixture
def by_hidden_sign():
    """Cells = the sign pattern of the first two hidden units: a partition that reads hidden states."""

    def build(batch, layout, eps):
        return Partition.from_labels(layout.group_index, (batch.hidden[:, :2] > 0).long() @ torch.tensor([1, 2]))

    register_partition("by_hidden_sign", build, needs=("hidden",))
    yield "by_hidden_sign"
    PARTITIONS.pop("by_hidden_sign")


def test_the_trainer_captures_hidden_states_only_for_a_partition_that_reads_them_or_when_asked(
    tiny_policy, by_turn, by_hidden_sign, tmp_path
):
    model, tokenizer = tiny_policy
    cases = ((by_turn, False, False), (by_hidden_sign, False, True), (by_turn, True, True))  # capture_hidden_states
    for partition, asked, captures in cases:
        args = tiny_args(tmp_path / f"{partition}-{asked}", preset="gigpo", step_partition=partition,
                         capture_hidden_states=asked, evaluate_before_training=False)
        trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer)
        try:
            assert trainer.needs_hidden is captures, (partition, asked)
            assert trainer.collector.hidden is trainer.hidden_plan  # the one plan, chosen once
        finally:
            trainer.close_envs()


@pytest.mark.slow  # trains (pyproject's marker)
def test_one_training_step_with_a_registered_partition(tiny_policy, by_turn, tmp_path):
    model, tokenizer = tiny_policy
    args = tiny_args(tmp_path / "run", preset="gigpo", step_partition=by_turn, max_steps=1, gradient_accumulation_steps=1,
                     tasks_per_iteration=1, per_device_train_batch_size=4, evaluate_before_training=False,
                     eval_tasks=1)  # fmt: skip
    trainer = CapturingTrainer(model=model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    try:
        trainer.train()
    finally:
        trainer.close_envs()
    assert trainer.state.global_step == 1 and len(trainer.captured) == 1
    rollout, advantages, _ = trainer.captured[0]
    batch = rollout.step_batch()
    assert batch.hidden is None  # nothing captured: the partition reads no hidden state
    estimate = estimate_advantages(batch, args.estimator)
    torch.testing.assert_close(advantages, estimate.advantage, rtol=0, atol=0)
    # one cell per turn index: steps share a cell exactly when they share t
    same_cell = estimate.cell[:, None] == estimate.cell[None, :]
    assert torch.equal(same_cell, batch.t[:, None] == batch.t[None, :])
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "estimator/num_cells" in logged and "estimator/cluster_eps" not in logged
