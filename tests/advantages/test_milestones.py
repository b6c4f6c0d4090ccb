"""Milestones (docs/concepts/math.md#milestones): the segment partition and the milestone return
against loops written from that page, on batches in any row order; plans matched as BEACON matches
them; the axes composing with the others; and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import StepBatch, compute_advantages, estimate_advantages, resolve_settings

from .strategies import step_lists, to_batch


def by_trajectory(steps):
    out: dict = {}
    for i, s in enumerate(steps):
        out.setdefault(s["traj"], []).append(i)
    return {k: sorted(v, key=lambda i: steps[i]["t"]) for k, v in out.items()}


def loop_segments_and_returns(steps, gamma):
    """seg(t) = flags before t; R_t = 10 γ^(next flag at or after t − t), 0 after the last flag."""
    seg, ret = [0] * len(steps), [0.0] * len(steps)
    for rows in by_trajectory(steps).values():
        for pos, i in enumerate(rows):
            seg[i] = sum(steps[j]["milestone"] for j in rows[:pos])
            ahead = [k for k in range(pos, len(rows)) if steps[rows[k]]["milestone"]]
            ret[i] = 10.0 * gamma ** (ahead[0] - pos) if ahead else 0.0
    return seg, ret


@settings(max_examples=100, deadline=None)
@given(steps=step_lists(max_len=8), gamma=st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]), penalty=st.sampled_from([0.0, 0.1]))
def test_segments_and_returns_match_a_loop_in_any_row_order(steps, gamma, penalty):
    est = estimate_advantages(to_batch(steps), resolve_settings("beacon", step_gamma=gamma, invalid_action_penalty=penalty))
    seg, ret = loop_segments_and_returns(steps, gamma)
    expected = [r - penalty * (not s["valid"]) for r, s in zip(ret, steps)]
    torch.testing.assert_close(est.step_return, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    cells = est.cell.tolist()
    for i in range(len(steps)):
        for j in range(len(steps)):
            same = steps[i]["group"] == steps[j]["group"] and seg[i] == seg[j]
            assert (cells[i] == cells[j]) == same


@settings(max_examples=100, deadline=None)
@given(
    plan=st.lists(st.sampled_from(["go to a", "take b", "go to c", "put b"]), max_size=4),
    actions=st.lists(st.sampled_from(["go to a", "go to b", "take b", "take c", "go to c", "put b", "look"]), min_size=1,
                     max_size=8),
    threshold=st.sampled_from([0.6, 0.8, 0.95, 1.0]),
)  # fmt: skip
def test_a_plan_is_matched_in_order_from_the_next_milestone(plan, actions, threshold):
    """Walking the actions, each one matches the next unmatched milestone or nothing (a loop with
    difflib, as BEACON's `match_milestones`); the flags drive the same segments and returns."""
    from difflib import SequenceMatcher

    k, flags = 0, []
    for action in actions:
        hit = k < len(plan) and SequenceMatcher(None, action, plan[k]).ratio() >= threshold
        flags.append(hit)
        k += hit
    rows = dict(group=[0] * len(actions), traj=[0] * len(actions), t=list(range(len(actions))), reward=[0.0] * len(actions))
    with_plan = StepBatch(**rows, action_text=actions, milestone_plan=[plan] * len(actions))
    with_flags = StepBatch(**rows, milestone=flags)
    est = resolve_settings("beacon", milestone_threshold=threshold)
    a, b = estimate_advantages(with_plan, est), estimate_advantages(with_flags, est)
    assert torch.equal(a.step_return, b.step_return) and torch.equal(a.cell, b.cell)


def test_a_trajectory_without_a_plan_keeps_the_envs_flags():
    rows = dict(group=[0, 0, 0, 0], traj=[0, 0, 1, 1], t=[0, 1, 0, 1], reward=[0.0] * 4)
    batch = StepBatch(
        **rows, milestone=[False, False, False, True], action_text=["x", "y", "x", "y"], milestone_plan=[("y",), ("y",), None, None]
    )
    returns = estimate_advantages(batch, resolve_settings("beacon")).step_return
    assert returns.tolist() == [9.5, 10.0, 9.5, 10.0]  # trajectory 0 from its plan, 1 from its flag
    assert batch.milestone.tolist() == [False, False, False, True]  # the caller's batch is left as it was


@settings(max_examples=40, deadline=None)
@given(steps=step_lists(), baseline=st.sampled_from(["mean", "pace_q", "pace_diff", "hierarchy"]))
def test_the_milestone_return_composes_with_state_cells_and_other_baselines(steps, baseline):
    """The axes are independent: GiGPO's anchor cells over BEACON's return, with any one-level baseline or
    HGPO's levels; the returns are the milestone returns whatever the cells."""
    batch = to_batch(steps)
    composed = estimate_advantages(
        batch, resolve_settings("gigpo", step_return="milestone", step_baseline=baseline, context_levels=1)
    )
    beacon = estimate_advantages(batch, resolve_settings("beacon", invalid_action_penalty=0.1))
    assert torch.isfinite(composed.advantage).all()
    torch.testing.assert_close(composed.step_return, beacon.step_return, atol=0, rtol=0)


def test_the_segment_cells_take_discounted_returns_too():
    batch = StepBatch(group=[0] * 4, traj=[0, 0, 1, 1], t=[0, 1, 0, 1], reward=[0.0, 1.0, 0.0, 0.0], milestone=[True] * 4)
    est = estimate_advantages(batch, resolve_settings("beacon", step_return="discounted", w_ep=0.0))
    assert est.step_return.tolist() == pytest.approx([0.95, 1.0, 0.0, 0.0])
    assert est.advantage.tolist() == pytest.approx([0.475, 0.5, -0.475, -0.5])  # segment 0 = t 0, segment 1 = t 1


def test_missing_milestones_and_impossible_settings_are_refused_in_one_line():
    batch = StepBatch(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"step_partition='segment' needs StepBatch.milestone"):
        compute_advantages(batch, resolve_settings("beacon"))
    with pytest.raises(ValueError, match=r"step_return='milestone' needs StepBatch.milestone"):
        compute_advantages(StepBatch(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[1.0, 0.0], anchor=["a", "a"]),
                           resolve_settings("gigpo", step_return="milestone"))  # fmt: skip
    with pytest.raises(ValueError, match=r"step_return='milestone' cannot be 'milestone' with step_baseline='gae'"):
        resolve_settings("beacon", step_baseline="gae")
    with pytest.raises(ValueError, match=r"bootstrap_truncated=True applies to step_return='discounted' only"):
        resolve_settings("beacon", bootstrap_truncated=True)
    with pytest.raises(ValueError, match=r"milestone_threshold=1.5 must lie in \(0, 1\]"):
        resolve_settings("beacon", milestone_threshold=1.5)
    with pytest.raises(ValueError, match=r"milestone_plan needs StepBatch.action_text"):
        StepBatch(group=[0], traj=[0], t=[0], reward=[0.0], milestone_plan=[("a",)])
    with pytest.raises(ValueError, match=r"StepBatch.milestone must have shape"):
        StepBatch(group=[0], traj=[0], t=[0], reward=[0.0], milestone=[True, False])


def test_settings_say_what_the_rollout_must_record():
    assert resolve_settings("beacon").rollout_needs == {"milestone"}
    assert resolve_settings("gigpo", step_return="milestone").rollout_needs == {"anchor", "milestone"}
    assert resolve_settings("beacon", w_step=0.0).rollout_needs == frozenset()  # no step term: nothing to record
    assert not resolve_settings("bipace_q").uses_milestones


def test_the_diagnostics_count_the_milestones_reached():
    batch = StepBatch(group=[0] * 5, traj=[0, 0, 0, 1, 1], t=[0, 1, 2, 0, 1], reward=[0.0] * 5,
                      milestone=[True, False, True, False, False])  # fmt: skip
    diagnostics = compute_advantages(batch, resolve_settings("beacon"))[1]
    assert diagnostics["milestone/per_episode"] == 1.0 and diagnostics["milestone/step_frac"] == 0.4
    assert "milestone/per_episode" not in compute_advantages(batch, resolve_settings("grpo"))[1]
