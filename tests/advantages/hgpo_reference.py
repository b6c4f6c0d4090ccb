"""The HGPO reference estimator (verl-agent, `recipe/hgpo/core_hgpo.py`), restated.

Source: verl-agent upstream commit b4918cc ("Add recipe/hgpo (HGPO trainer, configs and run
scripts) (#232)"), file `recipe/hgpo/core_hgpo.py`, read from the fork
github:zzj1111/alfworldauto, which keeps upstream's history. Its caller is
`recipe/hgpo/hgpo_ray_trainer.py` (`compute_advantage`, `AdvantageEstimator.HGPO`).

A behavioural transcription, written for this project, of what that pipeline computes for
`adv_estimator=hgpo` with `use_invalid_action_penalty=True`, its loops and float32
arithmetic kept (so `bench/estimators.py` can time it honestly):

1. `compute_step_discounted_returns` (the same code as GiGPO's: `gigpo_reference.discounted_returns`):
   R_t = r_t + γ R_{t+1} per trajectory, float32.
2. `apply_invalid_action_penalty` runs after step 1: it subtracts coef · invalid from each
   row's step return and from its token-level reward, whose sum is the row's episode
   score (episode reward − its own penalty).
3. `hgpo_advantage_estimate`, per task group (`index`):
   - trajectories' rows in batch order (the rollout writes them in time order);
   - for every row at position si of its trajectory and every k = 1 .. min(K+1, si+1), the
     row joins the cluster keyed (k, anchors si−k+1 .. si): the code's k is this
     project's level + 1 (level 0 = the current anchor alone);
   - per cluster of more than one row: a = R − mean, ÷ (population std + ε) in
     `mean_std_norm`;
   - per row, items (k, a) of its clusters, plus (0, A^ep) with `base_group`
     (`trajectory_advantages`: GiGPO's episode normalisation over step rows, unbiased std,
     a task group of one row keeps mean 0, std 1);
   - `aggregate_items`: items with a == 0 exactly are dropped; w = (k+1)^α, i.e.
     (level+2)^α, normalised as w / (Σ w + ε); the row's advantage is Σ w a (0 if no
     item is left).
4. The result is returned as both advantages and returns; there is no separate episode
   term (`w_ep = 0` in this project's terms).

One switch is not the code's: `exact_mean=True` takes a cluster's mean as
r[0] + mean(r − r[0]), the same number in exact arithmetic, but exactly r[0] when every
return in the cluster is equal. The code's `r.mean()` of n equal values is not always
that value: on this machine's torch, for returns γ^k − p (γ ∈ {0.9, 0.95, 1}, k < 30,
p ∈ {0, 0.1, 0.5}) and n = 2..39, the mean differed from the value in 4,604 of 10,260
cases in float32 and 2,377 in float64. Then a = r − mean is a residue, not 0, so the
code's drop of zero levels does not fire and the level enters the weighted mean with a
≈ 0 (mean_norm), or with a = d / (d + 1e-6) ≈ ±0.06 for d ≈ 6e-8 (mean_std_norm,
float32: the residue divided by a std of the same residue), the same sign for every
member. `exact_mean=True` is the code's rule as written; this project implements that
(its cell means are exact for equal values), and the tests measure the distance to the
code's float32 arithmetic separately. The same holds for one value that equals the mean
of unequal ones (returns (-0.5, 0.5, 0.4, -0.6, -1.5, -2, -1.1, 0) at -0.6; row scores
of 1, 0 and 0.9 averaging 0.9 in `trajectory_advantages`): a = 0 and the item is
dropped, but whether the arithmetic gives 0 or a 1e-16 residue is a matter of the order
of its sum (torch's here, the package's segment sums there). So `exact_mean=True` also
takes a deviation within `MEAN_RESIDUE_TOL` · max |values| (1e-9, the package's constant
restated) as 0: far above float64's rounding (~1e-16 per operation), far below the 1e-7
resolution of float32 rewards.

The response tensors of the original (`token_level_rewards`, `response_mask`) are
reduced to one token per row here: every use of them in the code is a per-row sum or a
per-row mean over the mask, which a single token gives exactly.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .gigpo_reference import discounted_returns

MEAN_RESIDUE_TOL = 1e-9  # `bipace_trainer.advantages.records.MEAN_RESIDUE_TOL`, restated


def zero_residue(centred, values):
    """`centred` (values - mean) with |deviations| <= MEAN_RESIDUE_TOL · max |values| set to 0."""
    return torch.where(centred.abs() <= MEAN_RESIDUE_TOL * values.abs().max(), 0.0, centred)


def to_hashable(x):
    if isinstance(x, (int, float, str, bool)):
        return x
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return tuple(x.flatten())
    if isinstance(x, (list, tuple)):
        return tuple(to_hashable(e) for e in x)
    raise TypeError(f"Unsupported type: {type(x)}")


def trajectory_advantages(scores, index, epsilon, remove_std, dtype, exact_mean=False):
    """`trajectory_advantages(compute_mean_std_cross_steps=True)`: statistics over rows
    (`exact_mean`: a score equal to its group's mean is centred to 0 exactly)."""
    scores = scores.clone()
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, values in id2score.items():
        if len(values) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0, dtype=dtype), torch.tensor(1.0, dtype=dtype)
        else:
            id2mean[idx] = torch.mean(torch.tensor(values, dtype=dtype))
            id2std[idx] = torch.std(torch.tensor([values], dtype=dtype))
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        if exact_mean and len(id2score[index[i]]) > 1:
            centred = zero_residue(centred, torch.stack(id2score[index[i]]))
        if remove_std:
            scores[i] = centred
        else:
            scores[i] = centred / (id2std[index[i]] + epsilon)
    return scores


def hgpo_advantage_estimate(
    episode_scores, step_rewards, anchor_obs, index, traj_index, history_length, *,
    epsilon=1e-6, mode="mean_std_norm", length_weight_alpha=1.0, base_group=False, dtype=torch.float32,
    exact_mean=False,
):  # fmt: skip
    """`hgpo_advantage_estimate` on one-token responses: (N,) advantages."""
    rewards_all = step_rewards.detach().to(dtype=dtype)
    n = anchor_obs.shape[0]
    all_step_adv = torch.zeros(n, dtype=dtype)

    base_adv_scalars = None
    if base_group:
        base_adv_scalars = trajectory_advantages(
            episode_scores.to(dtype), index, epsilon, remove_std=(mode == "mean_norm"), dtype=dtype,
            exact_mean=exact_mean,
        )

    def aggregate_items(items):
        if not items:
            return torch.zeros((), dtype=dtype)
        ks = [k for k, _ in items]
        advs = torch.stack([a.to(dtype) for _, a in items], dim=0)
        ks_t = torch.tensor(ks, dtype=dtype)
        valid_mask = advs != 0
        if not valid_mask.any():
            return torch.zeros((), dtype=dtype)
        advs_v, ks_v = advs[valid_mask], ks_t[valid_mask]
        w_raw = (ks_v + 1) ** length_weight_alpha
        w = w_raw / (w_raw.sum() + epsilon)
        return (w * advs_v).sum()

    for gid in np.unique(index):
        group_indices = np.flatnonzero(index == gid)
        group_obs = anchor_obs[group_indices]
        group_traj_ids = traj_index[group_indices]
        group_rewards = rewards_all.index_select(0, torch.as_tensor(group_indices, dtype=torch.long))

        uniq_traj, inv = np.unique(group_traj_ids, return_inverse=True)
        n_traj = len(uniq_traj)
        traj_positions = [[] for _ in range(n_traj)]
        for pos, t in enumerate(inv):
            traj_positions[t].append(pos)
        traj_positions = [np.asarray(p, dtype=np.int64) for p in traj_positions]
        traj_obs = [group_obs[p] for p in traj_positions]
        traj_rewards = [group_rewards.index_select(0, torch.as_tensor(p, dtype=torch.long)) for p in traj_positions]
        traj_gidx = [group_indices[p] for p in traj_positions]

        clusters = defaultdict(list)
        traj_h = [[to_hashable(s) for s in traj_obs[ti]] for ti in range(n_traj)]
        max_k = history_length + 1
        for ti in range(n_traj):
            for si in range(len(traj_h[ti])):
                for k in range(1, min(max_k, si + 1) + 1):
                    clusters[(k, tuple(traj_h[ti][si - k + 1 : si + 1]))].append((ti, si))

        per_step_items = defaultdict(list)
        for (k, _key), members in clusters.items():
            if len(members) <= 1:
                continue
            r = torch.stack([traj_rewards[ti][si] for (ti, si) in members], dim=0)
            mean = r[0] + (r - r[0]).mean() if exact_mean else r.mean()
            std = r.std(unbiased=False) if not exact_mean else ((r - mean) ** 2).mean().sqrt()
            centred = r - mean
            if exact_mean:  # a return equal to the mean is a = 0, not its rounding residue
                centred = zero_residue(centred, r)
            if mode == "mean_std_norm":
                a = centred / (std + epsilon)
            elif mode == "mean_norm":
                a = centred
            else:
                raise ValueError(f"Invalid mode: {mode}")
            for j, (ti, si) in enumerate(members):
                per_step_items[(ti, si)].append((k, a[j]))

        for ti in range(n_traj):
            for si in range(len(traj_obs[ti])):
                global_idx = int(traj_gidx[ti][si])
                items = per_step_items.get((ti, si), [])
                if base_group:
                    items = [(0, base_adv_scalars[global_idx])] + items
                all_step_adv[global_idx] = aggregate_items(items)
    return all_step_adv


def hgpo_advantages(
    group, traj, reward, valid, anchor, *, history_length=2, gamma=0.95, penalty_coef=0.1, mode="mean_std_norm",
    alpha=1.0, base_group=False, dtype=torch.float32, exact_mean=False,
):  # fmt: skip
    """The pipeline (module docstring) on flat rows in trajectory order (t ascending
    within a trajectory, as the reference's rollout writes them). Returns (N,) advantages.

    The reference computes in float32 (`dtype`); float64 gives the same algorithm without
    its rounding, to tell a difference in method from one in precision."""
    group = np.asarray(group)
    traj = np.asarray(traj)
    step_rewards = discounted_returns(reward, traj, gamma, dtype)
    episode_reward = defaultdict(float)
    for uid, r in zip(traj, reward):
        episode_reward[uid] += float(r)
    invalid = torch.tensor([0.0 if v else 1.0 for v in valid], dtype=dtype)
    scores = torch.tensor([episode_reward[uid] for uid in traj], dtype=dtype) - penalty_coef * invalid
    step_rewards = step_rewards - penalty_coef * invalid
    anchors = np.empty(len(anchor), dtype=object)
    anchors[:] = list(anchor)
    return hgpo_advantage_estimate(
        scores, step_rewards, anchors, group, traj, history_length,
        mode=mode, length_weight_alpha=alpha, base_group=base_group, dtype=dtype, exact_mean=exact_mean,
    )  # fmt: skip
