"""Returns and the episode-level (GRPO) advantage (docs/concepts/math.md#step-returns, docs/concepts/math.md#episode-advantage).

All functions are pure and vectorised over the whole batch: no Python loop over
trajectories or steps.

Trajectory ends. A trajectory ends because the env ended it (terminated: success or
failure, nothing follows, R_L = 0) or because the turn budget ran out (truncated,
`StepBatch.truncated`: the task went on, and its value after the cut is unknown).
GiGPO's returns treat both as terminal; that stays the default, so `gigpo` computes
its reference's returns. With `bootstrap_truncated` the estimator tells them apart, as rlax and
torchrl separate the end of a trajectory from the end of an episode:

    R_t = r_t + γ R_{t+1},   R_L = 0                   terminated
                             R_L = V̄(s_{L-1})         truncated

V̄ is the value proxy of the gae baseline (docs/concepts/math.md#gae), the mean env return-to-go of a
cell, taken here from the terminal returns and over the cell of the last step: s_L is
never observed (no step was taken there), so the last observed state stands in for it.
The bootstrap changes every return of the trajectory (γ^{L-t} V̄), hence every step
baseline, and GAE's δ_{L-1} = r_{L-1} + γ V̄(s_L) - V̄(s_{L-1}) with V̄(s_L) = R_L.
The episode return R^ep (docs/concepts/math.md#episode-advantage) is the rewards the episode got and is never
bootstrapped. The invalid-action penalty is not a reward: it stays out of V̄ and the
bootstrap, and is subtracted after the recursion as always.
"""

from __future__ import annotations

import torch

from .records import BatchLayout, segment_mean_std, zero_mean_residue

__all__ = [
    "discounted_cumsum_grid",
    "discounted_cumsum",
    "step_returns",
    "episode_returns",
    "episode_advantage",
    "truncation_value",
    "EPS",
]

EPS = 1e-6  # the 1e-6 of every (x - mean) / (std + 1e-6) on docs/concepts/math.md


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
    reward: torch.Tensor,
    valid: torch.Tensor,
    layout: BatchLayout,
    gamma: float,
    invalid_penalty: float,
    *,
    next_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return-to-go R_t = r_t + γ R_{t+1}, minus `invalid_penalty` on invalid steps (docs/concepts/math.md#step-returns).

    The penalty is subtracted *after* the recursion, as GiGPO does: it hits that step
    only and is not propagated back to earlier steps. The recursion ends with R_L = 0
    (terminal), or with the value after a truncated last step (module docstring).

    Args:
        reward: (N,) float64 env rewards; valid: (N,) bool.
        next_value: (N,) float64 R_L on the last step of a truncated trajectory and 0
            elsewhere (`truncation_value`); None: every trajectory ends with R_L = 0.
    Returns:
        (N,) float64 step returns.
    """
    if next_value is not None:  # R_{L-1} = r_{L-1} + γ R_L, and the recursion carries γ R_L back
        reward = reward + gamma * next_value
    returns = discounted_cumsum(reward, layout, gamma)
    return returns - invalid_penalty * (~valid).to(returns.dtype)


def truncation_value(
    terminal_returns: torch.Tensor, cell: torch.Tensor, num_cells: int, truncated: torch.Tensor
) -> torch.Tensor:
    """R_L of each truncated trajectory: V̄(s_{L-1}) = mean_C R over its last step's cell
    (docs/concepts/math.md#truncation).

    Args:
        terminal_returns: (N,) float64 env return-to-go with R_L = 0 (no penalty).
        cell: (N,) int64 cell of each step in [0, num_cells); truncated: (N,) bool,
            True on the last step of a trajectory the turn budget cut.
    Returns:
        (N,) float64: that value on truncated steps, 0 elsewhere (`step_returns`' next_value).
    """
    _, value, _ = segment_mean_std(terminal_returns, cell, num_cells)
    return torch.where(truncated, value[cell], torch.zeros_like(terminal_returns))


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
    # exactly 0 for a score equal to the mean: HGPO's base item is dropped then
    centred = zero_mean_residue(score - mean[index], score, index, num_segments)
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
    """Episode-level group-relative advantage A^ep, broadcast to every step (docs/concepts/math.md#episode-advantage).

    episode_stats="trajectory" (default): within each task group, over its G
    trajectories, A^ep_i = (R^ep_i - mean) / (std + 1e-6) for norm="mean_std" (unbiased
    std) or R^ep_i - mean for norm="mean"; a group holding one trajectory gets 0.

    episode_stats="steps" (GiGPO reference compatibility, docs/concepts/math.md#episode-stats-steps): each step row scores
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
