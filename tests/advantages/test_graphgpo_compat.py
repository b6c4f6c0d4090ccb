"""`graphgpo` reproduces verl-agent's GraphGPO (`recipe/GraphGPO/core_graph.py`): its algorithm (float64,
means of equal values exact) to 1e-5, its float32 arithmetic to 2e-4 but on cells of equal returns
(docs/results/fidelity.md); also on batches the rollout itself played, the env's replay as the reference's input.

The reference is transcribed in `graphgpo_reference.py` (upstream commit 234a913). The
compatibility setting is the `graphgpo` preset with `episode_stats="steps"` (GiGPO's episode
normalisation over step rows, as for `gigpo`) and `StepBatch.next_anchor` holding what the
reference's rollout records as next_obs. Hand-made batches isolate the code's rules; the
property test draws batches with revisits, invalid actions (the state stays), several
successes and failures per group, groups without a success, over both modes,
`normalize_distance` and the similarity merge on and off.

Where the code's float32 mean of a step group of equal returns is a rounding step off, the
package gives the exact 0; `test_the_only_differences_are_float32_means_of_equal_returns`
shows that those rows, and only those, differ from the code's arithmetic.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import StepBatch, compute_advantages, estimate_advantages, resolve_settings

from .graphgpo_reference import graphgpo_advantages, replayed_rows

MODES = {"mean_std": "mean_std_norm", "mean": "mean_norm"}


def rows_of(trajectories, group=0, first_traj=0, success_reward=10.0):
    """Rows (group, traj, t, reward, valid, anchor, next_obs) from [(states, won, final), ...]:
    `states` one anchor per step (a list, or a string of one-letter anchors; a '!' after a
    letter marks the step invalid), the success reward on the last step of a won trajectory,
    next_obs the next anchor, then 'success' or `final` (the env's last observation)."""
    rows = []
    for j, (states, won, final) in enumerate(trajectories):
        steps = _parse(states)
        for t, (anchor, valid) in enumerate(steps):
            last = t == len(steps) - 1
            nxt = ("success" if won else final) if last else steps[t + 1][0]
            reward = success_reward if (won and last) else 0.0
            rows.append((group, first_traj + j, t, reward, valid, anchor, nxt))
    return rows


def _parse(states):
    if not isinstance(states, str):
        return [(s, True) for s in states]
    out = []
    for ch in states:
        if ch == "!":
            out[-1] = (out[-1][0], False)
        else:
            out.append((ch, True))
    return out


def both(
    rows, *, norm="mean_std", gamma=0.1, penalty=0.1, normalize_distance=False, merge=False, threshold=0.95,
    w_ep=1.0, exact_mean=True, next_anchor=True, dtype=torch.float64,
):  # fmt: skip
    """(ours, reference) advantages for rows in trajectory order; the reference in float64 (its
    algorithm) unless `dtype` is float32 (its arithmetic too)."""
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(
        group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt if next_anchor else None
    )
    est = resolve_settings(
        "graphgpo", episode_stats="steps", advantage_norm=norm, step_gamma=gamma, invalid_action_penalty=penalty, w_ep=w_ep,
        normalize_distance=normalize_distance, similarity_merge=merge, similarity_threshold=threshold,
    )  # fmt: skip
    ours = compute_advantages(batch, est)[0]
    ref = graphgpo_advantages(
        group, traj, reward, valid, anchor, nxt, gamma=gamma, penalty_coef=penalty, mode=MODES[norm], w_ep=w_ep,
        normalize_distance=normalize_distance, enable_similarity=merge, similarity_thresh=threshold,
        exact_mean=exact_mean, dtype=dtype,
    )  # fmt: skip
    return ours, ref.to(torch.float32)


QUIRKS = {
    # Two successes of different lengths and a failure through the same states: d(c) = 1 from
    # the short success, so the long one's detour is scored by the graph, not by its own time.
    "shortest_path_across_trajectories": rows_of([("abc", True, None), ("abdbc", True, None), ("abd", False, "z")]),
    # Revisits: a trajectory loops a -> b -> a; the loop's edges enter the graph.
    "revisits_and_loops": rows_of([("abab", False, "q"), ("abc", True, None), ("ac", True, None)]),
    # No success in the group: only the goal has a finite d (0), far = 0, every state gets 1.
    "no_success_far_plus_one": rows_of([("abc", False, "x"), ("abd", False, "y")]),
    # Invalid actions leave the state as it was (a self-loop) and lose 0.1 after the return.
    "invalid_actions_self_loop": rows_of([("aa!b", True, None), ("ab!b", False, "k"), ("ab", True, None)]),
    # The failed last step's final observation is a state seen elsewhere: it takes that d.
    "final_observation_is_a_known_state": rows_of([("ab", False, "c"), ("abc", True, None), ("ad", False, "q")]),
    # Unreachable states of a group with successes: far + 1, far the group's largest finite d.
    "unreachable_far_plus_one": rows_of([("abcd", True, None), ("xyz", False, "w"), ("ay", False, "w")]),
    # Graphs never cross task groups.
    "groups_apart": rows_of([("ab", True, None), ("ac", False, "q")])
    + rows_of([("ab", False, "q"), ("ac", True, None)], group=1, first_traj=10),
    # Every trajectory succeeds through the same states: equal returns in every step group.
    "all_equal_returns": rows_of([("abc", True, None)] * 4),
}


@pytest.mark.parametrize("normalize_distance", [False, True])
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("case", sorted(QUIRKS))
def test_quirk_matches_reference(case, norm, normalize_distance):
    ours, ref = both(QUIRKS[case], norm=norm, normalize_distance=normalize_distance)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    _, ref32 = both(QUIRKS[case], norm=norm, normalize_distance=normalize_distance, dtype=torch.float32)
    torch.testing.assert_close(ours, ref32, atol=1e-5, rtol=0)


def test_graph_returns_have_the_values_the_rules_give():
    """Exact step returns 10 γ^d on hand-computed distances (γ = 0.1, before the penalty)."""
    rows = QUIRKS["shortest_path_across_trajectories"]  # abc won, abdbc won, abd failed -> z
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt)
    est = estimate_advantages(batch, resolve_settings("graphgpo"))
    # d: goal 0, c 1, b 2, a 3, d 3 (d -> b), z unreachable: far (3) + 1 = 4
    d_next = [2, 1, 0, 2, 3, 2, 1, 0, 2, 3, 4]
    assert est.step_return.tolist() == pytest.approx([10 * 0.1**d for d in d_next], rel=1e-12)
    # normalize_distance: 10 γ^{d(next) - d(state) + 1}: 10 on an edge that closes one step, 0.01 on b -> d
    closed = estimate_advantages(batch, resolve_settings("graphgpo", normalize_distance=True)).step_return
    d_state = [3, 2, 1, 3, 2, 3, 2, 1, 3, 2, 3]
    assert closed.tolist() == pytest.approx([10 * 0.1 ** (n - s + 1) for n, s in zip(d_next, d_state)], rel=1e-12)


def test_no_success_gives_every_step_the_same_return():
    rows = QUIRKS["no_success_far_plus_one"]
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt)
    est = estimate_advantages(batch, resolve_settings("graphgpo"))
    assert est.step_return.tolist() == [1.0] * len(rows)  # 10 · 0.1^1
    assert est.diagnostics["graph/no_goal_frac"] == 1.0 and est.diagnostics["graph/reachable_frac"] == 0.0


def test_without_next_anchor_a_fresh_final_observation_is_a_dead_end():
    """When the failed trajectories' final observations are new (as they mostly are), the
    default rule (no `next_anchor`: a dead end of its own) is the reference's answer."""
    for case in ("shortest_path_across_trajectories", "no_success_far_plus_one", "unreachable_far_plus_one"):
        for norm in ("mean_std", "mean"):
            ours, ref = both(QUIRKS[case], norm=norm, next_anchor=False)
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # a final observation seen elsewhere is where the two differ: the reference gives it d(c)
    ours, ref = both(QUIRKS["final_observation_is_a_known_state"], next_anchor=False)
    assert not torch.allclose(ours, ref, atol=1e-3)


SIMILAR = [
    ("You are in the kitchen. You see a red apple on the table.", "You are in the kitchen. You see a red apple on the tabel."),
    ("You pick up the apple from the table.", "You pick up the apple from the table!"),
    ("The fridge is open. In it you see a milk carton.", "The fridge is open. In it you see a milk cartons."),
]


def test_similarity_merge_joins_nearly_equal_observations_like_the_reference():
    """Trajectory 1 sees the typo'd variants: merged, its states lie on trajectory 0's path."""
    (a, a2), (b, b2), (c, c2) = SIMILAR
    rows = rows_of([([a, b, c], True, None), ([a2, b2, c2], False, "You are lost."), ([a, c2], False, "Nothing.")])
    for merge in (False, True):
        for norm in ("mean_std", "mean"):
            for normalize_distance in (False, True):
                ours, ref = both(rows, norm=norm, merge=merge, normalize_distance=normalize_distance)
                torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt)
    merged = estimate_advantages(batch, resolve_settings("graphgpo", similarity_merge=True))
    exact = estimate_advantages(batch, resolve_settings("graphgpo"))
    assert merged.step_return[3:5].tolist() == pytest.approx([0.1, 1.0])  # b2 ~ b (d 2), c2 ~ c (d 1)
    assert exact.step_return[3:5].tolist() == pytest.approx([10 * 0.1**4] * 2)  # unreachable: far (3) + 1
    # the baseline's cells stay the exact anchors: a2 is alone there, so its A^s is 0 either way
    assert merged.cell.unique().numel() == exact.cell.unique().numel()


# Observation texts in two spellings each (difflib ratio >= 0.95 between them, < 0.9 across).
TEXTS = [
    ("You are in the kitchen. On the counter you see a knife and a bowl.", "You are in the kitchen. On the counter you see a knife and a bowl!"),
    ("You open the fridge. The fridge contains an egg and a tomato.", "You open the fridge. The fridge contains an egg and a tomatoes."),
    ("You arrive at the sink basin. Nothing is on the sink basin.", "You arrive at the sink basin. Nothing is on the sinkbasin."),
    ("You pick up the mug from the shelf, it is heavy and dirty.", "You pick up the mug from the shelf, it is heavy and dirty.."),
    ("The drawer is closed. You see a lamp standing next to the desk.", "The drawer is closed. You see a lamp standing next to the desk"),
]


@st.composite
def graph_batches(draw):
    """Rows in trajectory order over a few states per group, with revisits, invalid steps
    (the state stays), several won and failed trajectories, groups with no success, and
    failed trajectories whose final observation is new or a known state; states are short
    names, or long texts in two near-equal spellings (for the similarity merge)."""
    rows, traj_id = [], 0
    texts = draw(st.booleans())

    def name(state):
        return TEXTS[state][draw(st.integers(0, 1))] if texts else f"s{state}"

    for g in range(draw(st.integers(1, 3))):
        num_states = draw(st.integers(2, 5))
        for _ in range(draw(st.integers(1, 6))):
            length = draw(st.integers(1, 6))
            won = draw(st.booleans())
            state = draw(st.integers(0, num_states - 1))
            steps = []
            for _ in range(length):
                valid = draw(st.sampled_from([True, True, True, False]))
                label = name(state) if not steps or steps[-1][1] else steps[-1][0]  # invalid: the same text
                steps.append((label, valid))
                state = state if not valid else draw(st.integers(0, num_states - 1))
            final = name(state) if draw(st.booleans()) else f"end{traj_id}"
            for t, (anchor, valid) in enumerate(steps):
                last = t == length - 1
                nxt = ("success" if won else final) if last else steps[t + 1][0]
                rows.append((g, traj_id, t, 10.0 if won and last else 0.0, valid, anchor, nxt))
            traj_id += 1
    return rows


@settings(max_examples=200, deadline=None)
@given(
    rows=graph_batches(),
    norm=st.sampled_from(["mean_std", "mean"]),
    gamma=st.sampled_from([0.1, 0.2, 0.5, 0.95]),
    penalty=st.sampled_from([0.0, 0.1]),
    normalize_distance=st.booleans(),
    w_ep=st.sampled_from([1.0, 0.0]),
    merge=st.booleans(),
)
def test_matches_reference_on_any_batch(rows, norm, gamma, penalty, normalize_distance, w_ep, merge):
    """1e-5 against the reference's algorithm (float64, exact means of equal returns); against
    its float32 arithmetic the gap is the code's own rounding (9.9 in float32, then ÷ a std of
    0.05), as for GiGPO."""
    kwargs = dict(norm=norm, gamma=gamma, penalty=penalty, normalize_distance=normalize_distance, w_ep=w_ep, merge=merge)
    ours, ref = both(rows, **kwargs)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    _, ref32 = both(rows, dtype=torch.float32, **kwargs)
    torch.testing.assert_close(ours, ref32, atol=2e-4, rtol=1e-4)


@settings(max_examples=150, deadline=None)
@given(rows=graph_batches(), norm=st.sampled_from(["mean_std", "mean"]), normalize_distance=st.booleans())
def test_the_only_differences_are_float32_means_of_equal_returns(rows, norm, normalize_distance):
    """Against the code's own float32 `torch.mean`: every row that differs by more than 1e-5
    lies in a step group (task group, anchor) whose returns are all equal, where the package's
    step advantage is exactly 0 and the code's is the rounding residue ÷ (std + 1e-6)."""
    ours, code = both(rows, norm=norm, normalize_distance=normalize_distance, exact_mean=False, dtype=torch.float32)
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt)
    returns = estimate_advantages(batch, resolve_settings("graphgpo", normalize_distance=normalize_distance)).step_return
    cell_returns: dict = {}
    for i, key in enumerate(zip(group, anchor)):
        cell_returns.setdefault(key, []).append(float(returns[i]))
    differ = (ours - code).abs() > 2e-4  # beyond float32's rounding of unequal returns (above)
    for i in torch.nonzero(differ).flatten().tolist():
        values = cell_returns[(group[i], anchor[i])]
        assert len(values) > 1 and max(values) == min(values), (i, values)


def test_the_codes_float32_mean_turns_equal_returns_into_noise():
    """Eight successes a -> b -> c: at "a" every return is 10 · 0.1^2 = 0.1 (float32 0.1). The
    code's float32 mean of eight of them is one rounding step off, and ÷ (σ + 1e-6), σ that
    same residue, makes it a non-zero step advantage for all eight; the package gives 0."""
    rows = rows_of([("abc", True, None)] * 8)
    ours, code = both(rows, exact_mean=False, dtype=torch.float32)
    _, intended = both(rows, exact_mean=True, dtype=torch.float32)
    assert (ours == 0).all() and (intended == 0).all()
    assert (code != 0).any()


# --------------------------------------------------------------------------- on batches the rollout itself built


def random_walk(seed: int):
    """A scripted policy for the tiny env: left, right or a malformed reply, from a seeded stream."""
    import random

    from bipace_trainer.rollout.loop import Generation

    rng = random.Random(seed)

    def generate(messages):
        replies = [rng.choice(["<action>left</action>", "<action>right</action>", "go"]) for _ in messages]
        return Generation([[1]] * len(messages), [[2]] * len(messages), replies)

    return generate


def played_tiny_rollout(seed: int = 0, max_turns: int = 4):
    """Three task groups of four rollouts on the tiny env (a 4-cell line), one group on a task whose
    env raises at its first step (`FaultyTinyEnv` task 2): wins, turn-limit cuts and env faults."""
    from bipace_trainer.rollout.loop import RolloutSettings, TaskRef, run_rollouts
    from envs.vector import VectorEnv

    tasks = [TaskRef(task_id, group) for group, task_id in enumerate([0, 9, 2]) for _ in range(4)]
    with VectorEnv("tests.reliability.faulty_envs:FaultyTinyEnv", len(tasks), {}) as envs:
        return run_rollouts(envs, tasks, random_walk(seed), RolloutSettings(max_turns=max_turns, invalid_action="stay"))


def test_the_rollout_records_every_episodes_end_as_the_env_returned_it():
    from tests.reliability.faulty_envs import FaultyTinyEnv

    rollout = played_tiny_rollout()
    rows = replayed_rows(rollout, FaultyTinyEnv)
    ends = {traj: nxt for _, traj, t, *_, nxt in rows if t == max(r[2] for r in rows if r[1] == traj)}
    kinds = set()
    for episode in rollout.episodes:
        if episode.failed:  # the env raised at the step: no state was reached
            assert episode.final_observation is None and episode.final_anchor is None
            kinds.add("fault")
            continue
        replayed = ends[episode.traj]
        assert episode.final_anchor == (replayed if replayed != "success" else episode.final_anchor)
        kinds.add("won" if episode.won else "truncated" if episode.truncated else "other")
        if episode.won:
            assert episode.final_observation.startswith("You reached the goal!")
    assert {"won", "truncated", "fault"} <= kinds
    # the estimator's input: the next step's anchor, then the episode's end (None after a fault)
    batch_next = rollout.next_anchors()
    by_key = {(s.traj, s.t): s for s in rollout.steps}
    episodes = {e.traj: e for e in rollout.episodes}
    for step, nxt in zip(rollout.steps, batch_next):
        following = by_key.get((step.traj, step.t + 1))
        assert nxt == (following.anchor if following else episodes[step.traj].final_anchor)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("gamma, normalize_distance", [(0.1, False), (0.95, False), (0.5, True)])
def test_the_trainers_input_gives_the_references_advantages_on_a_played_rollout(seed, norm, gamma, normalize_distance):
    """`Rollout.step_batch` → the estimator, as the trainer calls it (env-failed episodes kept, as
    `penalize_env_failures=True` trains them), against the reference fed from a replay of the env."""
    from bipace_trainer.advantages import compute_advantages
    from tests.reliability.faulty_envs import FaultyTinyEnv

    rollout = played_tiny_rollout(seed)
    rows = replayed_rows(rollout, FaultyTinyEnv)
    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    settings = resolve_settings("graphgpo", episode_stats="steps", advantage_norm=norm, step_gamma=gamma,
                                normalize_distance=normalize_distance)  # fmt: skip
    ours = compute_advantages(rollout.step_batch(), settings)[0]
    position = {(s.traj, s.t): i for i, s in enumerate(rollout.steps)}
    ours = ours[[position[key] for key in zip(traj, t)]]  # into the reference's (trajectory, t) order
    ref = graphgpo_advantages(group, traj, reward, valid, anchor, nxt, gamma=gamma, mode=MODES[norm],
                              normalize_distance=normalize_distance, exact_mean=True, dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(ours, ref.to(torch.float32), atol=1e-5, rtol=0)
    # the batches hold what tells the two end rules apart: failed last steps that end in a state
    # some step of their group was taken from
    diagnostics = compute_advantages(rollout.step_batch(), settings)[1]
    assert diagnostics["graph/failed_ends_known"] > 0 and diagnostics["graph/dead_ends"] == 4  # task 2's four faults
    dead_end_rule = dataclasses.replace(rollout.step_batch(), next_anchor=None)
    assert not torch.allclose(compute_advantages(dead_end_rule, settings)[0][[position[k] for k in zip(traj, t)]],
                              ref.to(torch.float32), atol=1e-3)
