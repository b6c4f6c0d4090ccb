"""Slow, obviously correct references, written from docs/concepts/math.md with plain loops.

Nothing here is vectorised or shared with the package: each function follows one
equation of that page over Python lists, so the package's tensor code can be checked
against it on random batches.

A step is a dict with keys: group, traj, t, reward, valid, anchor, key, hidden, and
optionally truncated (True on the last step of a trajectory the turn budget cut).
"""

from __future__ import annotations

import math
from collections import defaultdict

EPS = 1e-6
TOL = 1e-5  # the package's SAME_STATE_TOL, restated
TIE = 1e-12  # distances this close in float64 are equal ones, rounded


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def trajectories(steps):
    """traj id -> list of step indices sorted by t."""
    out = defaultdict(list)
    for i, s in enumerate(steps):
        out[s["traj"]].append(i)
    for idx in out.values():
        idx.sort(key=lambda i: steps[i]["t"])
    return out


def env_returns(steps, gamma, after=None):
    """R_t = r_t + γ R_{t+1} without the penalty; R_L = after[last step index] (default 0)."""
    after = after or {}
    returns = [0.0] * len(steps)
    for idx in trajectories(steps).values():
        running = after.get(idx[-1], 0.0)
        for i in reversed(idx):
            running = steps[i]["reward"] + gamma * running
            returns[i] = running
    return returns


def penalties(steps, penalty):
    return [0.0 if s["valid"] else penalty for s in steps]


def step_returns(steps, gamma, penalty, after=None):
    """docs/concepts/math.md#step-returns: the penalty is subtracted after the recursion."""
    return [r - p for r, p in zip(env_returns(steps, gamma, after), penalties(steps, penalty))]


def truncation_values(steps, cells, gamma):
    """R_L of each truncated trajectory, keyed by its last step: the mean terminal env
    return over that step's cell (V̄(s_{L-1}) standing in for the unobserved s_L)."""
    terminal = env_returns(steps, gamma)
    groups = members_of(cells)
    return {
        i: mean([terminal[j] for j in groups[cells[i]]]) for i, s in enumerate(steps) if s.get("truncated", False)
    }


def episode_advantage(steps, norm, episode_stats, penalty):
    trajs = trajectories(steps)
    ep_return = {tr: sum(steps[i]["reward"] for i in idx) for tr, idx in trajs.items()}
    adv = [0.0] * len(steps)
    if episode_stats == "trajectory":
        by_group = defaultdict(list)
        for tr, idx in trajs.items():
            by_group[steps[idx[0]]["group"]].append(tr)
        for members in by_group.values():
            values = [ep_return[tr] for tr in members]
            for tr in members:
                if len(values) < 2:
                    a = 0.0
                elif norm == "mean":
                    a = ep_return[tr] - mean(values)
                else:
                    a = (ep_return[tr] - mean(values)) / (std_unbiased(values) + EPS)
                for i in trajs[tr]:
                    adv[i] = a
        return adv
    score = [ep_return[s["traj"]] - (0.0 if s["valid"] else penalty) for s in steps]
    rows = defaultdict(list)
    for i, s in enumerate(steps):
        rows[s["group"]].append(i)
    for members in rows.values():
        values = [score[i] for i in members]
        m, sd = (0.0, 1.0) if len(values) == 1 else (mean(values), std_unbiased(values))
        for i in members:
            adv[i] = score[i] - m if norm == "mean" else (score[i] - m) / (sd + EPS)
    return adv


def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def dot(u, v):
    return sum(a * b for a, b in zip(u, v))


def hash_cells(steps):
    """step index -> cell key (group, anchor)."""
    return [(s["group"], s["anchor"]) for s in steps]


def hidden_cells(steps, eps):
    """Leader clustering, recomputing each centroid from its members every time.

    A step joins the nearest centroid if d <= eps + TOL; equal distances (float64 gap
    below TIE) go to the oldest cluster, whatever the package's float32 rounding of them.

    Returns (cell keys, margin): margin is the smallest |d - (eps + TOL)| over all join
    decisions and the smallest gap above TIE between the distance of the joined cluster
    and another's, so callers can skip batches where float rounding could flip one
    (a near tie the package's tolerance would resolve to the oldest cluster).
    """
    cells = [None] * len(steps)
    margin = math.inf
    by_group = defaultdict(list)
    for i, s in enumerate(steps):
        by_group[s["group"]].append(i)
    for g, idx in by_group.items():
        idx.sort(key=lambda i: (steps[i]["traj"], steps[i]["t"]))
        clusters = []  # lists of member unit vectors
        for i in idx:
            x = unit(steps[i]["hidden"])
            distances = []
            for members in clusters:
                centroid = unit([sum(col) / len(members) for col in zip(*members)])
                distances.append(1.0 - dot(x, centroid))
                margin = min(margin, abs(distances[-1] - (eps + TOL)))
            best_d = min(distances, default=math.inf)
            best = next((c for c, d in enumerate(distances) if d <= best_d + TIE), None)
            if best is not None and best_d <= eps + TOL:
                gaps = [d - best_d for d in distances if d - best_d > TIE]
                margin = min([margin, *gaps])
                clusters[best].append(x)
                cells[i] = (g, best)
            else:
                clusters.append([x])
                cells[i] = (g, len(clusters) - 1)
    return cells, margin


def members_of(cells):
    out = defaultdict(list)
    for i, c in enumerate(cells):
        out[c].append(i)
    return out


def step_advantage(steps, cells, returns, baseline, norm, pace_norm, gamma, lam, penalty=0.0, after=None):
    groups = members_of(cells)
    adv = [0.0] * len(steps)
    if baseline == "gae":
        return gae(steps, cells, gamma, lam, penalty, after)
    for i, s in enumerate(steps):
        members = groups[cells[i]]
        if len(members) == 1:
            continue
        values = [returns[j] for j in members]
        others = [returns[j] for j in members if j != i]
        loo = returns[i] - mean(others)
        if baseline == "mean":
            a = returns[i] - mean(values)
            if norm == "mean_std":
                a /= std_unbiased(values) + EPS
        else:
            keys = {steps[j]["key"] for j in members}
            same = [returns[j] for j in members if steps[j]["key"] == s["key"]]
            diff = [returns[j] for j in members if steps[j]["key"] != s["key"]]
            if baseline == "pace_q":
                a = loo if len(keys) == 1 else mean(same) - mean(values)
            else:  # pace_diff
                a = loo if not diff else returns[i] - mean(diff)
            if pace_norm == "mean_std":
                a /= std_unbiased(values) + EPS
        adv[i] = a
    return adv


def grouped_gae(steps, cells, gamma, lam, penalty=0.0, after=None):
    """Â_t before normalisation, straight from the recursion on env rewards, then the
    step's own penalty centred on its cell (the penalty is not a reward: no δ sees it).

    `after`: R_L of truncated trajectories, keyed by their last step (V̄(s_L) there).
    """
    after = after or {}
    groups = members_of(cells)
    env = env_returns(steps, gamma, after)
    pen = penalties(steps, penalty)
    value = [mean([env[j] for j in groups[cells[i]]]) for i in range(len(steps))]
    cell_penalty = [mean([pen[j] for j in groups[cells[i]]]) for i in range(len(steps))]
    raw = [0.0] * len(steps)
    for idx in trajectories(steps).values():
        running = 0.0
        for pos in reversed(range(len(idx))):
            i = idx[pos]
            nxt = idx[pos + 1] if pos + 1 < len(idx) else None
            next_value = value[nxt] if nxt is not None else after.get(i, 0.0)
            delta = steps[i]["reward"] + gamma * next_value - value[i]
            running = delta + gamma * lam * running
            raw[i] = running - (pen[i] - cell_penalty[i])
    return raw


def gae(steps, cells, gamma, lam, penalty=0.0, after=None):
    raw = grouped_gae(steps, cells, gamma, lam, penalty, after)
    sizes = {c: len(m) for c, m in members_of(cells).items()}
    adv = [0.0] * len(steps)
    by_group = defaultdict(list)
    for i, s in enumerate(steps):
        if sizes[cells[i]] > 1:
            by_group[s["group"]].append(i)
    for members in by_group.values():
        values = [raw[i] for i in members]
        m = mean(values)
        sd = std_unbiased(values) if len(values) > 1 else 0.0
        for i in members:
            adv[i] = (raw[i] - m) / (sd + EPS)
    return adv


def advantages(steps, settings, eps=None):
    """A = w_ep A^ep + w_step A^s (docs/concepts/math.md#combination), for an `EstimatorSettings`-like object.

    Returns (advantages, margin) where margin is the hidden-partition tie margin (inf
    for other partitions).
    """
    s = settings
    ep = episode_advantage(steps, s.advantage_norm, s.episode_stats, s.invalid_action_penalty)
    if s.step_partition == "none" or s.w_step == 0:
        return [s.w_ep * a for a in ep], math.inf
    margin = math.inf
    if s.step_partition == "hash":
        cells = hash_cells(steps)
    else:
        cells, margin = hidden_cells(steps, eps)
    after = truncation_values(steps, cells, s.step_gamma) if getattr(s, "bootstrap_truncated", False) else {}
    returns = step_returns(steps, s.step_gamma, s.invalid_action_penalty, after)
    st = step_advantage(steps, cells, returns, s.step_baseline, s.advantage_norm, s.pace_norm, s.step_gamma, s.gae_lambda, s.invalid_action_penalty, after)
    return [s.w_ep * a + s.w_step * b for a, b in zip(ep, st)], margin
