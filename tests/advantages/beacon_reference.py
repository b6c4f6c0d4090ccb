"""The BEACON reference estimator (ZJU-REAL/BEACON, `migpo/core_migpo.py`), restated.

Source: github:ZJU-REAL/BEACON, latest commit read db9347f ("Add arXiv link and BibTeX
(2605.06078)"; `migpo/` is unchanged since the first release, 0f22c0f). Its callers:
`verl/trainer/ppo/ray_trainer.py` (`fit`: `compute_migpo_step_rewards` right after the rollout,
`apply_invalid_action_penalty` on the scores and the step rewards, then `compute_advantage` with
`AdvantageEstimator.MiGPO`) and `examples/migpo_trainer/run_*.sh` (the settings).

The released trainer does not hand the estimator what it reads: no `actions` or `trial_id`
column reaches `compute_migpo_step_rewards` or `compute_migpo_advantage` for ALFWorld (their
step rewards are 0 and the advantage is the episode term alone), and for WebShop and
ScienceWorld `data.non_tensor_batch.get('milestone_achieved') or ...` raises on an array of
more than one row. So the reference is the estimator functions, fed what their docstrings say
they take, with the run scripts' settings (ALFWorld γ 0.9 and weight 10; WebShop and
ScienceWorld γ 0.95 and weight 1; threshold 0.95 and mode mean_norm everywhere).

A transcription, written for this project, of what those functions compute; the functions
keep the reference's names, loops and float32 arithmetic:

1. `compute_migpo_step_rewards`: with milestone flags (`milestone_achieved` / `subgoal_completed`)
   the dynamic path: per trajectory (rows in batch order), every step up to and including a
   flagged step gets (γ^(flag − t)) · 10, computed in float64 and stored in float32; steps after
   the last flag keep 0. Without flags the static path: the trajectory's trial id looks up its
   milestone list (`MilestoneLoader`, a dict here); `match_milestones` walks the actions in
   order against it (difflib ratio >= threshold, `are_similar`); `compute_segment_rewards`
   gives γ^(match − t) in float32 up to each match, 0 from the first unmatched milestone on
   and after the last match; times 10 in float32. A trial without a list gets 0 everywhere.
2. `apply_invalid_action_penalty`: coef · invalid subtracted from the row's score (its episode
   reward, as GiGPO's reward manager writes it) and from its step reward.
3. `compute_migpo_advantage`: `episode_norm_reward` (GiGPO's, statistics over the group's rows;
   a group of one row: mean 0, std 1); segment groups `build_segment_groups_dynamic` (per row,
   the number of flagged rows of its trajectory before it) or `build_segment_groups` (the
   segment ids of `compute_segment_rewards`: the milestone index, -1 after the last match,
   0 for a trial without a list), keyed by (task group, segment); `segment_norm_reward` (a
   group of one row: mean = its score, std 1; else torch mean and unbiased std); then
   scores = episode + weight · segment.

One switch is not the code's: `exact_mean=True` takes a segment group's mean as
r[0] + mean(r − r[0]), the same number in exact arithmetic, but exactly r[0] when every reward
of the group is equal, as in `graphgpo_reference`: the code's float32 mean of n equal values
can be one rounding step off, which mean_std_norm turns into noise instead of 0.
"""

from __future__ import annotations

from collections import defaultdict
from difflib import SequenceMatcher

import numpy as np
import torch

from .gigpo_reference import _group_normalise
from .graphgpo_reference import _step_norm


def are_similar(a, b, threshold=0.85):
    if not isinstance(a, str) or not isinstance(b, str):
        raise ValueError("Only text-based observations are supported for similarity matching.")
    return SequenceMatcher(None, a, b).ratio() >= threshold


def match_milestones(actions, milestones, threshold=0.85):
    k = 0
    match_indices = []
    for t, action in enumerate(actions):
        if k >= len(milestones):
            break
        if are_similar(action, milestones[k], threshold):
            match_indices.append(t)
            k += 1
    while len(match_indices) < len(milestones):
        match_indices.append(-1)
    return match_indices


def compute_segment_rewards(traj_length, match_indices, gamma=0.99, np_dtype=np.float32):
    rewards = np.zeros(traj_length, dtype=np_dtype)
    segment_ids = np.full(traj_length, -1, dtype=np.int32)
    prev_end = -1
    for seg_idx, match_idx in enumerate(match_indices):
        if match_idx == -1:
            for t in range(prev_end + 1, traj_length):
                segment_ids[t] = seg_idx
                rewards[t] = 0.0
            break
        for t in range(prev_end + 1, match_idx + 1):
            segment_ids[t] = seg_idx
            rewards[t] = gamma ** (match_idx - t)
        prev_end = match_idx
    return rewards, segment_ids


def compute_migpo_step_rewards_static(actions, traj_uids, trial_ids, loader, gamma, threshold, dtype):
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    all_step_rewards = np.zeros(len(traj_uids), dtype=np_dtype)
    for uid in np.unique(traj_uids):
        traj_indices = np.where(traj_uids == uid)[0]
        milestones = loader.get(trial_ids[traj_indices[0]])
        if milestones is None:
            continue
        traj_actions = [actions[i] for i in traj_indices]
        match_indices = match_milestones(traj_actions, milestones, threshold)
        rewards, _ = compute_segment_rewards(len(traj_actions), match_indices, gamma, np_dtype)
        rewards = rewards * 10.0
        for local_idx, global_idx in enumerate(traj_indices):
            all_step_rewards[global_idx] = rewards[local_idx]
    return torch.tensor(all_step_rewards, dtype=dtype)


def compute_migpo_step_rewards_dynamic(milestone_achieved, traj_uids, gamma, dtype):
    step_rewards = torch.zeros(len(traj_uids), dtype=dtype)
    for traj_uid in np.unique(traj_uids):
        traj_indices = np.where(traj_uids == traj_uid)[0]
        traj_achieved = [milestone_achieved[i] for i in traj_indices]
        milestone_steps = [i for i, achieved in enumerate(traj_achieved) if achieved]
        if not milestone_steps:
            continue
        segment_start = 0
        for milestone_idx in milestone_steps:
            for step_idx in range(segment_start, milestone_idx + 1):
                step_rewards[traj_indices[step_idx]] = (gamma ** (milestone_idx - step_idx)) * 10.0
            segment_start = milestone_idx + 1
    return step_rewards


def build_segment_groups(segment_ids, index):
    group_uids = np.empty(len(segment_ids), dtype=object)
    key_to_uid = {}
    for i in range(len(segment_ids)):
        key = (index[i], segment_ids[i])
        key_to_uid.setdefault(key, len(key_to_uid))  # the code draws a uuid4 per key: any distinct label
        group_uids[i] = key_to_uid[key]
    return group_uids


def build_segment_groups_dynamic(milestone_achieved, index, traj_uid):
    group_uids = np.empty(len(milestone_achieved), dtype=object)
    key_to_uid = {}
    for i in range(len(milestone_achieved)):
        segment_id = 0
        for j in range(i):
            if traj_uid[j] == traj_uid[i] and milestone_achieved[j]:
                segment_id += 1
        key = (index[i], segment_id)
        key_to_uid.setdefault(key, len(key_to_uid))
        group_uids[i] = key_to_uid[key]
    return group_uids


def static_segment_ids(actions, traj_uid, trial_id, loader, gamma, threshold):
    """`compute_migpo_advantage`'s loop over trajectories for the static path: each row's segment id."""
    all_segment_ids = np.zeros(len(traj_uid), dtype=np.int32)
    for uid in np.unique(traj_uid):
        traj_indices = np.where(traj_uid == uid)[0]
        traj_trial_id = trial_id[traj_indices[0]]
        milestones = loader.get(traj_trial_id) if traj_trial_id else None
        if milestones is None:
            all_segment_ids[traj_indices] = 0
            continue
        traj_actions = [actions[i] for i in traj_indices]
        _, segment_ids = compute_segment_rewards(len(traj_actions), match_milestones(traj_actions, milestones, threshold), gamma)
        all_segment_ids[traj_indices] = segment_ids
    return all_segment_ids


def segment_norm_reward(step_rewards, group_uids, remove_std, exact_mean):
    """BEACON's `segment_norm_reward` is GiGPO's `step_norm_reward` line for line (a group of one row:
    mean = its score, std 1; else torch mean and unbiased std), with `exact_mean` as in `graphgpo_reference`."""
    return _step_norm(step_rewards, list(group_uids), remove_std, exact_mean)


def beacon_advantages(
    group, traj, reward, valid, actions, *, trial_id=None, loader=None, milestone_achieved=None, gamma=0.95,
    threshold=0.95, penalty_coef=0.1, mode="mean_norm", step_advantage_w=1.0, exact_mean=True, with_rewards=False,
    dtype=torch.float32,
):  # fmt: skip
    """Rows in trajectory order (t ascending within a trajectory; trajectories may interleave).
    `milestone_achieved` (one flag per row) selects the dynamic path, else `trial_id` (one per row)
    and `loader` ({trial id: milestone list}) the static one. Returns (N,) advantages (and the step
    rewards before the penalty with `with_rewards`). `dtype` float32 is the code's arithmetic; float64
    its algorithm without that rounding."""
    remove_std = {"mean_norm": True, "mean_std_norm": False}[mode]
    group, traj = np.asarray(group, dtype=object), np.asarray(traj)
    if milestone_achieved is not None:
        step_rewards = compute_migpo_step_rewards_dynamic(milestone_achieved, traj, gamma, dtype)
        group_uids = build_segment_groups_dynamic(milestone_achieved, group, traj)
    else:
        trial_id = np.asarray(trial_id, dtype=object)
        step_rewards = compute_migpo_step_rewards_static(actions, traj, trial_id, loader, gamma, threshold, dtype)
        group_uids = build_segment_groups(static_segment_ids(actions, traj, trial_id, loader, gamma, threshold), group)
    raw_rewards = step_rewards.clone()
    episode_reward = defaultdict(float)
    for uid, r in zip(traj.tolist(), reward):
        episode_reward[uid] += float(r)
    scores = torch.tensor([episode_reward[uid] for uid in traj.tolist()], dtype=dtype)
    invalid = torch.tensor([0.0 if v else 1.0 for v in valid], dtype=dtype)
    scores -= penalty_coef * invalid
    step_rewards = step_rewards - penalty_coef * invalid
    zero_one = lambda v, dt: (torch.tensor(0.0, dtype=dt), torch.tensor(1.0, dtype=dt))  # noqa: E731
    episode = _group_normalise(scores, list(group), remove_std, zero_one)
    step = segment_norm_reward(step_rewards, group_uids, remove_std, exact_mean)
    advantage = episode + step_advantage_w * step
    return (advantage, raw_rewards) if with_rewards else advantage
