"""The graph step return (`step_return="graph"`: graphgpo, bigraphgpo) against a slow search by
hand, its diagnostics, the hidden-state graph, and the settings it refuses."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import (
    SettingsError,
    StepBatch,
    compute_advantages,
    estimate_advantages,
    register_partition,
    resolve_settings,
)
from bipace_trainer.advantages.partition import PARTITIONS, Partition
from bipace_trainer.config import BiPACEConfig

from .strategies import step_lists, to_batch


def slow_graph_returns(group, traj, t, node, reward, gamma, normalize_distance, anchor=None, end=None):
    """Per group, a dict of edges and one forward breadth-first search per node: the obviously
    correct distances, the far + 1 rule, then 10 γ^d per step (lists in any row order). With
    `anchor` (per row) and `end` (per trajectory: the anchor of its final observation, or None),
    a failed trajectory's last step reaches the node of the group's first step, in (trajectory, t)
    order, whose anchor is that end; else (or without them) a dead end of its own."""
    rows = sorted(range(len(group)), key=lambda i: (traj[i], t[i]))
    episode = {}
    for i in rows:
        episode[traj[i]] = episode.get(traj[i], 0.0) + reward[i]
    reached = {}
    for k, i in enumerate(rows):
        last = k == len(rows) - 1 or traj[rows[k + 1]] != traj[i]
        if not last:
            reached[i] = ("state", node[rows[k + 1]])
        elif episode[traj[i]] > 0:
            reached[i] = ("goal",)
        else:
            known = [j for j in rows if end and group[j] == group[i] and anchor[j] == end.get(traj[i])]
            reached[i] = ("state", node[known[0]]) if known else ("dead", traj[i])
    out = [0.0] * len(group)
    for g in set(group):
        mine = [i for i in rows if group[i] == g]
        edges: dict = {}
        for i in mine:
            edges.setdefault(("state", node[i]), set()).add(reached[i])
        nodes = set(edges) | {reached[i] for i in mine}

        def bfs(v):
            seen, queue = {v}, deque([(v, 0)])
            while queue:
                u, d = queue.popleft()
                if u == ("goal",):
                    return d
                for w in edges.get(u, ()):
                    if w not in seen:
                        seen.add(w)
                        queue.append((w, d + 1))
            return None

        dist = {v: bfs(v) for v in nodes}
        far = max([d for d in dist.values() if d is not None] + [0])
        dist = {v: far + 1 if d is None else d for v, d in dist.items()}
        for i in mine:
            exponent = dist[reached[i]] - (dist[("state", node[i])] - 1 if normalize_distance else 0)
            out[i] = 10.0 * gamma**exponent
    return out


@settings(max_examples=150, deadline=None)
@given(
    steps=step_lists(max_groups=3, max_traj=5, max_len=6),
    partition=st.sampled_from(["hash", "hidden"]),
    gamma=st.sampled_from([0.1, 0.2, 0.9]),
    normalize_distance=st.booleans(),
)
def test_graph_return_matches_a_search_by_hand(steps, partition, gamma, normalize_distance):
    """Nodes are the partition's cells (exact anchors, or hidden clusters at ε = 0.1): the
    return of every step, in any row order, is the hand search's, to float64 rounding."""
    batch = to_batch(steps)
    preset = "graphgpo" if partition == "hash" else "bigraphgpo"
    s = resolve_settings(preset, step_gamma=gamma, normalize_distance=normalize_distance, invalid_action_penalty=0.0)
    est = estimate_advantages(batch, s, cluster_eps=0.1)
    slow = slow_graph_returns(
        batch.group.tolist(), batch.traj.tolist(), batch.t.tolist(), est.cell.tolist(), batch.reward.tolist(),
        gamma, normalize_distance,
    )  # fmt: skip
    assert est.step_return.tolist() == pytest.approx(slow, rel=1e-9, abs=1e-300)


@settings(max_examples=150, deadline=None)
@given(
    steps=step_lists(max_groups=3, max_traj=5, max_len=6),
    data=st.data(),
    partition=st.sampled_from(["hash", "hidden"]),
    normalize_distance=st.booleans(),
)
def test_a_recorded_end_takes_the_node_of_the_state_it_names(steps, data, partition, normalize_distance):
    """Every trajectory's final observation (`next_anchor` after its last step) is a state its group
    visited, a new one, or unrecorded (None: an env fault): on the hash graph and on hidden clusters
    (where it joins the cluster of the group's first step with that anchor) the returns are the
    hand search's, and the counts say how the failed trajectories ended."""
    by_traj: dict = {}
    for s in steps:
        by_traj.setdefault(s["traj"], []).append(s)
    end = {traj: data.draw(st.sampled_from([None, f"end-{traj}", *(f"obs-{k}" for k in range(4))])) for traj in by_traj}
    anchor_at = {(s["traj"], s["t"]): s["anchor"] for s in steps}
    batch = dataclasses.replace(
        to_batch(steps), next_anchor=[anchor_at.get((s["traj"], s["t"] + 1), end[s["traj"]]) for s in steps]
    )
    preset = "graphgpo" if partition == "hash" else "bigraphgpo"
    est = estimate_advantages(batch, resolve_settings(preset, step_gamma=0.2, normalize_distance=normalize_distance,
                                                      invalid_action_penalty=0.0), cluster_eps=0.1)  # fmt: skip
    anchors = [s["anchor"] for s in steps]
    slow = slow_graph_returns(
        batch.group.tolist(), batch.traj.tolist(), batch.t.tolist(), est.cell.tolist(), batch.reward.tolist(),
        0.2, normalize_distance, anchors, end,
    )  # fmt: skip
    assert est.step_return.tolist() == pytest.approx(slow, rel=1e-9, abs=1e-300)
    failed = [traj for traj, rows in by_traj.items() if sum(r["reward"] for r in rows) <= 0]
    seen = {(s["group"], s["anchor"]) for s in steps}
    group_of = {traj: rows[0]["group"] for traj, rows in by_traj.items()}
    d = est.diagnostics
    assert d["graph/dead_ends"] == sum(end[traj] is None for traj in failed)
    assert d["graph/failed_ends"] == sum(end[traj] is not None for traj in failed)
    assert d["graph/failed_ends_known"] == sum((group_of[traj], end[traj]) in seen for traj in failed)


def _batch(rows, hidden=None):
    group, traj, t, reward, valid, anchor = (list(c) for c in zip(*rows))
    return StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, hidden=hidden)


def test_bigraphgpo_joins_texts_whose_hidden_states_agree():
    """Two trajectories see "a" and "a'" (different text, the same hidden state): on the hash
    graph "a'" cannot reach the goal; on the hidden graph it is "a", one step from it."""
    rows = [(0, 0, 0, 0.0, True, "a"), (0, 0, 1, 1.0, True, "b"), (0, 1, 0, 0.0, True, "a'"), (0, 1, 1, 0.0, True, "c")]
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    batch = _batch(rows, hidden)
    by_text = estimate_advantages(batch, resolve_settings("graphgpo"))
    by_hidden = estimate_advantages(batch, resolve_settings("bigraphgpo", cluster_eps=0.05))
    # text graph: a -> b -> goal, a' -> c -> dead end; d(b) = 1, d(c) = d(dead) = far + 1 = 3
    assert by_text.step_return.tolist() == pytest.approx([1.0, 10.0, 10 * 0.1**3, 10 * 0.1**3])
    # hidden graph: a' is a, so trajectory 1 shares a's node; c still leads nowhere
    assert by_hidden.cell[0] == by_hidden.cell[2]
    assert by_hidden.graph.distance[by_hidden.graph.node[2]] == 2.0
    assert by_hidden.diagnostics["graph/nodes"] == 5.0  # a, b, c, the goal, trajectory 1's dead end
    assert by_text.diagnostics["graph/nodes"] == 6.0


def test_without_a_recorded_end_the_last_step_of_a_failed_episode_reaches_a_dead_end_of_its_own():
    """No `next_anchor` (a batch built without the env's final observations): its node is the
    trajectory's own dead end (unreachable: far + 1), never a state another trajectory visited."""
    rows = [(0, 0, 0, 0.0, True, "a"), (0, 0, 1, 1.0, True, "b"), (0, 1, 0, 0.0, True, "a"), (0, 2, 0, 0.0, True, "a")]
    est = estimate_advantages(_batch(rows), resolve_settings("graphgpo"))
    dead_1, dead_2 = est.graph.next_node[2], est.graph.next_node[3]
    assert dead_1 != dead_2 and est.graph.distance[dead_1] == 3.0  # far = d(a) = 2
    assert not est.graph.reachable[dead_1]


def test_diagnostics_count_nodes_edges_reach_and_singletons():
    rows = [
        (0, 0, 0, 0.0, True, "a"), (0, 0, 1, 1.0, True, "b"),  # a -> b -> goal
        (0, 1, 0, 0.0, True, "a"), (0, 1, 1, 0.0, True, "c"),  # a -> c -> dead end
        (1, 2, 0, 0.0, True, "x"),  # group 1: no success
    ]  # fmt: skip
    d = estimate_advantages(_batch(rows), resolve_settings("graphgpo")).diagnostics
    # group 0: a, b, c, goal, dead end = 5 nodes, edges a-b, b-goal, a-c, c-dead = 4; group 1: x, dead = 2, 1 edge
    assert d["graph/nodes"] == 3.5 and d["graph/edges"] == 2.5
    assert d["graph/reachable_frac"] == pytest.approx(2 / 5)  # a -> b (d 1), b -> goal (d 0)
    assert d["graph/mean_distance"] == pytest.approx(0.5)
    assert d["graph/singleton_rate"] == pytest.approx(3 / 5)  # b, c, x visited once
    assert d["graph/no_goal_frac"] == 0.5


def test_graph_return_is_linear_in_a_long_chain():
    """A 20,000-step chain (every step a new state, d up to 19,999) is searched level by level
    without a per-node Python loop: its distances are exact."""
    n = 20_000
    batch = StepBatch(group=[0] * n, traj=[0] * n, t=list(range(n)), reward=[0.0] * (n - 1) + [1.0], anchor=list(range(n)))
    est = estimate_advantages(batch, resolve_settings("graphgpo", step_gamma=1.0))
    assert est.graph.distance[est.graph.node].tolist() == [float(n - i) for i in range(n)]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(step_return="graph", step_baseline="gae"), "step_return"),
        (dict(step_return="graph", bootstrap_truncated=True), "bootstrap_truncated"),
        (dict(similarity_merge=True), "similarity_merge"),  # the discounted return
        (dict(step_return="graph", similarity_merge=True, step_partition="hidden"), "similarity_merge"),
        (dict(step_return="graph", similarity_threshold=1.5), "similarity_threshold"),
        (dict(step_return="distance"), "step_return"),
    ],
)
def test_settings_the_graph_return_does_not_have_fail_naming_the_field(overrides, field):
    with pytest.raises(SettingsError) as err:
        resolve_settings("gigpo", **overrides)
    assert err.value.field == field and field in str(err.value)


def test_graph_needs_a_partition_with_cells():
    with pytest.raises(SettingsError, match="step_return"):
        resolve_settings("grpo", step_return="graph")


def test_presets_have_the_reference_defaults():
    s = resolve_settings("graphgpo")
    assert (s.step_partition, s.step_baseline, s.step_return, s.step_gamma, s.w_ep, s.w_step, s.advantage_norm) == (
        "hash", "mean", "graph", 0.1, 1.0, 1.0, "mean_std"
    )
    assert (s.normalize_distance, s.similarity_merge, s.similarity_threshold) == (False, False, 0.95)
    assert resolve_settings("bigraphgpo").step_partition == "hidden"


def test_config_flags_reach_the_settings(tmp_path):
    config = BiPACEConfig(
        output_dir=str(tmp_path), use_cpu=True, preset="graphgpo", env_name="tiny", normalize_distance=True, similarity_merge=True,
        similarity_threshold=0.9, step_gamma=0.2,
    )  # fmt: skip
    s = config.estimator
    assert (s.step_return, s.normalize_distance, s.similarity_merge, s.similarity_threshold, s.step_gamma) == (
        "graph", True, True, 0.9, 0.2
    )
    with pytest.raises(ValueError, match="similarity_merge"):
        BiPACEConfig(output_dir=str(tmp_path), use_cpu=True, preset="bigraphgpo", env_name="tiny", similarity_merge=True)


def test_auto_eps_is_calibrated_once_per_batch(monkeypatch):
    """`compute_advantages` with "auto" calibrates on a batch once: later calls on the same
    batch object (other presets of that partition) cluster with the remembered ε."""
    builds = []
    hidden = PARTITIONS["hidden"].build

    def counting(batch, layout, eps):
        builds.append(eps)
        return hidden(batch, layout, eps)

    register_partition("counting_hidden", counting, needs=("hidden",), takes_eps=True)
    try:
        steps = [dict(group=0, traj=j, t=0, reward=float(j % 2), valid=True, anchor="a", key="k",
                      hidden=[1.0, 0.1 * j, 0.0]) for j in range(6)]  # fmt: skip
        batch = to_batch(steps)
        first = compute_advantages(batch, resolve_settings("bigpo", step_partition="counting_hidden"))[1]
        calibration_builds = len(builds) - 1
        assert calibration_builds > 5  # a bisection
        second = compute_advantages(batch, resolve_settings("bipace_q", step_partition="counting_hidden"))[1]
        assert len(builds) == calibration_builds + 2  # one build each, no second calibration
        assert first["estimator/cluster_eps"] == second["estimator/cluster_eps"]
        fresh = to_batch(steps)
        compute_advantages(fresh, resolve_settings("bigpo", step_partition="counting_hidden"))
        assert len(builds) == 2 * calibration_builds + 3  # a new batch object calibrates afresh
    finally:
        PARTITIONS.pop("counting_hidden")


def test_partition_from_labels_keeps_groups_apart_for_graph_nodes():
    """The graph's nodes come from `Partition.from_labels`: equal labels in two groups are two nodes."""
    cells = Partition.from_labels(torch.tensor([0, 1]), torch.tensor([5, 5])).cell
    assert cells[0] != cells[1]
