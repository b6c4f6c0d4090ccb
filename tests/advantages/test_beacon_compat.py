"""`beacon` reproduces BEACON's `compute_migpo_advantage` and its step rewards (`migpo/core_migpo.py`) to 1e-5.

The reference is transcribed in `beacon_reference.py` (ZJU-REAL/BEACON, commit db9347f). The
compatibility setting is the `beacon` preset with `episode_stats="steps"` (GiGPO's row-wise episode
term, which BEACON's `episode_norm_reward` is). A static plan reaches the estimator as
`StepBatch.milestone_plan` + `action_text` (the reference: the trial's list in its loader), flags as
`StepBatch.milestone` (the reference: `milestone_achieved`). Hand-made batches isolate each rule;
the property tests draw batches with plans matched fully, partly or not at all, empty plans, trials
without a plan, near-matches around the threshold, singleton segments and dynamic flags, over both
modes, the scripts' γ and weights, and thresholds 0.85, 0.95 and 1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import StepBatch, compute_advantages, estimate_advantages, resolve_settings
from bipace_trainer.advantages.milestones import match_milestones

from .beacon_reference import beacon_advantages, match_milestones as reference_match

MODES = {"mean_std": "mean_std_norm", "mean": "mean_norm"}
SUCCESS = 10.0  # verl-agent's envs pay 10 for a success; BEACON's 10 · γ^d is on that scale


def both(rows, *, plans=None, norm="mean", gamma=0.95, weight=1.0, threshold=0.95, penalty=0.1, dtype=torch.float64,
         exact_mean=True):  # fmt: skip
    """(ours, reference) for rows (group, traj, t, reward, valid, action, trial, flag) in trajectory
    order; `plans` ({trial: milestone list}) selects the static path, None the dynamic one (the flags)."""
    group, traj, t, reward, valid, action, trial, flag = (list(col) for col in zip(*rows))
    static = plans is not None
    batch = StepBatch(
        group=group, traj=traj, t=t, reward=reward, valid=valid, action_text=action,
        milestone=None if static else flag, milestone_plan=[plans.get(k) for k in trial] if static else None,
    )  # fmt: skip
    est = resolve_settings(
        "beacon", episode_stats="steps", advantage_norm=norm, step_gamma=gamma, w_step=weight,
        milestone_threshold=threshold, invalid_action_penalty=penalty,
    )  # fmt: skip
    ours = compute_advantages(batch, est)[0]
    ref = beacon_advantages(
        group, traj, reward, valid, action, trial_id=trial if static else None, loader=plans,
        milestone_achieved=None if static else flag, gamma=gamma, threshold=threshold, penalty_coef=penalty,
        mode=MODES[norm], step_advantage_w=weight, exact_mean=exact_mean, dtype=dtype,
    )  # fmt: skip
    return ours, ref.to(torch.float32)


def rows_of(trajectories, group=0, first_traj=0, trial="trial"):
    """Rows from [(actions, won), ...]: one action per step (a '!' suffix marks it invalid, a '*'
    suffix flags a milestone for the dynamic path), the success reward on a won trajectory's last step."""
    rows = []
    for j, (actions, won) in enumerate(trajectories):
        for t, raw in enumerate(actions):
            flag, invalid = raw.endswith("*"), raw.rstrip("*").endswith("!")
            action = raw.rstrip("*").rstrip("!")
            reward = SUCCESS if won and t == len(actions) - 1 else 0.0
            rows.append((group, first_traj + j, t, reward, not invalid, action, trial, flag))
    return rows


PLAN = {"trial": ["go to fridge 1", "take apple 1 from fridge 1", "go to table 1", "move apple 1 to table 1"]}
GO, TAKE, TABLE, MOVE = PLAN["trial"]
STATIC = {
    # every milestone matched in order: four segments, each closed by its key action
    "all_matched": (rows_of([([GO, TAKE, TABLE, MOVE], True), (["look", GO, "look", TAKE, TABLE, MOVE], True)]), PLAN),
    # a milestone never matched: the rest of the trajectory is one segment of reward 0
    "partly_matched": (rows_of([([GO, TAKE, "look", "look"], False), ([GO, TAKE, TABLE, MOVE], True)]), PLAN),
    # only in order: TABLE before TAKE does not count, TAKE later does
    "in_order_only": (rows_of([([GO, TABLE, TAKE, "look"], False), ([TAKE, GO, TAKE], False)]), PLAN),
    # nothing matched: every step in segment 0 with reward 0
    "unmatched": (rows_of([(["look", "inventory"], False), (["look"], False)]), PLAN),
    # steps after the last milestone: a segment of their own (the code's -1), reward 0
    "after_the_last_milestone": (rows_of([([GO, TAKE, TABLE, MOVE, "look", "look"], True), ([GO, "look"], False)]), PLAN),
    # a near-spelling: ratio 0.97 with "take apple 1 from fridge 1", so it matches at 0.95
    "near_spelling": (rows_of([([GO, "take apple 1 from fridge 2", TABLE], False), ([GO, TAKE], False)]), PLAN),
    # an empty plan and a trial the loader does not know: no milestone, step rewards 0
    "empty_plan": (rows_of([([GO, TAKE], True), (["look"], False)]), {"trial": []}),
    "unknown_trial": (rows_of([([GO, TAKE], True), (["look"], False)], trial="other"), PLAN),
    # a segment one trajectory alone reaches is a singleton: its step advantage is 0
    "singleton_segment": (rows_of([([GO, TAKE, TABLE, MOVE], True), (["look", "look"], False), ([GO], False)]), PLAN),
    # invalid actions lose the penalty after the segment reward, and never match
    "invalid_actions": (rows_of([([GO + "!", GO, TAKE + "!", "look!"], False), ([GO, TAKE, TABLE], False)]), PLAN),
    # task groups never share a segment group
    "groups_apart": (rows_of([([GO, TAKE], True)]) + rows_of([([GO, "look"], False)], group=1, first_traj=5), PLAN),
}
DYNAMIC = {
    # flags at any step, consecutive ones, on the first and on the last step
    "flags": rows_of([(["a*", "b", "c*", "d*"], True), (["a", "b*", "c"], False), (["a*"], False)]),
    # no flag at all: one segment, step rewards 0
    "no_flags": rows_of([(["a", "b"], True), (["a", "c", "d"], False)]),
    # steps after the last flag: reward 0, in the segment after it
    "after_the_last_flag": rows_of([(["a*", "b", "c"], False), (["a", "b*", "c", "d"], True)]),
    "invalid_flagged": rows_of([(["a!*", "b!", "c*"], True), (["a*", "b"], False)]),
}


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
@pytest.mark.parametrize("case", sorted(STATIC))
def test_static_plan_matches_reference(case, norm):
    rows, plans = STATIC[case]
    for gamma, weight in ((0.9, 10.0), (0.95, 1.0)):  # run_alfworld.sh; run_webshop.sh and run_sciworld.sh
        ours, ref = both(rows, plans=plans, norm=norm, gamma=gamma, weight=weight)
        torch.testing.assert_close(ours, ref, atol=1e-5 * weight, rtol=0)
        _, ref32 = both(rows, plans=plans, norm=norm, gamma=gamma, weight=weight, dtype=torch.float32)
        torch.testing.assert_close(ours, ref32, atol=2e-4 * weight, rtol=1e-4)


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
@pytest.mark.parametrize("case", sorted(DYNAMIC))
def test_dynamic_flags_match_reference(case, norm):
    for gamma, weight in ((0.9, 10.0), (0.95, 1.0)):
        ours, ref = both(DYNAMIC[case], norm=norm, gamma=gamma, weight=weight)
        torch.testing.assert_close(ours, ref, atol=1e-5 * weight, rtol=0)
        _, ref32 = both(DYNAMIC[case], norm=norm, gamma=gamma, weight=weight, dtype=torch.float32)
        torch.testing.assert_close(ours, ref32, atol=2e-4 * weight, rtol=1e-4)


def test_segment_rewards_and_cells_have_the_values_the_rules_give():
    """Hand-computed: 10 · γ^(steps to the segment's milestone), 0 after the last; cells = milestones before."""
    rows, plans = STATIC["partly_matched"]  # GO TAKE look look (no TABLE), GO TAKE TABLE MOVE
    group, traj, t, reward, valid, action, trial, _ = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, action_text=action,
                      milestone_plan=[plans[k] for k in trial])  # fmt: skip
    est = estimate_advantages(batch, resolve_settings("beacon", invalid_action_penalty=0.0))
    assert est.step_return.tolist() == [10.0, 10.0, 0.0, 0.0, 10.0, 10.0, 10.0, 10.0]
    # segments: 0, 1, 2, 2 and 0, 1, 2, 3 -> cells {0: 2 steps, 1: 2, 2: 3, 3: 1}
    cells = est.cell.tolist()
    assert cells[0] == cells[4] and cells[1] == cells[5] and cells[2] == cells[3] == cells[6] and cells[7] not in cells[:7]
    rows = rows_of([(["look", "look", GO, "look", TAKE], False)])
    group, traj, t, reward, valid, action, trial, _ = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, action_text=action,
                      milestone_plan=[PLAN["trial"]] * len(rows))  # fmt: skip
    returns = estimate_advantages(batch, resolve_settings("beacon", step_gamma=0.9)).step_return
    assert returns.tolist() == pytest.approx([8.1, 9.0, 10.0, 9.0, 10.0], rel=1e-12)


def test_matching_is_the_references_rule():
    actions = [GO, "take apple 1 from fridge 2", TABLE, "move apple 1 to table 1.", GO]
    for threshold in (0.5, 0.85, 0.95, 0.97, 1.0):
        flags = match_milestones(actions, PLAN["trial"], threshold)
        matched = [i for i, m in enumerate(reference_match(actions, PLAN["trial"], threshold)) if m >= 0]
        assert [t for t, f in enumerate(flags) if f] == [reference_match(actions, PLAN["trial"], threshold)[k] for k in range(len(matched))]
    assert match_milestones(actions, PLAN["trial"], 0.95) == [True, True, True, True, False]
    assert match_milestones(actions, PLAN["trial"], 1.0) == [True, False, False, False, False]


VOCAB = ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to table 1", "move apple 1 to table 1",
         "heat apple 1 with microwave 1"]  # fmt: skip
# spellings near a VOCAB entry: ratio 0.93-0.98 with it (so the threshold decides), < 0.8 with the others
NEAR = {0: "go to fridge 2", 2: "take apple 1 from fridge 2", 4: "move apple 2 to table 1", 5: "heat apple 1 with microwave 2"}


@st.composite
def beacon_batches(draw, static: bool):
    """Rows in trajectory order (trajectories of a group interleaved at random, each in t order), and
    the plans: per group a plan of 0-4 VOCAB actions, or a trial the loader does not know; actions
    drawn from the plan, its near-spellings and others; flags at random (dynamic)."""
    rows, plans, traj_id = [], {}, 0
    for g in range(draw(st.integers(1, 3))):
        trial = f"trial{g}"
        if draw(st.integers(0, 5)):  # one group in six: a trial without a plan
            plans[trial] = [VOCAB[i] for i in draw(st.lists(st.integers(0, len(VOCAB) - 1), max_size=4))]
        trajectories = []
        for _ in range(draw(st.integers(1, 6))):
            steps = []
            for t in range(draw(st.integers(1, 8))):
                k = draw(st.integers(0, len(VOCAB) - 1))
                action = NEAR.get(k, VOCAB[k]) if draw(st.integers(0, 3)) == 0 else VOCAB[k]
                steps.append([action, draw(st.sampled_from([True, True, True, False])), draw(st.booleans())])
            won = draw(st.booleans())
            trajectories.append([(g, traj_id, t, SUCCESS if won and t == len(steps) - 1 else 0.0, valid, action, trial, flag)
                                 for t, (action, valid, flag) in enumerate(steps)])  # fmt: skip
            traj_id += 1
        while any(trajectories):  # interleave: the reference reads each trajectory's rows in batch order
            pick = draw(st.sampled_from([j for j, rest in enumerate(trajectories) if rest]))
            rows.append(trajectories[pick].pop(0))
    return rows, (plans if static else None)


SETTINGS = dict(
    norm=st.sampled_from(["mean", "mean_std"]),
    script=st.sampled_from([(0.9, 10.0), (0.95, 1.0)]),
    threshold=st.sampled_from([0.85, 0.95, 1.0]),
    penalty=st.sampled_from([0.0, 0.1, 1.0]),
)


@settings(max_examples=150, deadline=None)
@given(batch=st.booleans().flatmap(beacon_batches), **SETTINGS)
def test_matches_reference_on_any_batch(batch, norm, script, threshold, penalty):
    """1e-5 against the reference's algorithm (float64, exact means of equal rewards); against its
    float32 arithmetic within that arithmetic's rounding (10 · γ^d in float32, ÷ a std)."""
    rows, plans = batch
    (gamma, weight) = script
    kwargs = dict(plans=plans, norm=norm, gamma=gamma, weight=weight, threshold=threshold, penalty=penalty)
    ours, ref = both(rows, **kwargs)
    torch.testing.assert_close(ours, ref, atol=1e-5 * weight, rtol=1e-5)
    _, ref32 = both(rows, dtype=torch.float32, **kwargs)
    torch.testing.assert_close(ours, ref32, atol=2e-4 * weight, rtol=1e-4)


@settings(max_examples=100, deadline=None)
@given(batch=st.booleans().flatmap(beacon_batches), script=SETTINGS["script"], penalty=SETTINGS["penalty"])
def test_the_only_differences_are_float32_means_of_equal_rewards(batch, script, penalty):
    """Against the code's own float32 `torch.mean` under mean_std_norm: every row that differs by more
    than that rounding lies in a segment group whose step rewards are all equal, where this library's
    step advantage is exactly 0 and the code's is the rounding residue ÷ (std + 1e-6)."""
    rows, plans = batch
    gamma, weight = script
    kwargs = dict(plans=plans, norm="mean_std", gamma=gamma, weight=weight, penalty=penalty)
    ours, code = both(rows, dtype=torch.float32, exact_mean=False, **kwargs)
    group, traj, t, reward, valid, action, trial, flag = (list(col) for col in zip(*rows))
    batch_ = StepBatch(
        group=group, traj=traj, t=t, reward=reward, valid=valid, action_text=action,
        milestone=None if plans is not None else flag, milestone_plan=[plans.get(k) for k in trial] if plans is not None else None,
    )  # fmt: skip
    est = estimate_advantages(batch_, resolve_settings("beacon", step_gamma=gamma, invalid_action_penalty=penalty))
    cell_returns: dict = {}
    for i, cell in enumerate(est.cell.tolist()):
        cell_returns.setdefault(cell, []).append(float(est.step_return[i]))
    for i in torch.nonzero((ours - code).abs() > 2e-4 * weight).flatten().tolist():
        values = cell_returns[int(est.cell[i])]
        assert len(values) > 1 and max(values) == min(values), (i, values)


def test_the_codes_float32_mean_turns_equal_rewards_into_noise():
    """Eight trajectories reach the plan's one milestone at t = 0, then send an invalid action: that
    step, after the last milestone, has step reward 0 − 0.1 in all eight (float32 -0.1). Under
    mean_std_norm the code's float32 mean of the eight is a rounding step off (-0.10000000894) and
    ÷ (σ + 1e-6), σ that same residue, makes it a step advantage; this library gives 0."""
    rows = rows_of([([GO, "look!"], False)] * 7 + [([GO, "look!"], True)])
    plan = {"trial": [GO]}
    ours, code = both(rows, plans=plan, norm="mean_std", gamma=0.9, weight=10.0, dtype=torch.float32, exact_mean=False)
    _, intended = both(rows, plans=plan, norm="mean_std", gamma=0.9, weight=10.0, dtype=torch.float32)
    episode_only = both(rows, plans=plan, norm="mean_std", gamma=0.9, weight=0.0)[0]
    assert torch.equal(ours, episode_only)  # every segment group holds equal rewards: the step term is 0
    torch.testing.assert_close(ours, intended, atol=1e-6, rtol=0)
    assert (ours - code).abs()[1::2].min() > 1e-3  # the code's noise, on every invalid step
