"""Dynamic sampling (`resample_without_signal`): a generation whose advantages are all 0 is
played again on freshly drawn training tasks, a bounded number of times, before its update is skipped."""

from __future__ import annotations

import pytest

from tests.reliability.faulty_envs import SignalAfterResetsEnv
from tests.trainer.tiny_setup import CapturingTrainer, lora_state, tiny_args
from bipace_trainer import BiPACEConfig

pytestmark = pytest.mark.slow

SIGNAL_ENV = "tests.reliability.faulty_envs:SignalAfterResetsEnv"
CONSTANT_ENV = "tests.reliability.faulty_envs:ConstantRewardEnv"


def run(warm_policy, tmp_path, env_name, env_kwargs, **overrides):
    model, tokenizer = warm_policy
    args = tiny_args(
        tmp_path, env_name=env_name, env_kwargs=env_kwargs, preset="bipace_q", invalid_action_penalty=0.0,
        max_steps=1, tasks_per_iteration=1, num_generations=4, gradient_accumulation_steps=1,
        evaluate_before_training=False, eval_tasks=1, **overrides,
    )
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainer.close_envs()
    logs = next(entry for entry in trainer.state.log_history if "train/skipped_batches" in entry)
    changed = any(not p.detach().equal(before[n]) for n, p in trainer.model.named_parameters())
    return trainer, logs, changed


def test_a_batch_without_signal_is_played_again_and_the_new_one_trained(warm_policy, tmp_path):
    SignalAfterResetsEnv.resets = 0
    # the first generation's 4 rollouts all lose; the redrawn group wins 2 of 4
    trainer, logs, changed = run(warm_policy, tmp_path, SIGNAL_ENV, {"quiet_resets": 4}, resample_without_signal=3)
    assert logs["train/resamples"] == 1.0 and logs["train/skipped_batches"] == 0.0
    assert logs["episode/success_rate_all_played"] == pytest.approx(2 / 8)  # both rollouts, 8 episodes
    assert logs["episode/success_rate"] == pytest.approx(2 / 4)  # the kept one
    assert trainer.skipped_updates == [False] and changed
    (rollout, advantages, _), = trainer.captured
    assert (advantages != 0).any() and sum(e.won for e in rollout.episodes) == 2


def test_resampling_is_bounded_and_then_the_update_is_skipped(warm_policy, tmp_path):
    trainer, logs, changed = run(warm_policy, tmp_path, CONSTANT_ENV, {}, resample_without_signal=2)
    assert logs["train/resamples"] == 2.0 and logs["train/skipped_batches"] == 1.0
    assert trainer.collector.train_generations == 3  # the batch and two retries, then no more
    assert trainer.skipped_updates == [True] and not changed


def test_without_resampling_the_batch_is_skipped_at_once(warm_policy, tmp_path):
    SignalAfterResetsEnv.resets = 0
    trainer, logs, changed = run(warm_policy, tmp_path, SIGNAL_ENV, {"quiet_resets": 4})
    assert logs["train/skipped_batches"] == 1.0 and "train/resamples" not in logs
    assert trainer.collector.train_generations == 1 and not changed


def test_redrawn_tasks_come_from_the_training_set_one_per_group_and_repeat_on_resume(warm_policy, tmp_path):
    model, tokenizer = warm_policy
    trainer = CapturingTrainer(model, args=tiny_args(tmp_path, resample_without_signal=1), processing_class=tokenizer)
    from bipace_trainer.rollout.loop import TaskRef

    tasks = [TaskRef(0, group=g) for g in (0, 0, 0, 1, 1, 1)]
    training_ids = set(trainer.train_dataset["task_id"])
    draws = [trainer._redraw_tasks(tasks, attempt) for attempt in (1, 2, 3)]
    for drawn in draws:
        assert {ref.task_id for ref in drawn} <= training_ids
        assert len({ref.task_id for ref in drawn[:3]}) == 1 and len({ref.task_id for ref in drawn[3:]}) == 1
        assert [ref.group for ref in drawn] == [0, 0, 0, 1, 1, 1]
    assert trainer._redraw_tasks(tasks, 2) == draws[1]  # same seed, step and attempt: same tasks
    trainer.close_envs()


def test_a_negative_retry_count_is_refused_with_the_field_and_fix(tmp_path):
    with pytest.raises(ValueError, match="resample_without_signal=-1.*>= 0"):
        BiPACEConfig(output_dir=str(tmp_path), env_name="tiny", resample_without_signal=-1)
