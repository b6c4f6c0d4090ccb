"""Axis 2 of the estimator design: the step baseline (docs/concepts/math.md#step-baseline).

Each function compares a step's return with its cell and returns A^s, one value per
step. Let C be the cell of step i, R the step returns (N,). Common to all: a
singleton cell (|C| = 1) gets A^s = 0, since nothing is compared.

    mean       A^s_i = R_i - mean_C R                  (÷ (std_C + 1e-6) if mean_std)
    pace_q     A^s_i = Q̂(a_i) - V̂,  Q̂(a) = mean{R_j : j∈C, key_j = a}, V̂ = mean_C R
               (with evidence: × n_a / (n_a + κ), the cell's variance gate optional)
    pace_diff  A^s_i = R_i - mean{R_j : j∈C, key_j ≠ key_i}
    gae        GAE over the grouped value proxy V̄(s) = mean_C R, normalised per group
    hierarchy  HGPO: one advantage per context level k, a weighted mean of the levels

`pace_q` and `pace_diff` fall back to leave-one-out, R_i - mean_{j∈C, j≠i} R_j, when
their action-side comparison is empty (one distinct key in the cell, or no
different-key peer). Everything is a handful of segment reductions: no loop over
steps, cells or groups.

`gae` in full (GAGPO; `grouped_gae`, then `gae_baseline`), with p_t the invalid-action
penalty of step t (docs/concepts/math.md#step-returns) and R^env the env return-to-go (no penalty):

    V̄(s)  = mean_C R^env                   value proxy over the cell of s
    δ_t    = r_t + γ V̄(s_{t+1}) - V̄(s_t)   V̄(s_L) = 0 at the end (or R_L, `returns`)
    Â_t    = Σ_k (γλ)^k δ_{t+k} - (p_t - mean_C p)
    A^s_t  = (Â_t - μ_B) / (σ_B + 1e-6)    over the task group B's shared steps

The penalty is not a reward: it enters the invalid step's own Â once, centred on its
cell like every other baseline's, and no δ (a penalty inside r_t would hand the step
*before* an invalid action a net bonus of γ(1-λ)p). At λ = 1 the sum telescopes to
Â_t = R_t - mean_C R with the penalised returns R, as for `mean` without the std.
`gae_baseline` returns these terms per step too (`GaeTerms`: V̄, δ, the discounted sum, the
centred penalty, μ_B, σ_B), so a rollout dump shows how each step's A^s came about.

`hierarchy` in full (HGPO; `hierarchy_baseline`), over the levels G_0 ⊇ ... ⊇ G_K of a
`LevelledPartition` (a flat partition is one level), for the levels step i has (k <= t):

    a_k(i) = R_i - mean_{G_k(i)} R                 (÷ (σ_k + 1e-6), population σ, mean_std)
    S(i)   = {k : |G_k(i)| > 1, and a_k(i) != 0 when drop_zero_levels}
    A^s_i  = Σ_{k∈S} w_k a_k(i) / (Σ_{k∈S} w_k + 1e-6),   w_k = (k+2)^α  ("k+2") or (k+1)^α ("k+1")

with `base_group` adding A^ep_i as one more item of weight 1, and A^s = 0 when S is
empty. `level_baseline` swaps a_k for another baseline on the level's cells (`pace_q`,
`pace_diff`). verl-agent's `core_hgpo.py` uses (k+2)^α and drops exact zeros: the
defaults; the paper writes (k+1)^α and drops nothing.

Singletons under `gae`: a step alone in its cell gets A^s = 0 and is left out of μ_B
and σ_B, but its V̄ (its own return) still enters the δ of its predecessor in the
trajectory, so a singleton successor still moves the step before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .partition import LevelledPartition, Partition
from .records import BatchLayout, segment_mean_std, segment_reference, segment_sum, zero_mean_residue
from .returns import EPS, discounted_cumsum_grid

__all__ = [
    "BaselineResult",
    "GaeTerms",
    "LevelDetail",
    "mean_baseline",
    "pace_q_baseline",
    "pace_diff_baseline",
    "gae_baseline",
    "grouped_gae",
    "hierarchy_baseline",
    "level_weights",
    "BASELINES",
    "LEVEL_BASELINES",
]

# PACE branch codes reported in the diagnostics.
BRANCH_PACE, BRANCH_LOO, BRANCH_SINGLETON = 0, 1, 2


@dataclass
class LevelDetail:
    """What `hierarchy_baseline` did per step and level: (N, K+1) tensors, column k = level k.

    Attributes:
        cell: the step's cell at level k, -1 where it has no level k (t < k).
        size: that cell's size (0 where absent).
        advantage: a_k, float64 (0 where absent or alone).
        used: the level entered the weighted mean.
    """

    cell: torch.Tensor
    size: torch.Tensor
    advantage: torch.Tensor
    used: torch.Tensor


@dataclass
class GaeTerms:
    """What `gae_baseline` computed per step, (N,) each (module docstring, "gae in full"), so a
    reader of a dump can redo the step's A^s from its own row and its trajectory's:

        delta          = reward + γ next_value - value
        discounted_sum = Σ_k (γλ)^k delta_{t+k}
        A^s            = (discounted_sum - penalty - group_mean) / (group_std + 1e-6)  if shared, else 0

    Attributes:
        value: V̄(s_t), float64, the mean env return-to-go R^env of the step's cell.
        next_value: V̄(s_{t+1}), float64; after the last step 0, or R_L when a truncated
            trajectory is bootstrapped (`bootstrap_truncated`).
        delta: δ_t, float64, the TD residual.
        discounted_sum: G_t = δ_t + γλ G_{t+1}, float64.
        penalty: p_t - mean_C p, float64, the invalid-action penalty centred on the cell (Â_t = G_t - penalty).
        group_mean, group_std: μ_B and σ_B, float64, of Â over the shared steps of the task group.
        shared: bool, the cell holds other steps; a step alone gets A^s = 0 and stays out of μ_B, σ_B.
    """

    value: torch.Tensor
    next_value: torch.Tensor
    delta: torch.Tensor
    discounted_sum: torch.Tensor
    penalty: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    shared: torch.Tensor


@dataclass
class BaselineResult:
    """A^s (N,) float64, and for PACE the branch each step took (N,) int64 or None."""

    advantage: torch.Tensor
    branch: torch.Tensor | None = None
    keys_per_cell: torch.Tensor | None = None  # (num_cells,) distinct action keys
    levels: LevelDetail | None = None  # per-level detail of `hierarchy`
    gae: GaeTerms | None = None  # per-step terms of `gae`


def _divide_by_cell_std(centred, std, cell):
    return centred / (std[cell] + EPS)


def _leave_one_out(returns, cell_sum, cell_count):
    """R_i - mean of the other members of i's cell; (N,), cells of size >= 2 only."""
    return returns - (cell_sum - returns) / (cell_count - 1).clamp(min=1)


def mean_baseline(returns: torch.Tensor, partition: Partition, *, norm: str = "mean_std", **_) -> BaselineResult:
    """GiGPO's step-relative advantage: R_i - mean_C R, optionally ÷ (std_C + 1e-6)
    (docs/concepts/math.md#mean-baseline).

    Args:
        returns: (N,) float64 step returns; partition: cells of the batch.
        norm: "mean" or "mean_std" (unbiased std).
    """
    count, mean, std = segment_mean_std(returns, partition.cell, partition.num_cells)
    advantage = returns - mean[partition.cell]
    if norm == "mean_std":
        advantage = _divide_by_cell_std(advantage, std, partition.cell)
    return BaselineResult(torch.where(count[partition.cell] > 1, advantage, torch.zeros_like(advantage)))


def _action_subcells(partition: Partition, action_key: torch.Tensor):
    """Sub-cells = distinct (cell, action key) pairs. Returns (subcell (N,), subcell→cell, keys per cell)."""
    if action_key is None:
        raise ValueError("PACE baselines need StepBatch.action_key (the normalised action of each step).")
    _, key_dense = torch.unique(action_key, return_inverse=True)
    num_keys = int(key_dense.max()) + 1 if key_dense.numel() else 1
    pair, subcell = torch.unique(partition.cell * num_keys + key_dense, return_inverse=True)
    subcell_cell = torch.div(pair, num_keys, rounding_mode="floor")
    keys_per_cell = torch.bincount(subcell_cell, minlength=partition.num_cells)
    return subcell, subcell_cell.shape[0], keys_per_cell


def _evidence_weight(returns, cell, num_cells, mean, n_a, q_hat, evidence, variance_gate):
    """PACE-Q's evidence weight of each step (N,) (docs/concepts/math.md#pace-evidence):

        n_a / (n_a + κ)                     the shrinkage of Q̂(a) toward V̂ by κ pseudo-counts
        × SS_between / SS_total             with the variance gate: the share of the cell's
                                            spread that its actions explain (0 in a cell of equal returns)
    """
    weight = n_a / (n_a + evidence)
    if variance_gate:
        between = segment_sum((q_hat - mean[cell]) ** 2, cell, num_cells)
        total = segment_sum((returns - mean[cell]) ** 2, cell, num_cells)
        gate = torch.where(total > 0, between / total.clamp(min=torch.finfo(total.dtype).tiny), torch.zeros_like(total))
        weight = weight * gate[cell]
    return weight


def _pace(returns, partition, action_key, norm, peer_mean_fn, fallback_when, evidence=0.0, variance_gate=False):
    cell = partition.cell
    # Every PACE comparison is a difference of means within one cell, unchanged by a
    # shift per cell; shifting by a member's return makes a cell of equal returns all 0.
    returns = returns - segment_reference(returns, cell, partition.num_cells)[cell]
    count, mean, std = segment_mean_std(returns, cell, partition.num_cells)
    cell_sum = mean * count
    subcell, num_subcells, keys_per_cell = _action_subcells(partition, action_key)
    sub_count = torch.bincount(subcell, minlength=num_subcells).to(returns.dtype)
    sub_sum = segment_sum(returns, subcell, num_subcells)
    n_i, s_i = count[cell], cell_sum[cell]
    pace = peer_mean_fn(returns, n_i, s_i, sub_count[subcell], sub_sum[subcell], mean[cell])
    if evidence or variance_gate:
        q_hat = (sub_sum / sub_count.clamp(min=1))[subcell]
        n_a = sub_count[subcell]
        pace = pace * _evidence_weight(returns, cell, partition.num_cells, mean, n_a, q_hat, evidence, variance_gate)
    loo = _leave_one_out(returns, s_i, n_i)
    use_loo = fallback_when(n_i, sub_count[subcell], keys_per_cell[cell])
    advantage = torch.where(use_loo, loo, pace)
    if norm == "mean_std":
        advantage = _divide_by_cell_std(advantage, std, cell)
    singleton = n_i < 2
    advantage = torch.where(singleton, torch.zeros_like(advantage), advantage)
    branch = torch.full_like(cell, BRANCH_PACE)
    branch = torch.where(use_loo, BRANCH_LOO, branch)
    branch = torch.where(singleton, BRANCH_SINGLETON, branch)
    return BaselineResult(advantage, branch, keys_per_cell)


def pace_q_baseline(
    returns: torch.Tensor,
    partition: Partition,
    *,
    action_key: torch.Tensor,
    pace_norm: str = "mean",
    pace_evidence: float = 0.0,
    pace_variance_gate: bool = False,
    **_,
) -> BaselineResult:
    """BiPACE_Q (docs/concepts/math.md#pace-q): A^s_i = Q̂(a_i) - V̂ with Q̂ the mean return of i's action key in its cell
    (i included) and V̂ the cell mean; leave-one-out when the cell has one distinct key.

    With evidence (docs/concepts/math.md#pace-evidence), the PACE branch is
    w_i · (Q̂(a_i) - V̂), w_i = n_a / (n_a + κ) (× SS_between / SS_total of the cell with the gate):
    Q̂(a) shrunk toward V̂ by κ pseudo-counts, so an action seen once moves its step less than
    one seen four times. The leave-one-out fallback is left as it is.

    Args:
        returns: (N,) float64; action_key: (N,) int64 ids.
        pace_norm: "mean" (default, the paper does not publish a std) or "mean_std".
        pace_evidence: κ >= 0, pseudo-counts at V̂ (0: plain PACE-Q).
        pace_variance_gate: weigh each cell by the share of its return spread its actions explain.
    """
    return _pace(
        returns,
        partition,
        action_key,
        pace_norm,
        peer_mean_fn=lambda r, n, s, n_a, s_a, v: s_a / n_a - v,
        fallback_when=lambda n, n_a, keys: keys < 2,
        evidence=pace_evidence,
        variance_gate=pace_variance_gate,
    )


def pace_diff_baseline(
    returns: torch.Tensor, partition: Partition, *, action_key: torch.Tensor, pace_norm: str = "mean", **_
) -> BaselineResult:
    """BiPACE's diff-peer mean (docs/concepts/math.md#pace-diff): A^s_i = R_i - mean{R_j : j∈C, key_j ≠ key_i};
    leave-one-out when i has no different-key peer in its cell."""
    return _pace(
        returns,
        partition,
        action_key,
        pace_norm,
        peer_mean_fn=lambda r, n, s, n_a, s_a, v: r - (s - s_a) / (n - n_a).clamp(min=1),
        fallback_when=lambda n, n_a, keys: n_a >= n,
    )


def _gae_pieces(env_returns, partition, layout, gamma, lam, penalty):
    """`grouped_gae`'s terms, (N,) each: V̄(s_t), δ_t, G_t and the centred penalty p_t - mean_C p."""
    cell = partition.cell
    _, value, _ = segment_mean_std(env_returns, cell, partition.num_cells)
    # δ_t = (R_t - V̄_t) - γ (R_{t+1} - V̄_{t+1}), the same sum grouped so that a cell
    # whose returns all equal its mean contributes exactly 0
    excess = layout.to_grid(env_returns - value[cell])
    delta = excess - gamma * torch.nn.functional.pad(excess[:, 1:], (0, 1))
    discounted_sum = layout.from_grid(discounted_cumsum_grid(delta, gamma * lam))
    centred = torch.zeros_like(env_returns)
    if penalty is not None and bool(penalty.any()):
        _, mean_penalty, _ = segment_mean_std(penalty, cell, partition.num_cells)
        centred = penalty - mean_penalty[cell]  # exactly 0 in a cell of equal penalties
    return value[cell], layout.from_grid(delta), discounted_sum, centred


def grouped_gae(
    env_returns: torch.Tensor,
    partition: Partition,
    layout: BatchLayout,
    gamma: float,
    lam: float,
    penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """GAGPO's GAE over the grouped value proxy, before normalisation (docs/concepts/math.md#gae):

        V̄(s_t)  = mean_C R^env                     (0 after the last step)
        δ_t     = r_t + γ V̄(s_{t+1}) - V̄(s_t)
        G_t     = δ_t + γλ G_{t+1}                  (G_L = 0)
        Â_t     = G_t - (p_t - mean_C p)           (the penalty outside the recursion)

    r_t is the reward implied by the returns, R^env_t - γ R^env_{t+1}, so a truncated
    trajectory's bootstrap R_L (`returns.step_returns`) is its V̄(s_L). With λ = 1 the
    sum telescopes to Â_t = R_t - mean_C R for the penalised returns R = R^env - p.

    Args:
        env_returns: (N,) float64 step returns without the penalty, R^env.
        penalty: (N,) float64 p, the invalid-action penalty of each step (0 if valid);
            None: no penalty (then any returns may be passed, e.g. already penalised).
    Returns:
        (N,) float64 Â.
    """
    _, _, discounted_sum, centred = _gae_pieces(env_returns, partition, layout, gamma, lam, penalty)
    return discounted_sum - centred


def _next_value(value: torch.Tensor, layout: BatchLayout, next_value: torch.Tensor | None) -> torch.Tensor:
    """V̄(s_{t+1}) per step: the next step's V̄ along the trajectory; after the last step the
    bootstrap R_L of a truncated trajectory (`next_value`, 0 elsewhere), else 0."""
    grid = layout.to_grid(value)
    following = layout.from_grid(torch.nn.functional.pad(grid[:, 1:], (0, 1)))
    return following if next_value is None else following + next_value


def gae_baseline(
    returns: torch.Tensor,
    partition: Partition,
    *,
    layout: BatchLayout,
    gamma: float,
    lam: float,
    penalty: torch.Tensor | None = None,
    env_returns: torch.Tensor | None = None,
    next_value: torch.Tensor | None = None,
    **_,
) -> BaselineResult:
    """GAGPO: `grouped_gae`, then A^s = (Â - μ_B) / (σ_B + 1e-6) within each task group B.

    Singleton steps get 0 (docs/concepts/math.md#gae) and are left out of μ_B and σ_B (unbiased std);
    they still enter their predecessor's δ through V̄ (module docstring).

    Args:
        returns: (N,) float64 step returns R = R^env - p; layout: the batch layout.
        penalty: (N,) float64 invalid-action penalty p of each step, or None (no penalty).
        env_returns: (N,) float64 R^env, exact (the estimator passes it); None: R + p.
        next_value: (N,) float64 R_L on the last step of a bootstrapped truncated trajectory,
            0 elsewhere (`returns.truncation_value`), or None; R^env already holds it, so it
            only names V̄(s_L) in the terms (`GaeTerms.next_value`).
    Returns:
        `BaselineResult` with `gae` (`GaeTerms`).
    """
    if env_returns is None:
        env_returns = returns if penalty is None else returns + penalty
    value, delta, discounted_sum, centred = _gae_pieces(env_returns, partition, layout, gamma, lam, penalty)
    gae = discounted_sum - centred
    shared = partition.step_cell_size() > 1
    group = layout.group_index
    _, group_mean, group_std = segment_mean_std(gae[shared], group[shared], layout.num_groups)
    normalised = (gae - group_mean[group]) / (group_std[group] + EPS)
    terms = GaeTerms(
        value, _next_value(value, layout, next_value), delta, discounted_sum, centred,
        group_mean[group], group_std[group], shared,
    )  # fmt: skip
    return BaselineResult(torch.where(shared, normalised, torch.zeros_like(normalised)), gae=terms)


def hgpo_level_mean(returns: torch.Tensor, partition: Partition, *, norm: str = "mean_std", **_) -> BaselineResult:
    """HGPO's per-level advantage: R_i - mean_C R, ÷ (population std_C + 1e-6) for mean_std
    (`mean_baseline` divides by the unbiased std, as GiGPO's code does; HGPO's does not)."""
    count, mean, std = segment_mean_std(returns, partition.cell, partition.num_cells)
    # a return equal to its cell's mean gives a_k = 0 exactly, which `drop_zero_levels` drops
    advantage = zero_mean_residue(returns - mean[partition.cell], returns, partition.cell, partition.num_cells)
    if norm == "mean_std":
        population = std * ((count - 1).clamp(min=0) / count.clamp(min=1)).sqrt()
        advantage = _divide_by_cell_std(advantage, population, partition.cell)
    return BaselineResult(torch.where(count[partition.cell] > 1, advantage, torch.zeros_like(advantage)))


def level_weights(depth: int, alpha: float, offset: int) -> torch.Tensor:
    """(K+1,) float64 weights w_k = (k + offset)^α of the levels k = 0..K: offset 2 is
    verl-agent's code ((k+2)^α: 2:3:4 at K = 2, α = 1), offset 1 the paper's ((k+1)^α)."""
    return (torch.arange(depth + 1, dtype=torch.float64) + offset) ** alpha


def hierarchy_baseline(
    returns: torch.Tensor,
    partition: Partition,
    *,
    norm: str = "mean_std",
    level_baseline: str = "mean",
    level_alpha: float = 1.0,
    level_weight_offset: int = 2,
    drop_zero_levels: bool = True,
    base_group: bool = False,
    episode_advantage: torch.Tensor | None = None,
    **kwargs,
) -> BaselineResult:
    """HGPO (docs/concepts/math.md#hgpo): per-level advantages over nested context cells, combined by fixed weights
    (module docstring, "hierarchy in full").

    Args:
        returns: (N,) float64 step returns; partition: a `LevelledPartition` (a flat
            `Partition` counts as its level 0 only).
        norm: "mean_std" or "mean", for the `mean` level baseline.
        level_baseline: the baseline of each level, a name in `LEVEL_BASELINES`; its
            other arguments (action_key, pace_norm) come through `kwargs`.
        level_alpha, level_weight_offset: w_k = (k + offset)^α (`level_weights`).
        drop_zero_levels: leave a level out of the mean when its a_k is exactly 0 (the code).
        base_group: add the episode advantage (N,) `episode_advantage` as an item of weight 1.
    Returns:
        `BaselineResult` with `levels` (`LevelDetail`).
    """
    if isinstance(partition, LevelledPartition):
        parts, reach = partition.levels, partition.reach
    else:
        parts, reach = (partition,), torch.zeros_like(partition.cell)
    level_fn = LEVEL_BASELINES[level_baseline]
    cells, sizes, advantages, used = [], [], [], []
    for k, part in enumerate(parts):
        present = reach >= k
        a = level_fn(returns, part, norm=norm, **kwargs).advantage
        a = torch.where(present, a, torch.zeros_like(a))
        size = torch.where(present, part.step_cell_size(), torch.zeros_like(part.cell))
        use = size > 1
        if drop_zero_levels:
            use &= a != 0
        cells.append(torch.where(present, part.cell, torch.full_like(part.cell, -1)))
        sizes.append(size)
        advantages.append(a)
        used.append(use)
    detail = LevelDetail(torch.stack(cells, 1), torch.stack(sizes, 1), torch.stack(advantages, 1), torch.stack(used, 1))
    weight = level_weights(len(parts) - 1, level_alpha, level_weight_offset)[None, :] * detail.used
    numerator = (weight * detail.advantage).sum(1)
    denominator = weight.sum(1)
    if base_group:
        if episode_advantage is None:
            raise ValueError("base_group=True needs the episode advantage (the estimator passes it).")
        base_used = episode_advantage != 0 if drop_zero_levels else torch.ones_like(detail.used[:, 0])
        numerator = numerator + torch.where(base_used, episode_advantage, torch.zeros_like(numerator))
        denominator = denominator + base_used.to(denominator.dtype)
    # as the reference: w / (Σ w + 1e-6); 0 when no level survives
    return BaselineResult(numerator / (denominator + EPS), levels=detail)


BASELINES = {
    "mean": mean_baseline,
    "pace_q": pace_q_baseline,
    "pace_diff": pace_diff_baseline,
    "gae": gae_baseline,
    "hierarchy": hierarchy_baseline,
}

# The baselines `hierarchy` can apply to each level: each compares a step with its own cell only
# (`gae` cannot: its value proxy follows the trajectory into the next step's cell).
LEVEL_BASELINES = {
    "mean": hgpo_level_mean,
    "pace_q": pace_q_baseline,
    "pace_diff": pace_diff_baseline,
}
