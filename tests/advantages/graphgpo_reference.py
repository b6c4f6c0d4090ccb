"""The GraphGPO reference estimator (verl-agent, `recipe/GraphGPO/core_graph.py`), restated.

Source: verl-agent upstream pull request #256, commit 234a913 ("Add recipe/GraphGPO (GraphGPO
trainer, configs and run scripts)"), read from the fork github:zzj1111/alfworldauto, which
keeps upstream's history. Its callers: `recipe/GraphGPO/graphgpo_ray_trainer.py` (`fit`: the
graph and the step returns before the rewards; `compute_advantage`, `AdvantageEstimator.GraphGPO`)
and `recipe/GraphGPO/rollout_loop.py` (`gather_rollout_data`: the last step of a trajectory
with episode reward > 0 gets next_obs = 'success').

A transcription, written for this project, of what that pipeline computes for
`adv_estimator=graphgpo` with `use_invalid_action_penalty=True`; the functions keep the
reference's names, loops and float32 arithmetic:

1. `StateCanonicalizer` and `ComplexGraph.from_data`: per task group (`uid`), rows in batch
   order, each row's anchor_obs then next_obs canonicalised (exact, or with the similarity
   merge: the first earlier representative with `SequenceMatcher(...).ratio() >= threshold`),
   and an edge anchor -> next added; final_state = canonical 'success'.
2. `all_to_target_shortest_paths` (through `calculate_path`): reverse Dijkstra from
   final_state over edges of weight 1.0; every node never reached gets far + 1, far the
   largest finite distance (0 when only the goal itself was reached).
3. `compute_graph_path_returns`: per row, 10 γ^(d(next) + 1 - 1), or with
   `normalize_distance` 10 γ^(d(next) - d(anchor) + 1), stored in float32.
4. `apply_invalid_action_penalty`: coef · invalid subtracted from the row's step return and
   from its episode score (`gigpo_reference`, the same code as GiGPO's).
5. `compute_graphgpo_outcome_advantage`: GiGPO's `step_norm_reward` over
   `build_step_group(anchor_obs, index)` (the raw anchors: the merge is the graph's only)
   and `episode_norm_reward` over step rows; scores = w_step · step + w_ep · episode
   (the episode term skipped when w_ep = 0).

One switch is not the code's: `exact_mean=True` takes a step group's mean as
r[0] + mean(r − r[0]), the same number in exact arithmetic, but exactly r[0] when every
return of the group is equal. The code's float32 `torch.mean` of n equal values can be one
rounding step off, and (r − mean) / (std + 1e-6), with std that same residue, turns it into
noise of up to ±0.06 instead of 0 (the same effect as in `hgpo_reference`). This project
gives the exact 0 there; the tests show that the rows where it differs from the code are
exactly the rows of such step groups.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from difflib import SequenceMatcher

import numpy as np
import torch

from .gigpo_reference import _group_normalise


def to_hashable(x):
    if isinstance(x, (int, float, str, bool)):
        return x
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (list, tuple)):
        return tuple(to_hashable(e) for e in x)
    raise TypeError(f"Unsupported type: {type(x)}")


class StateCanonicalizer:
    """The reference's class, as written."""

    def __init__(self, enable=False, threshold=0.95):
        self.enable = enable
        self.threshold = threshold
        self._clusters = []
        self._cache = {}

    def canonicalize(self, state):
        h = to_hashable(state)
        if not self.enable:
            return h
        if h in self._cache:
            return self._cache[h]
        raw_str = state if isinstance(state, str) else str(state)
        for canonical_h, canonical_str in self._clusters:
            if SequenceMatcher(None, raw_str, canonical_str).ratio() >= self.threshold:
                self._cache[h] = canonical_h
                return canonical_h
        self._clusters.append((h, raw_str))
        self._cache[h] = h
        return h


class ComplexGraph:
    """The parts of the reference's class that the returns read."""

    def __init__(self):
        self.graph = defaultdict(lambda: defaultdict(list))
        self.nodes = set()
        self.final_state = None
        self.shortest_path_to_final = None
        self.canonicalizer = None

    def add_edge(self, u, v, **attrs):
        self.graph[to_hashable(u)][to_hashable(v)].append(attrs)
        self.nodes.update([u, v])

    @classmethod
    def from_data(cls, nt, enable_similarity=False, similarity_thresh=0.95):
        """`nt`: the non_tensor_batch dict (uid, traj_uid, anchor_obs, next_obs, text_actions)."""
        graphs = {}
        for uid in set(nt["uid"]):
            g = cls()
            canon = StateCanonicalizer(enable=enable_similarity, threshold=similarity_thresh)
            uid_indices = np.where(nt["uid"] == uid)[0]
            for i in uid_indices:
                anchor_h = canon.canonicalize(nt["anchor_obs"][i])
                next_h = canon.canonicalize(nt["next_obs"][i])
                g.add_edge(anchor_h, next_h, action=nt["text_actions"][i], traj_uid=nt["traj_uid"][i], data_id=i, weight=1.0)
            g.final_state = canon.canonicalize("success")
            first_counts = Counter()  # first_state: kept for fidelity, no return reads it
            for traj_uid in set(nt["traj_uid"][uid_indices]):
                rows = uid_indices[nt["traj_uid"][uid_indices] == traj_uid]
                first_counts[canon.canonicalize(nt["anchor_obs"][rows[np.argmin(rows)]])] += 1
            g.first_state = first_counts.most_common(1)[0][0]
            g.canonicalizer = canon
            graphs[uid] = g
        return graphs

    def all_to_target_shortest_paths(self, target, weight_key="weight"):
        target = to_hashable(target)
        reverse_graph = defaultdict(list)
        for u in self.graph:
            for v in self.graph[u]:
                for attr in self.graph[u][v]:
                    reverse_graph[v].append((u, attr.get(weight_key, 1)))
        distances = {n: float("inf") for n in self.nodes}
        pq = [(0, target, [target])]
        distances[target] = 0
        while pq:
            cost, node, path = heapq.heappop(pq)
            if cost > distances[node]:
                continue
            for neighbor, w in reverse_graph[node]:
                new_cost = cost + w
                if new_cost < distances[neighbor]:
                    distances[neighbor] = new_cost
                    heapq.heappush(pq, (new_cost, neighbor, [neighbor] + path))
        far_distance = 0
        for value in distances.values():
            if value != float("inf") and value > far_distance:
                far_distance = value
        for key, value in distances.items():
            if value == float("inf"):
                distances[key] = far_distance + 1
        return distances, {}

    def calculate_path(self):
        self.shortest_path_to_final = self.all_to_target_shortest_paths(self.final_state)


def compute_graph_path_returns(nt, graphs, gamma, normalize_distance, dtype=torch.float32):
    """(N,) float32 step returns, as the reference (its `rewards` only set the dtype)."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    traj_uids, uids = nt["traj_uid"], nt["uid"]
    returns_by_traj = {}
    for traj in np.unique(traj_uids):
        rows = np.where(traj_uids == traj)[0]
        g = graphs[uids[rows[0]]]
        distances, _ = g.shortest_path_to_final
        canon = g.canonicalizer
        out = np.zeros(len(rows), dtype=np_dtype)
        for t in range(len(rows)):
            new_h = canon.canonicalize(nt["next_obs"][rows[t]])
            old_h = canon.canonicalize(nt["anchor_obs"][rows[t]])
            if normalize_distance:
                out[t] = 10 * gamma ** (distances[new_h] - distances[old_h] + 1.0)
            else:
                out[t] = 10 * gamma ** (distances[new_h] + 1.0 - 1)
        returns_by_traj[traj] = out
    all_returns = np.zeros(len(traj_uids), dtype=np_dtype)
    for i, traj in enumerate(traj_uids):
        rows = np.where(traj_uids == traj)[0]
        all_returns[i] = returns_by_traj[traj][np.where(rows == i)[0][0]]
    return torch.tensor(all_returns, dtype=dtype)


def _exact_mean_stats(values, dtype):
    stacked = torch.stack(values)
    mean = stacked[0] + torch.mean(stacked - stacked[0])
    return mean, torch.std(stacked[None])


def _step_norm(step_rewards, step_group, remove_std, exact_mean):
    """`step_norm_reward`: a group of one row has mean itself and std 1."""
    if not exact_mean:
        singleton = lambda v, dt: (torch.mean(torch.stack(v)), torch.tensor(1.0, dtype=dt))  # noqa: E731
        return _group_normalise(step_rewards, step_group, remove_std, singleton)
    scores = step_rewards.clone()
    by_id = defaultdict(list)
    for i in range(len(scores)):
        by_id[step_group[i]].append(scores[i])
    stats = {}
    for key, values in by_id.items():
        stats[key] = (values[0], torch.tensor(1.0, dtype=scores.dtype)) if len(values) == 1 else _exact_mean_stats(values, scores.dtype)
    for i in range(len(scores)):
        m, s = stats[step_group[i]]
        scores[i] = scores[i] - m if remove_std else (scores[i] - m) / (s + 1e-6)
    return scores


def graphgpo_advantages(
    group, traj, reward, valid, anchor, next_obs, *, gamma=0.1, penalty_coef=0.1, mode="mean_std_norm",
    w_step=1.0, w_ep=1.0, normalize_distance=False, enable_similarity=False, similarity_thresh=0.95,
    exact_mean=False, with_returns=False, dtype=torch.float32,
):  # fmt: skip
    """Rows in trajectory order (t ascending), `next_obs` as the rollout writes it ('success'
    after the last step of a trajectory whose episode reward is > 0). Returns (N,) advantages
    (and the step returns before the penalty with `with_returns`). The code computes in float32
    (`dtype`); float64 gives its algorithm without that rounding, to tell a difference in
    method from one in precision (as `gigpo_reference`)."""
    nt = {
        "uid": np.asarray(group, dtype=object),
        "traj_uid": np.asarray(traj, dtype=object),
        "anchor_obs": np.asarray(anchor, dtype=object),
        "next_obs": np.asarray(next_obs, dtype=object),
        "text_actions": np.asarray(["act"] * len(group), dtype=object),
    }
    graphs = ComplexGraph.from_data(nt, enable_similarity=enable_similarity, similarity_thresh=similarity_thresh)
    for g in graphs.values():
        g.calculate_path()
    graph_returns = compute_graph_path_returns(nt, graphs, gamma, normalize_distance, dtype)
    remove_std = mode == "mean_norm"
    episode_reward = defaultdict(float)
    for uid, r in zip(traj, reward):
        episode_reward[uid] += float(r)
    scores = torch.tensor([episode_reward[uid] for uid in traj], dtype=dtype)
    invalid = torch.tensor([0.0 if v else 1.0 for v in valid], dtype=dtype)
    scores -= penalty_coef * invalid
    step_rewards = graph_returns - penalty_coef * invalid
    step_group = [(g, a) for g, a in zip(list(group), list(anchor))]
    step = _step_norm(step_rewards, step_group, remove_std, exact_mean)
    advantage = w_step * step
    if w_ep != 0.0:
        zero_one = lambda v, dt: (torch.tensor(0.0, dtype=dt), torch.tensor(1.0, dtype=dt))  # noqa: E731
        advantage = advantage + w_ep * _group_normalise(scores, list(group), remove_std, zero_one)
    return (advantage, graph_returns) if with_returns else advantage


def replayed_rows(rollout, make_env):
    """Reference rows for a played rollout, from the env alone: each episode's actions replayed on a
    fresh env (`make_env()`), in trajectory order, as (group, traj, t, reward, valid, anchor, next_obs):
    anchor the env's anchor before the step, next_obs the one it returned after it, 'success' after
    a won episode's last step, and a dead end of the trajectory's own where the env raised (the
    reference's rollout has no env faults; a name no other row uses is that dead end)."""
    steps_of: dict[int, list] = {}
    for step in rollout.steps:
        steps_of.setdefault(step.traj, []).append(step)
    rows = []
    for episode in rollout.episodes:
        env = make_env()
        state = env.reset(episode.task_id).anchor
        for step in sorted(steps_of.get(episode.traj, []), key=lambda s: s.t):
            try:
                after = env.step(step.action).anchor
            except RuntimeError:
                after = f"dead end {episode.traj}"
            last = step.t == episode.length - 1
            nxt = "success" if last and episode.reward > 0 else after
            rows.append((step.group, step.traj, step.t, step.reward, step.valid, state, nxt))
            state = after
    return rows
