"""GRPOTrainer's advantage of a one-step episode: a plain prompt's completion, scored by `reward_funcs`.

    advantages = grpo_advantages(rewards_per_func, weights, group_size, scale_rewards, aggregation)

A dataset of prompts with `reward_funcs` and no env is, to `BiPACETrainer`, a set of one-step
episodes (`tool_envs.PromptAdapter`). Its only state is the prompt, which the whole group shares,
so every step-level estimator's step term would repeat the episode term: the advantage is
GRPOTrainer's own instead, by the formula of TRL 1.16's `_generate_and_score_completions`, with
`rewards_per_func` over every rank's rows (groups of `group_size` consecutive rows):

- `multi_objective_aggregation="sum_then_normalize"` (TRL's default): R_i = Σ_k w_k r_ik (NaN
  terms left out), A_i = R_i − mean_group(R), divided by std_group(R) + 1e-4 for
  `scale_rewards="group"`, by std_batch(R) + 1e-4 for `"batch"`, not divided for `"none"`;
- `"normalize_then_sum"` (GDPO): each r_k is normalised within its group, (r_k − mean) / (std + 1e-4),
  their weighted sum S_i is then normalised over the batch, (S_i − mean(S)) / (std(S) + 1e-4);
- a row whose every reward is NaN (every function returned None) is unscorable: advantage 0.

Standard deviations are TRL's `nanstd` (unbiased).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from trl.trainer.utils import nanstd

__all__ = ["grpo_advantages", "one_step_estimate", "SCALE_REWARDS", "AGGREGATIONS"]

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_EPS = 1e-4  # TRL's


def grpo_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """(N, K) unweighted rewards (NaN: the function returned None), (K,) weights → (N,) advantages.

    N must be a multiple of `group_size`; rows i·G … i·G+G−1 are one group. See the module docstring."""
    if rewards_per_func.dim() != 2 or weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(f"rewards_per_func must be (N, K) and weights (K,); got {tuple(rewards_per_func.shape)}, "
                         f"{tuple(weights.shape)}.")
    if rewards_per_func.shape[0] % group_size:
        raise ValueError(f"{rewards_per_func.shape[0]} rows do not split into groups of {group_size}.")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} must be one of {SCALE_REWARDS}.")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} must be one of {AGGREGATIONS}.")
    if not rewards_per_func.is_floating_point():
        rewards_per_func = rewards_per_func.float()  # TRL's are float32; a float64 table stays float64
    weights = weights.to(rewards_per_func)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        grouped = rewards.view(-1, group_size)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + _EPS)
    else:
        grouped = rewards_per_func.view(-1, group_size, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean_k)
        normalised = ((grouped - mean_k) / (std_k + _EPS)).view(-1, rewards_per_func.shape[1])
        rewards = (normalised * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + _EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def one_step_estimate(
    rollout, estimate, reward_func_names: Sequence[str], reward_weights: torch.Tensor, group_size: int,
    scale_rewards: str, aggregation: str, gather: Callable[[torch.Tensor], torch.Tensor] | None = None, rank: int = 0,
):
    """`estimate` (a `StepEstimate` of `rollout`, one step per episode) with GRPOTrainer's advantage in
    place (`grpo_advantages`) over every rank's episodes (`gather`: this rank's (n, K) rows → every
    rank's, in rank order; None on one process), and its `advantage/*` diagnostics made again. An
    episode's rewards are its `reward_terms` (unweighted, by reward function); a failed one's are NaN."""
    nan = float("nan")
    rows = [[nan if e.failed else e.reward_terms.get(name, nan) for name in reward_func_names] for e in rollout.episodes]
    local = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(reward_func_names))
    every = gather(local) if gather is not None else local
    advantages = grpo_advantages(every, reward_weights.cpu(), group_size, scale_rewards, aggregation)
    start = rank * len(rows)
    by_traj = {e.traj: advantages[start + j] for j, e in enumerate(rollout.episodes)}
    estimate.advantage = torch.stack([by_traj[s.traj] for s in rollout.steps]) if rollout.steps else torch.zeros(0)
    adv = estimate.advantage.double()
    q25, q75 = (torch.quantile(adv, torch.tensor([0.25, 0.75], dtype=adv.dtype)).tolist() if adv.numel() else (0.0, 0.0))
    estimate.diagnostics.update({
        "advantage/mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "advantage/iqr": q75 - q25,
        "advantage/episode_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
    })
    return estimate
