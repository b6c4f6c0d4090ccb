"""Returns and the episode-level (GRPO) advantage: SPEC §2 and §3.

All functions are pure and vectorised over the whole batch: no Python loop over
trajectories or steps.
"""

from __future__ import annotations

import torch

from .records import BatchLayout, segment_mean_std

__all__ = [
    "discounted_cumsum_grid",
    "discounted_cumsum",
    "step_returns",
    "episode_returns",
    "episode_advantage",
    "EPS",
]

EPS = 1e-6  # the 1e-6 of every (x - mean) / (std + 1e-6) in the SPEC


def discounted_cumsum_grid(grid: torch.Tensor, discount: float) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last axis of `grid` (n, T):
    y[:, t] = sum_{u >= t} discount**(u - t) grid[:, u].

    A doubling scan: after the pass with offset k, y[:, t] sums the 2k values from t on,
    so ceil(log2 T) elementwise passes cover every trajectory. Elementwise, so identical
    rows give bit-identical sums: a BLAS product (x @ discount matrix) may round
    identical rows differently (block vs tail rows), and a group of equal returns would
    then leave a rounding residue that the std normalisation blows up to ~1e-10.
    """
    out, offset = grid, 1
    while offset < grid.shape[-1]:
        shifted = torch.nn.functional.pad(out[:, offset:], (0, offset))
        out = out + discount**offset * shifted
        offset *= 2
    return out


def discounted_cumsum(values: torch.Tensor, layout: BatchLayout, discount: float) -> torch.Tensor:
    """Per-trajectory reverse discounted sum y_t = x_t + discount · y_{t+1}, y_L = 0.

    Computed on the padded (num_traj, T) grid, all trajectories at once
    (`discounted_cumsum_grid`), with no division by discount**t.

    Args:
        values: (N,) float64 per-step values.
    Returns:
        (N,) float64, in the batch's step order.
    """
    return layout.from_grid(discounted_cumsum_grid(layout.to_grid(values), discount))


def step_returns(
    reward: torch.Tensor, valid: torch.Tensor, layout: BatchLayout, gamma: float, invalid_penalty: float
) -> torch.Tensor:
    """Return-to-go R_t = r_t + γ R_{t+1}, minus `invalid_penalty` on invalid steps (SPEC §2).

    The penalty is subtracted *after* the recursion, as GiGPO does: it hits that step
    only and is not propagated back to earlier steps.

    Args:
        reward: (N,) float64 env rewards; valid: (N,) bool.
    Returns:
        (N,) float64 step returns.
    """
    returns = discounted_cumsum(reward, layout, gamma)
    return returns - invalid_penalty * (~valid).to(returns.dtype)


def episode_returns(reward: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """R^ep: undiscounted sum of env rewards per trajectory, (num_traj,) float64.

    Summed along each trajectory's row of the (num_traj, T) grid (the undiscounted
    return-to-go at t = 0), whatever the order of the batch's rows: identical
    trajectories get bit-identical returns.
    """
    if layout.max_length == 0:  # no steps, hence no trajectories
        return reward.new_zeros(0)
    return discounted_cumsum_grid(layout.to_grid(reward), 1.0)[:, 0]


def _normalise(score, index, num_segments, norm, *, singleton_score):
    count, mean, std = segment_mean_std(score, index, num_segments)
    centred = score - mean[index]
    if norm == "mean_std":
        centred = centred / (std[index] + EPS)
    alone = count[index] < 2
    return torch.where(alone, singleton_score, centred)


def episode_advantage(
    reward: torch.Tensor,
    valid: torch.Tensor,
    layout: BatchLayout,
    *,
    norm: str = "mean_std",
    episode_stats: str = "trajectory",
    invalid_penalty: float = 0.0,
) -> torch.Tensor:
    """Episode-level group-relative advantage A^ep, broadcast to every step (SPEC §3).

    episode_stats="trajectory" (default): within each task group, over its G
    trajectories, A^ep_i = (R^ep_i - mean) / (std + 1e-6) for norm="mean_std" (unbiased
    std) or R^ep_i - mean for norm="mean"; a group holding one trajectory gets 0.

    episode_stats="steps" (GiGPO reference compatibility): each step row scores
    R^ep of its trajectory minus its own invalid-action penalty, and the statistics run
    over the rows of the group (long trajectories weigh more). A group of one row
    keeps its raw score (mean 0, std 1), as the reference does.

    Args:
        reward: (N,) float64 env rewards; valid: (N,) bool.
    Returns:
        (N,) float64 A^ep per step.
    """
    if norm not in ("mean", "mean_std"):
        raise ValueError(f"norm={norm!r}: use 'mean' or 'mean_std'.")
    ret = episode_returns(reward, layout)
    if episode_stats == "trajectory":
        per_traj = _normalise(ret, layout.traj_group, layout.num_groups, norm, singleton_score=torch.zeros_like(ret))
        return per_traj[layout.traj_index]
    if episode_stats == "steps":
        score = ret[layout.traj_index] - invalid_penalty * (~valid).to(ret.dtype)
        raw = score / (1.0 + EPS) if norm == "mean_std" else score
        return _normalise(score, layout.group_index, layout.num_groups, norm, singleton_score=raw)
    raise ValueError(f"episode_stats={episode_stats!r}: use 'trajectory' or 'steps' (GiGPO compatibility).")
