"""The estimator corrections of issue 20, item 6, on hand-made cases:

- GAGPO's invalid-action penalty reaches the invalid step only, at every λ (it used to
  enter δ through the penalised returns and pay the step before an invalid action a net
  bonus of about γ(1-λ)p);
- a trajectory cut by the turn budget is terminal by default (GiGPO) and bootstraps its
  last step from the value proxy with `bootstrap_truncated`;
- the rollout marks the cut trajectories' last steps in the estimator's input.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bipace_trainer.advantages import (
    BatchLayout,
    StepBatch,
    compute_advantages,
    estimate_advantages,
    hash_partition,
    resolve_settings,
    step_returns,
)
from bipace_trainer.advantages.baselines import grouped_gae
from bipace_trainer.rollout.loop import Episode, Rollout


def two_copies(reward_last: float, second_valid: bool) -> StepBatch:
    """Two rollouts of one task, both a → b; the second's step at b is invalid unless `second_valid`."""
    return StepBatch(
        group=[0] * 4, traj=[0, 0, 1, 1], t=[0, 1, 0, 1], reward=[0.0, reward_last, 0.0, reward_last],
        valid=[True, True, True, second_valid], anchor=["a", "b", "a", "b"], action_key=["x", "y", "x", "y"],
    )  # fmt: skip


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("reward_last", [0.0, 1.0])
@pytest.mark.parametrize("preset", ["gagpo", "bigagpo"])
def test_gagpo_penalty_reaches_only_the_invalid_step(lam, reward_last, preset):
    """The issue's case (γ = 0.95, p = 0.1): the first steps, identical moves from the same
    state, get the same advantage at every λ (before: +0.116 apart at λ = 0.95, +1.05 at
    λ = 0.5, 0 at λ = 1); the invalid step is the one pushed down."""
    batch = two_copies(reward_last, second_valid=False)
    batch.hidden = torch.eye(2)[[0, 1, 0, 1]]  # bigagpo: the same two states, ε = 0
    settings = resolve_settings(preset, gae_lambda=lam, step_gamma=0.95, invalid_action_penalty=0.1, cluster_eps=0.0)
    advantage, _ = compute_advantages(batch, settings)
    assert advantage[0] == advantage[2]
    assert advantage[3] < advantage[1]


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95])
def test_gagpo_penalty_leaves_earlier_steps_alone_before_normalisation(lam):
    """Â of the steps before an invalid one is what it would be without the penalty."""
    layout_batch = StepBatch(
        group=[0] * 6, traj=[0, 0, 0, 1, 1, 1], t=[0, 1, 2] * 2, reward=[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        valid=[True, True, False, True, True, True], anchor=["a", "b", "c", "a", "b", "d"],
    )  # fmt: skip
    layout = BatchLayout.from_batch(layout_batch)
    cells = hash_partition(layout_batch.anchor, layout)
    env = step_returns(layout_batch.reward, layout_batch.valid, layout, 0.95, 0.0)
    penalty = 0.1 * (~layout_batch.valid).to(torch.float64)
    with_penalty = grouped_gae(env, cells, layout, 0.95, lam, penalty)
    without = grouped_gae(env, cells, layout, 0.95, lam)
    torch.testing.assert_close(with_penalty[[0, 1, 3, 4, 5]], without[[0, 1, 3, 4, 5]], rtol=0, atol=0)
    # cell c is a singleton: its centred penalty is 0 (it is compared with nothing)
    torch.testing.assert_close(with_penalty[2], without[2], rtol=0, atol=0)


def test_gagpo_at_lambda_one_still_telescopes_to_the_penalised_return_minus_the_cell_mean():
    batch = two_copies(1.0, second_valid=False)
    layout = BatchLayout.from_batch(batch)
    cells = hash_partition(batch.anchor, layout)
    gamma = 0.95
    env = step_returns(batch.reward, batch.valid, layout, gamma, 0.0)
    returns = step_returns(batch.reward, batch.valid, layout, gamma, 0.1)
    penalty = env - returns
    cell_mean = torch.zeros(cells.num_cells, dtype=torch.float64).index_add_(0, cells.cell, returns) / cells.size
    got = grouped_gae(env, cells, layout, gamma, 1.0, penalty)
    torch.testing.assert_close(got, returns - cell_mean[cells.cell], atol=1e-12, rtol=0)


def cut_and_finished() -> StepBatch:
    """Task group of two rollouts over anchors a → b (γ = 0.5):

    traj 0: a → b, reward 1 at b: the env ended it (success).
    traj 1: a → b, reward 0, cut by the turn budget after b.
    """
    return StepBatch(
        group=[0] * 4, traj=[0, 0, 1, 1], t=[0, 1, 0, 1], reward=[0.0, 1.0, 0.0, 0.0],
        anchor=["a", "b", "a", "b"], action_key=["x", "y", "x", "y"], truncated=[False, False, False, True],
    )  # fmt: skip


def test_truncated_trajectories_are_terminal_by_default():
    """GiGPO's behaviour stays the default: `truncated` is read only with bootstrap_truncated."""
    batch = cut_and_finished()
    plain = StepBatch(**{**batch.__dict__, "truncated": None})
    for preset in ("gigpo", "gagpo"):
        settings = resolve_settings(preset, step_gamma=0.5)
        assert torch.equal(compute_advantages(batch, settings)[0], compute_advantages(plain, settings)[0])
        estimate = estimate_advantages(batch, settings)
        torch.testing.assert_close(estimate.step_return, torch.tensor([0.5, 1.0, 0.0, 0.0], dtype=torch.float64))


def test_bootstrap_truncated_continues_from_the_value_proxy():
    """Terminal returns R = [0.5, 1 | 0, 0]; cell b holds {1, 0}: V̄(b) = 0.5 stands in for
    the unobserved state after the cut, so traj 1's returns become
    R_1 = 0 + 0.5 · 0.5 = 0.25 and R_0 = 0.5 · 0.25 = 0.125."""
    settings = resolve_settings("gigpo", step_gamma=0.5, advantage_norm="mean", bootstrap_truncated=True)
    estimate = estimate_advantages(cut_and_finished(), settings)
    torch.testing.assert_close(estimate.step_return, torch.tensor([0.5, 1.0, 0.125, 0.25], dtype=torch.float64))
    # A^ep still scores what the episodes got (1 and 0): ±0.5; the step term compares the bootstrapped returns
    expected = torch.tensor([0.5 + 0.1875, 0.5 + 0.375, -0.5 - 0.1875, -0.5 - 0.375])
    torch.testing.assert_close(estimate.advantage, expected)


def test_bootstrap_truncated_gae_uses_the_bootstrap_as_the_value_after_the_cut():
    """GAE's δ of the cut step is r + γ R_L - V̄(s): with λ = 1 it telescopes to the
    bootstrapped return minus the cell mean of the bootstrapped returns."""
    batch = cut_and_finished()
    settings = resolve_settings("gagpo", step_gamma=0.5, gae_lambda=1.0, bootstrap_truncated=True, invalid_action_penalty=0.0)
    estimate = estimate_advantages(batch, settings)
    returns = estimate.step_return  # [0.5, 1, 0.125, 0.25]
    raw = returns - torch.tensor([0.3125, 0.625, 0.3125, 0.625], dtype=torch.float64)  # cells a and b
    normalised = (raw - raw.mean()) / (raw.std() + 1e-6)
    torch.testing.assert_close(estimate.advantage, normalised.to(torch.float32))


def test_truncated_must_mark_a_last_step():
    with pytest.raises(ValueError, match="StepBatch.truncated.*last"):
        BatchLayout.from_batch(StepBatch(group=[0, 0], traj=[1, 1], t=[0, 1], reward=[0.0, 0.0], truncated=[True, False]))


def test_rollout_marks_the_last_step_of_each_cut_trajectory():
    def step(traj, t):  # the fields step_batch reads of a StepRecord
        return SimpleNamespace(group=0, traj=traj, t=t, reward=0.0, valid=True, anchor=f"s{t}", action_key="go",
                               action="go", hidden=None, milestone=None)  # fmt: skip

    episodes = [Episode(traj=7, group=0, task_id=0, attributes={}, length=2, truncated=True),
                Episode(traj=8, group=0, task_id=0, attributes={}, length=2, won=True)]  # fmt: skip
    rollout = Rollout(steps=[step(7, 0), step(7, 1), step(8, 0), step(8, 1)], episodes=episodes, seconds={})
    assert rollout.step_batch().truncated.tolist() == [False, True, False, False]
