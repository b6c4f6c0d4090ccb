"""Batches with no learning signal stay finite and are skipped; non-finite losses stop the run."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bipace_trainer.advantages import PRESETS, StepBatch, compute_advantages, factorize, resolve_settings
from tests.trainer.tiny_setup import CapturingTrainer, tiny_args

PRESET_NAMES = sorted(PRESETS)


def batch(rows):
    """Step rows (group, traj, t, reward, anchor, key); the hidden state of a step is the
    one-hot of its anchor, so hidden and hash partitions see the same states. No step reaches a
    milestone: BEACON's degenerate case, every milestone return 0."""
    group, traj, t, reward, anchor, key = (list(c) for c in zip(*rows)) if rows else ([],) * 6
    ids = factorize(anchor)
    hidden = torch.nn.functional.one_hot(ids, int(ids.max()) + 1 if len(ids) else 1).float()
    return StepBatch(
        group=group, traj=traj, t=t, reward=reward, anchor=anchor, action_key=key, hidden=hidden, milestone=[False] * len(group)
    )


def assert_finite_zero(advantages):
    assert torch.isfinite(advantages).all()
    assert (advantages == 0).all()


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_all_equal_rewards_give_zero_advantages(preset):
    rows = [(g, g * 4 + r, t, 1.0 if t == 2 else 0.0, f"s{t}", f"a{r % 2}") for g in range(3) for r in range(4) for t in range(3)]
    assert_finite_zero(compute_advantages(batch(rows), resolve_settings(preset, cluster_eps=0.5))[0])


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_step_a_singleton_gives_no_step_term(preset):
    rows = [(0, r, t, float(r == 0 and t == 1), f"s{r}-{t}", "a") for r in range(4) for t in range(2)]
    settings = resolve_settings(preset, cluster_eps=0.0, w_ep=0.0 if preset not in ("grpo",) else 1.0)
    advantages, diagnostics = compute_advantages(batch(rows), settings)
    assert torch.isfinite(advantages).all()
    if settings.step_partition not in ("none", "segment"):  # BEACON's segment 0 holds every first step
        assert diagnostics["estimator/singleton_rate"] == 1.0
        assert (advantages == 0).all()


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_one_rollout_per_task_has_no_group_signal(preset):
    rows = [(g, g, t, float(t == 1), f"s{t}", "a") for g in range(3) for t in range(2)]
    assert_finite_zero(compute_advantages(batch(rows), resolve_settings(preset, cluster_eps=0.5))[0])


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_zero_length_episodes_and_empty_batches(preset):
    # trajectory 1 of group 0 has no steps at all (its env failed at reset)
    rows = [(0, 0, 0, 1.0, "s", "a"), (0, 2, 0, 0.0, "s", "b")]
    advantages, _ = compute_advantages(batch(rows), resolve_settings(preset, cluster_eps=0.5))
    assert torch.isfinite(advantages).all() and advantages.shape == (2,)
    empty, diagnostics = compute_advantages(batch([]), resolve_settings(preset, cluster_eps=0.5))
    assert empty.shape == (0,) and all(v == v for v in diagnostics.values())


@pytest.mark.slow
@pytest.mark.parametrize("env_name,overrides", [
    ("tests.reliability.faulty_envs:AlwaysFailingEnv", {}),  # every env fails: zero-length episodes only
    ("tests.reliability.faulty_envs:ConstantRewardEnv", {"invalid_action_penalty": 0.0}),  # every reward equal
])
def test_trainer_skips_batches_without_signal(env_name, overrides, warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path, env_name=env_name, env_kwargs={}, preset="bipace_q", max_steps=2,
                     evaluate_before_training=False, eval_tasks=2, **overrides)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    every_env_fails = env_name.endswith("AlwaysFailingEnv")
    # the batches are skipped; a run in which every env failed then ends with the env's error
    with pytest.raises(RuntimeError, match="engine is down") if every_env_fails else contextlib.nullcontext():
        trainer.train()
    trainer.close_envs()
    assert len(trainer.captured) == 2 and trainer.skipped_updates == [True, True]
    for _, advantages, batch in trainer.captured:
        assert_finite_zero(advantages)
        assert "skip_update" not in batch  # the flag is the trainer's, not a key in TRL's batch
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["loss"] == 0.0 for entry in logs)
    assert all(entry["train/skipped_batches"] == 1.0 for entry in logs if "train/skipped_batches" in entry)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # skipped: not even Adam moved them


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_with_a_clear_error(warm_policy, tmp_path):
    model, tokenizer = warm_policy

    class NaNLoss(CapturingTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * float("nan")

    args = tiny_args(tmp_path, preset="gigpo", max_steps=2, evaluate_before_training=False)
    trainer = NaNLoss(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    with pytest.raises(FloatingPointError, match="Non-finite loss .* learning_rate"):
        trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 0  # the optimizer never applied it
