"""The GiGPO reference estimator (verl-agent, `gigpo/core_gigpo.py`), restated.

This is a behavioural transcription, written for this project, of what the reference
pipeline computes for `adv_estimator=gigpo` with `use_invalid_action_penalty=True`:

1. `compute_step_discounted_returns`: per trajectory, R_t = r_t + γ R_{t+1} in
   float32, found with `np.where` per trajectory and again per row (quadratic in the
   batch size; kept that way so `bench/estimators.py` can time it honestly).
2. The episode reward manager writes each row's *episode* reward as its score.
3. `apply_invalid_action_penalty` runs after step 1: it subtracts coef · invalid from
   both the row's score and its step return (so the penalty is not discounted back).
4. `episode_norm_reward(compute_mean_std_cross_steps=True)`: mean and (unbiased)
   std of scores over the *rows* of each task group; a group of one row uses mean 0,
   std 1.
5. `build_step_group`: rows of a task group with identical anchors share a step group.
6. `step_norm_reward`: same statistics per step group; a group of one row has mean
   equal to its own score (so 0) and std 1.
7. scores = episode advantage + w · step advantage.

Inputs are flat per-row arrays, like the reference's `non_tensor_batch`.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch


def discounted_returns(rewards, traj_uids, gamma, dtype=torch.float32):
    rewards = np.asarray(rewards, dtype=np.float64 if dtype == torch.float64 else np.float32)
    traj_uids = np.asarray(traj_uids)
    per_traj = {}
    for uid in np.unique(traj_uids):
        rows = np.where(traj_uids == uid)[0]
        out = np.zeros(len(rows), dtype=rewards.dtype)  # float32 as the reference; float64: no rounding at all
        running = 0.0
        for k in reversed(range(len(rows))):
            running = rewards[rows[k]] + gamma * running
            out[k] = running
        per_traj[uid] = out
    returns = np.zeros_like(rewards)
    for i, uid in enumerate(traj_uids):
        rows = np.where(traj_uids == uid)[0]
        returns[i] = per_traj[uid][np.where(rows == i)[0][0]]
    return torch.tensor(returns, dtype=dtype)


def _group_normalise(scores, index, remove_std, singleton_stats):
    scores = scores.clone()
    by_id = defaultdict(list)
    for i in range(len(scores)):
        by_id[index[i]].append(scores[i])
    stats = {}
    for key, values in by_id.items():
        if len(values) == 1:
            stats[key] = singleton_stats(values, scores.dtype)
        else:
            stats[key] = (torch.mean(torch.stack(values)), torch.std(torch.stack(values)[None]))
    for i in range(len(scores)):
        m, s = stats[index[i]]
        scores[i] = scores[i] - m if remove_std else (scores[i] - m) / (s + 1e-6)
    return scores


def gigpo_advantages(
    group, traj, reward, valid, anchor, *, gamma=0.95, penalty_coef=0.1, mode="mean_std_norm", w=1.0,
    dtype=torch.float32,
):
    """Rows must be in trajectory order (t ascending within a trajectory), as the
    reference's rollout produces them. Returns (N,) advantages.

    The reference computes in float32 (`dtype`); float64 gives the same algorithm
    without its rounding, to tell a difference in method from one in precision."""
    remove_std = mode == "mean_norm"
    group = np.asarray(group)
    traj = np.asarray(traj)
    step_rewards = discounted_returns(reward, traj, gamma, dtype)
    episode_reward = defaultdict(float)
    for uid, r in zip(traj, reward):
        episode_reward[uid] += float(r)
    scores = torch.tensor([episode_reward[uid] for uid in traj], dtype=dtype)
    invalid = torch.tensor([0.0 if v else 1.0 for v in valid], dtype=dtype)
    scores -= penalty_coef * invalid
    step_rewards -= penalty_coef * invalid
    episode = _group_normalise(
        scores, group, remove_std, lambda v, dt: (torch.tensor(0.0, dtype=dt), torch.tensor(1.0, dtype=dt))
    )
    step_group = [(g, a) for g, a in zip(group.tolist(), anchor)]
    step = _group_normalise(
        step_rewards, step_group, remove_std, lambda v, dt: (torch.mean(torch.stack(v)), torch.tensor(1.0, dtype=dt))
    )
    return episode + w * step
