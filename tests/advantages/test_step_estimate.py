"""`estimate_advantages` exposes what produced each step's advantage (return, cell, PACE
branch) for trajectory logs, and leaves the advantages bit-identical."""

from __future__ import annotations

import pytest
import torch

from bipace_trainer.advantages import (
    StepAdvantageEstimator,
    StepBatch,
    compute_advantages,
    estimate_advantages,
    resolve_settings,
)
from bipace_trainer.advantages.baselines import BRANCH_LOO, BRANCH_PACE, BRANCH_SINGLETON

# One task group, three trajectories of two steps (rows in (traj, t) order):
#   traj 0: s0 --a--> s1 --b--> reward 1
#   traj 1: s0 --c--> s2 --b (invalid)--> reward 0
#   traj 2: s0 --a--> s1 --b--> reward 0
BATCH = dict(
    group=[0, 0, 0, 0, 0, 0],
    traj=[0, 0, 1, 1, 2, 2],
    t=[0, 1, 0, 1, 0, 1],
    reward=[0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    valid=[True, True, True, False, True, True],
    anchor=["s0", "s1", "s0", "s2", "s0", "s1"],
    action_key=["a", "b", "c", "b", "a", "b"],
)
# γ = 0.95; the invalid step's 0.1 penalty is subtracted after discounting (docs/concepts/math.md#step-returns)
RETURNS = [0.95, 1.0, 0.0, -0.1, 0.0, 0.0]


def test_pace_steps_carry_return_cell_and_branch():
    settings = resolve_settings("bipace_q", step_partition="hash")
    estimate = estimate_advantages(StepBatch(**BATCH), settings)
    torch.testing.assert_close(estimate.step_return, torch.tensor(RETURNS, dtype=torch.float64))
    cell = estimate.cell.tolist()
    assert cell[0] == cell[2] == cell[4] and cell[1] == cell[5] and len(set(cell)) == 3  # s0, s1, s2
    # s0 holds keys {a, c}: PACE; s1 holds only b: leave-one-out; s2 is alone
    P, L, S = BRANCH_PACE, BRANCH_LOO, BRANCH_SINGLETON
    assert estimate.branch.tolist() == [P, L, P, S, P, L]


@pytest.mark.parametrize("preset", ["grpo", "gigpo", "bipace_q", "gagpo"])
def test_advantages_are_bit_identical_to_compute_advantages(preset):
    overrides = {"step_partition": "hash"} if preset == "bipace_q" else {}
    settings = resolve_settings(preset, **overrides)
    advantage, diagnostics = compute_advantages(StepBatch(**BATCH), settings)
    estimate = estimate_advantages(StepBatch(**BATCH), settings)
    assert torch.equal(estimate.advantage, advantage)
    assert {k: v for k, v in estimate.diagnostics.items() if not k.startswith("time/")} == {
        k: v for k, v in diagnostics.items() if not k.startswith("time/")
    }
    torch.testing.assert_close(estimate.step_return, torch.tensor(RETURNS, dtype=torch.float64))
    assert (estimate.cell is None) == (preset == "grpo")  # GRPO has no state partition
    assert (estimate.branch is None) == (preset != "bipace_q")  # only PACE baselines have branches


def test_estimator_estimate_matches_its_call():
    settings = resolve_settings("gigpo")
    advantage, _ = StepAdvantageEstimator(settings)(StepBatch(**BATCH))
    estimator = StepAdvantageEstimator(settings)
    estimate = estimator.estimate(StepBatch(**BATCH))
    assert torch.equal(estimate.advantage, advantage) and estimator.num_calls == 1
