"""Identities docs/concepts/math.md says must hold between estimators, and exact hand-made values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import (
    BatchLayout,
    StepBatch,
    compute_advantages,
    estimate_advantages,
    factorize,
    hash_partition,
    hidden_partition,
    PRESETS,
    resolve_settings,
    step_returns,
)
from bipace_trainer.advantages.baselines import grouped_gae, mean_baseline, pace_q_baseline
from bipace_trainer.advantages import EstimatorSettings

from .strategies import PROTOTYPES, step_lists, to_batch

BASELINES = ["mean", "pace_q", "pace_diff", "gae"]


def one_hot_hidden(batch: StepBatch) -> torch.Tensor:
    ids = batch.anchor
    return torch.nn.functional.one_hot(ids, int(ids.max()) + 1).to(torch.float32)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists(), baseline=st.sampled_from(BASELINES), norm=st.sampled_from(["mean", "mean_std"]))
def test_hidden_eps0_on_one_hot_equals_hash(steps, baseline, norm):
    batch = to_batch(steps)
    batch.hidden = one_hot_hidden(batch)
    layout = BatchLayout.from_batch(batch)
    by_hash = hash_partition(batch.anchor, layout)
    by_hidden = hidden_partition(batch.hidden, layout, eps=0.0)
    # Same partition up to cell numbering: a bijection between cell ids.
    pairs = set(zip(by_hash.cell.tolist(), by_hidden.cell.tolist()))
    assert len(pairs) == by_hash.num_cells == by_hidden.num_cells
    hashed = compute_advantages(batch, EstimatorSettings(step_partition="hash", step_baseline=baseline, advantage_norm=norm))[0]
    clustered = compute_advantages(
        batch, EstimatorSettings(step_partition="hidden", step_baseline=baseline, advantage_norm=norm, cluster_eps=0.0)
    )[0]
    torch.testing.assert_close(hashed, clustered, atol=0, rtol=0)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists(), gamma=st.sampled_from([0.5, 0.95, 1.0]), penalty=st.sampled_from([0.0, 0.1]))
def test_gae_with_lambda_one_telescopes_to_return_minus_value(steps, gamma, penalty):
    batch = to_batch(steps)
    layout = BatchLayout.from_batch(batch)
    partition = hash_partition(batch.anchor, layout)
    returns = step_returns(batch.reward, batch.valid, layout, gamma, penalty)
    cell_mean = torch.zeros(partition.num_cells, dtype=torch.float64).index_add_(0, partition.cell, returns)
    cell_mean /= partition.size
    expected = returns - cell_mean[partition.cell]
    torch.testing.assert_close(grouped_gae(returns, partition, layout, gamma, 1.0), expected, atol=1e-9, rtol=0)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists(num_keys=1))
def test_pace_q_with_one_action_key_is_leave_one_out(steps):
    """One key per cell: Q̂ - V̂ is undefined, so PACE falls back to leave-one-out,
    which is n/(n-1) times the mean baseline."""
    batch = to_batch(steps)
    layout = BatchLayout.from_batch(batch)
    partition = hash_partition(batch.anchor, layout)
    returns = step_returns(batch.reward, batch.valid, layout, 0.95, 0.1)
    pace = pace_q_baseline(returns, partition, action_key=batch.action_key)
    mean = mean_baseline(returns, partition, norm="mean").advantage
    n = partition.step_cell_size().to(torch.float64)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    torch.testing.assert_close(pace.advantage, scale * mean, atol=1e-9, rtol=0)
    assert (pace.branch[n > 1] == 1).all()  # BRANCH_LOO


@pytest.mark.parametrize("preset", ["grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff", "gagpo", "bigagpo"])
@settings(max_examples=20, deadline=None)
@given(steps=step_lists(), data=st.data())
def test_invariant_to_permuting_task_groups(preset, steps, data):
    """Relabelling task groups and reordering rows changes nothing per step."""
    groups = sorted({s["group"] for s in steps})
    relabel = dict(zip(groups, data.draw(st.permutations([g * 7 + 3 for g in groups]))))
    permuted = [dict(s, group=relabel[s["group"]]) for s in steps]
    order = data.draw(st.permutations(range(len(steps))))
    permuted = [permuted[i] for i in order]
    est = resolve_settings(preset, cluster_eps=0.1)
    original = compute_advantages(to_batch(steps), est)[0]
    shuffled = compute_advantages(to_batch(permuted), est)[0]
    torch.testing.assert_close(shuffled, original[torch.tensor(order)], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("partition", ["hash", "hidden"])
@settings(max_examples=30, deadline=None)
@given(steps=step_lists(num_anchors=8))
def test_singleton_cells_get_zero_step_advantage(partition, baseline, steps):
    batch = to_batch(steps)
    est = EstimatorSettings(step_partition=partition, step_baseline=baseline, w_ep=0.0, cluster_eps=0.05)
    advantage = compute_advantages(batch, est)[0]
    layout = BatchLayout.from_batch(batch)
    cells = hash_partition(batch.anchor, layout) if partition == "hash" else hidden_partition(batch.hidden, layout, 0.05)
    singleton = cells.step_cell_size() == 1
    assert (advantage[singleton] == 0).all()


def test_hand_computed_gigpo_case():
    """Two rollouts of one task, γ = 0.5, both visit anchor "s0" first.

    traj 0: s0 -a-> s1 -b-> reward 1   returns R = [0.5, 1.0], R^ep = 1
    traj 1: s0 -c-> reward 0           returns R = [0.0],      R^ep = 0
    A^ep = ±(1 - 0.5)/(std([1, 0]) + 1e-6) = ±0.5/0.70710678
    cell s0 = {0.5, 0.0}: mean 0.25, std 0.35355339 → ±0.25/0.35355339; s1 singleton → 0
    """
    batch = StepBatch(
        group=[0, 0, 0], traj=[0, 0, 1], t=[0, 1, 0], reward=[0.0, 1.0, 0.0], anchor=["s0", "s1", "s0"],
        action_key=["a", "b", "c"],
    )
    est = resolve_settings("gigpo", step_gamma=0.5)
    got = compute_advantages(batch, est)[0]
    ep = 0.5 / (0.5**0.5 + 1e-6)
    step = 0.25 / (0.125**0.5 + 1e-6)
    torch.testing.assert_close(got, torch.tensor([ep + step, ep, -ep - step], dtype=torch.float32))


def test_hand_computed_pace_case():
    """One cell of four steps, keys a, a, b, b with returns 1, 0, 1, 1.

    V̂ = 0.75; Q̂(a) = 0.5, Q̂(b) = 1 → pace_q = [-0.25, -0.25, 0.25, 0.25]
    pace_diff: R_i - mean(other-key returns) = [1-1, 0-1, 1-0.5, 1-0.5]
    """
    batch = StepBatch(
        group=[0] * 4, traj=[0, 1, 2, 3], t=[0] * 4, reward=[1.0, 0.0, 1.0, 1.0], anchor=["s"] * 4,
        action_key=["a", "a", "b", "b"],
    )
    pace_q = compute_advantages(batch, EstimatorSettings(step_partition="hash", step_baseline="pace_q", w_ep=0.0))[0]
    pace_diff = compute_advantages(batch, EstimatorSettings(step_partition="hash", step_baseline="pace_diff", w_ep=0.0))[0]
    torch.testing.assert_close(pace_q, torch.tensor([-0.25, -0.25, 0.25, 0.25]))
    torch.testing.assert_close(pace_diff, torch.tensor([0.0, -1.0, 0.5, 0.5]))


def test_invalid_penalty_hits_only_its_step():
    """The penalty is subtracted after discounting: earlier steps' returns are untouched."""
    batch = StepBatch(group=[0, 0], traj=[0, 0], t=[0, 1], reward=[0.0, 1.0], valid=[True, False])
    layout = BatchLayout.from_batch(batch)
    returns = step_returns(batch.reward, batch.valid, layout, gamma=0.9, invalid_penalty=0.1)
    torch.testing.assert_close(returns, torch.tensor([0.9, 0.9], dtype=torch.float64))


def test_factorize_assigns_ids_by_first_appearance():
    assert factorize(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


@st.composite
def copied_group(draw):
    """One task group of G identical trajectories (same states, moves, rewards), beside
    a random group: returns like 0.95^k repeat exactly, and float sums of them do not."""
    length, copies = draw(st.integers(1, 6)), draw(st.integers(2, 8))
    rewards = draw(st.lists(st.sampled_from([0.0, 1.0, 0.3, 0.7, 10.0]), min_size=length, max_size=length))
    valid = draw(st.lists(st.sampled_from([True, True, False]), min_size=length, max_size=length))
    steps = [  # a new state each turn (a state seen twice in one trajectory has two returns)
        dict(group=99, traj=5000 + k, t=t, reward=rewards[t], valid=valid[t], anchor=f"copied-{t}",
             key=f"act-{t % 2}", hidden=PROTOTYPES[t], milestone=t % 2 == 1)
        for k in range(copies)
        for t in range(length)
    ]
    other = draw(step_lists(max_groups=1))
    order = draw(st.permutations(range(len(steps) + len(other))))
    merged = steps + other
    return [merged[i] for i in order]


# BEACON's cells are stages of the task, not states: one segment holds the steps before a milestone
# and the milestone step, whose returns differ (10 γ^k), so identical trajectories do get step
# credit there (`test_beacon_credits_the_steps_of_identical_trajectories_by_their_distance`).
STATE_PRESETS = sorted(name for name in PRESETS if resolve_settings(name).step_partition != "segment")


@settings(max_examples=80, deadline=None)
@given(steps=copied_group(), preset=st.sampled_from(STATE_PRESETS), gamma=st.sampled_from([0.9, 0.95, 0.99]))
def test_a_group_of_identical_trajectories_gets_exactly_zero(steps, preset, gamma):
    """Nothing tells identical trajectories apart, so every step gets exactly 0, not a
    rounding residue: the trainer skips an update only when all advantages are 0."""
    batch = to_batch(steps)
    settings_ = resolve_settings(preset, step_gamma=gamma, invalid_action_penalty=0.1, cluster_eps=0.0)
    advantage, _ = compute_advantages(batch, settings_)
    copied = batch.group == 99  # integer group ids are kept as given
    assert copied.any() and (advantage[copied] == 0).all(), advantage[copied]


@settings(max_examples=40, deadline=None)
@given(steps=copied_group(), gamma=st.sampled_from([0.9, 0.95, 0.99]))
def test_beacon_credits_the_steps_of_identical_trajectories_by_their_distance(steps, gamma):
    """Under `beacon` identical trajectories get the same advantage step by step (nothing tells
    the copies apart), and within a segment a step nearer its milestone gets more: the step term
    is R_t − the segment's mean, R_t = 10 γ^(steps to the milestone) − the penalty."""
    batch = to_batch(steps)
    estimate = estimate_advantages(batch, resolve_settings("beacon", step_gamma=gamma, w_ep=0.0))
    copied = (batch.group == 99).nonzero().flatten().tolist()
    by_t: dict[int, set[float]] = {}
    for i in copied:
        by_t.setdefault(int(batch.t[i]), set()).add(float(estimate.advantage[i]))
    assert all(len(values) == 1 for values in by_t.values()), by_t
    for i in copied:
        for j in copied:
            if estimate.cell[i] == estimate.cell[j] and batch.valid[i] and batch.valid[j] and batch.t[i] < batch.t[j]:
                nearer = estimate.step_return[j] > 0  # a milestone closes the segment: j is nearer it than i
                assert estimate.advantage[i] < estimate.advantage[j] if nearer else estimate.advantage[i] == estimate.advantage[j]
