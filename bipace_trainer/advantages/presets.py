"""Presets and the one entry point, `compute_advantages` (docs/concepts/math.md#combination, #presets).

    A_i = w_ep · A^ep_i + w_step · A^s_i

A^ep is the episode-level group advantage (`returns.episode_advantage`); A^s is the
step baseline (`baselines.BASELINES`) over the cells of the state partition
(`partition`), applied to a step return (`step_return`: discounted, `returns`, or the
distance to the goal on the group's state graph, `graph`). A named method is only a set
of defaults over these knobs (step return discounted unless said):

    preset        partition  baseline   w_ep  importance ratio
    grpo          none       -          1     token
    gigpo         hash       mean       1     token
    bigpo         hidden     mean       1     token
    bipace_q      hidden     pace_q     1     token      (default)
    bipace_diff   hidden     pace_diff  1     token
    gagpo         hash       gae        0     sequence
    bigagpo       hidden     gae        0     sequence
    hgpo          hash, K=2  hierarchy  0     token      (levels: mean, as verl-agent)
    bihgpo        hidden,K=2 hierarchy  0     token      (levels: mean)
    bihpace_q     hidden,K=2 hierarchy  0     token      (levels: pace_q)
    graphgpo      hash       mean       1     token      (graph return, γ = 0.1)
    bigraphgpo    hidden     mean       1     token      (graph return over hidden clusters)
    beacon        segment    mean       1     token      (milestone return, BEACON's mean_norm)

Every knob stays settable: `resolve_settings("gigpo", advantage_norm="mean")` is GiGPO without
the std, as in its WebShop ablation. New values are registrations, not edits:
`partition.register_partition`, `baselines.BASELINES`, `register_preset`. The knobs themselves
(each declared once, with its flag's help) are `settings.EstimatorSettings`.
`StepAdvantageEstimator` is the one owner of ε for a partition that takes one ("auto":
calibrated, held, its fallback `max_cluster_eps` until then; `eps_in_use`).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .baselines import BASELINES, BRANCH_LOO, BRANCH_PACE, BRANCH_SINGLETON, GaeTerms, LevelDetail
from .graph import TransitionGraph, following_labels, graph_returns, known_state_cells, similar_labels, transition_graph
from .milestones import milestone_returns, with_plan_flags
from .partition import LevelledPartition, Partition, bisect_eps, context_partition
from .records import BatchLayout, StepBatch
from .returns import discounted_cumsum, episode_advantage, episode_returns, step_returns, truncation_value
from .settings import ESTIMATOR_FIELDS, LEVEL_WEIGHT_OFFSETS, EstimatorSettings, SettingsError

__all__ = [
    "EstimatorSettings",
    "SettingsError",
    "PRESETS",
    "register_preset",
    "resolve_settings",
    "compute_advantages",
    "estimate_advantages",
    "StepEstimate",
    "StepAdvantageEstimator",
]


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(step_partition="none", step_baseline=None, w_step=0.0),
    "gigpo": dict(step_partition="hash", step_baseline="mean"),
    "bigpo": dict(step_partition="hidden", step_baseline="mean"),
    "bipace_q": dict(step_partition="hidden", step_baseline="pace_q"),
    "bipace_diff": dict(step_partition="hidden", step_baseline="pace_diff"),
    "gagpo": dict(step_partition="hash", step_baseline="gae", w_ep=0.0, importance_sampling_level="sequence"),
    "bigagpo": dict(step_partition="hidden", step_baseline="gae", w_ep=0.0, importance_sampling_level="sequence"),
    "hgpo": dict(step_partition="hash", step_baseline="hierarchy", context_levels=2, w_ep=0.0),
    "bihgpo": dict(step_partition="hidden", step_baseline="hierarchy", context_levels=2, w_ep=0.0),
    "bihpace_q": dict(step_partition="hidden", step_baseline="hierarchy", level_baseline="pace_q", context_levels=2, w_ep=0.0),
    # GraphGPO's recipe/GraphGPO/config/graphgpo_trainer.yaml: γ 0.1, weights 1, mean_std, no merge
    "graphgpo": dict(step_partition="hash", step_baseline="mean", step_return="graph", step_gamma=0.1),
    "bigraphgpo": dict(step_partition="hidden", step_baseline="mean", step_return="graph", step_gamma=0.1),
    # BEACON's examples/migpo_trainer/run_webshop.sh and run_sciworld.sh: mode mean_norm, γ 0.95, weight 1,
    # threshold 0.95 (run_alfworld.sh: γ 0.9, weight 10; recipes/)
    "beacon": dict(
        step_partition="segment", step_baseline="mean", step_return="milestone", advantage_norm="mean",
        step_gamma=0.95, w_step=1.0, milestone_threshold=0.95,
    ),
}


def register_preset(name: str, **defaults: Any) -> None:
    """Add a named preset (a set of `EstimatorSettings` defaults)."""
    unknown = set(defaults) - set(ESTIMATOR_FIELDS)
    if unknown:
        raise ValueError(f"Preset {name!r} sets unknown fields {sorted(unknown)}.")
    EstimatorSettings(**defaults)  # validate now, not at first use
    PRESETS[name] = defaults


def resolve_settings(preset: str = "bipace_q", **overrides: Any) -> EstimatorSettings:
    """The preset's defaults with `overrides` on top; None-valued overrides are ignored (a config's
    `EstimatorOverrides` fields pass here as they are: None = the preset's value).

    Raises `SettingsError` (a ValueError) naming the field on an unknown preset, unknown
    field, or a contradictory combination (e.g. preset "grpo" with step_baseline="mean").
    """
    if preset not in PRESETS:
        raise SettingsError("preset", f"preset={preset!r} is unknown; choose one of {sorted(PRESETS)}.")
    unknown = set(overrides) - set(ESTIMATOR_FIELDS)
    if unknown:
        raise SettingsError(
            sorted(unknown)[0], f"Unknown estimator setting(s) {sorted(unknown)}; valid: {sorted(ESTIMATOR_FIELDS)}."
        )
    values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return EstimatorSettings(**values)
    except SettingsError as err:  # the field, its value and the fix; no dict dump
        raise SettingsError(err.field, f"{err} (preset={preset!r})") from None


def _build_partition(
    settings: EstimatorSettings, batch: StepBatch, layout: BatchLayout, eps: float | None, *, levels: bool = True
) -> Partition:
    """The partition's cells; with `context_levels` K > 0 (and `levels`), its K context levels."""
    kind = settings.partition_kind
    for name in sorted(kind.needs):
        if getattr(batch, name, None) is None:
            raise ValueError(
                f"step_partition={settings.step_partition!r} needs StepBatch.{name}; the rollout must record it for every step."
            )
    base = kind.build(batch, layout, eps)
    if levels and settings.context_levels:
        return context_partition(base, layout, settings.context_levels)
    return base


def _quantiles(values: torch.Tensor, *q: float) -> list[float]:
    """Several quantiles from one sort (each torch.quantile call sorts again)."""
    if not values.numel():
        return [0.0] * len(q)
    return torch.quantile(values, torch.tensor(q, dtype=values.dtype)).tolist()


def _diagnostics(settings, partition, step_result, advantage, ep_adv, step_adv, eps) -> dict[str, float]:
    adv = advantage.to(torch.float64)
    q25, q75 = _quantiles(adv, 0.25, 0.75)
    diag = {
        "advantage/mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "advantage/iqr": q75 - q25,
        "advantage/episode_abs_mean": float(ep_adv.abs().mean()) if adv.numel() else 0.0,
        "advantage/step_abs_mean": float(step_adv.abs().mean()) if adv.numel() else 0.0,
    }
    if partition is None:
        return diag
    sizes = partition.size.to(torch.float64)
    diag.update(
        {
            "estimator/singleton_rate": partition.singleton_rate(),
            "estimator/num_cells": float(partition.num_cells),
            "estimator/cell_size_mean": float(sizes.mean()) if sizes.numel() else 0.0,
            "estimator/cell_size_p90": _quantiles(sizes, 0.9)[0],
        }
    )
    if eps is not None:
        diag["estimator/cluster_eps"] = float(eps)
    if step_result.branch is not None:
        n = max(step_result.branch.numel(), 1)
        for name, code in (("pace", BRANCH_PACE), ("loo", BRANCH_LOO), ("singleton", BRANCH_SINGLETON)):
            diag[f"estimator/branch_{name}_frac"] = float((step_result.branch == code).sum()) / n
        diag["estimator/action_keys_per_cell"] = float(step_result.keys_per_cell.to(torch.float64).mean())
    if step_result.levels is not None:
        diag.update(level_diagnostics(step_result.levels))
    return diag


def level_diagnostics(levels: LevelDetail) -> dict[str, float]:
    """Per context level k: mean cell size (over the level's cells) and singleton rate (over
    the steps that have level k); the fraction of steps whose deepest surviving (used)
    level is k, and of steps with none (their A^s is 0, or the episode item alone)."""
    n, depth = levels.used.shape
    diag: dict[str, float] = {}
    used = levels.used
    deepest = torch.where(used.any(1), depth - 1 - used.flip(1).to(torch.int64).argmax(1), torch.full((n,), -1))
    for k in range(depth):
        present = levels.cell[:, k] >= 0
        size = levels.size[present, k].to(torch.float64)
        # each cell counted once: a step in a cell of size s carries 1/s of it
        num_cells = float((1.0 / size).sum()) if size.numel() else 0.0
        diag[f"hierarchy/level{k}/cell_size_mean"] = float(size.numel()) / num_cells if num_cells else 0.0
        diag[f"hierarchy/level{k}/singleton_rate"] = float((size == 1).to(torch.float64).mean()) if size.numel() else 0.0
        diag[f"hierarchy/deepest_level{k}_frac"] = float((deepest == k).sum()) / n if n else 0.0
    diag["hierarchy/no_level_frac"] = float((deepest < 0).sum()) / n if n else 0.0
    return diag


@dataclass
class StepEstimate:
    """A batch's advantages and, per step, what produced them (for trajectory logs).

    Attributes:
        advantage: (N,) float32, A_i = w_ep A^ep_i + w_step A^s_i.
        diagnostics: flat dict of floats (docs/concepts/math.md#diagnostics).
        step_return: (N,) float64 return-to-go R_t with the invalid-action penalty (docs/concepts/math.md#step-returns).
        cell: (N,) int64 cell of the state partition, or None without a step term.
        branch: (N,) int64 PACE branch (`BRANCH_PACE`, `BRANCH_LOO`, `BRANCH_SINGLETON`),
            or None for the other baselines.
        levels: per step and context level, cell, size, advantage and whether it was used
            (`baselines.LevelDetail`, (N, K+1) each) under `step_baseline="hierarchy"`; else None.
        gae: per step, the terms of GAGPO's advantage (V̄, δ, the discounted sum, the
            centred penalty, the group's μ and σ: `baselines.GaeTerms`) under `step_baseline="gae"`;
            else None.
        graph: under `step_return="graph"`, the groups' state graphs (`graph.TransitionGraph`:
            each step's node and reached node, every node's distance to the goal); else None.
    """

    advantage: torch.Tensor
    diagnostics: dict[str, float]
    step_return: torch.Tensor | None = None
    cell: torch.Tensor | None = None
    branch: torch.Tensor | None = None
    levels: LevelDetail | None = None
    gae: GaeTerms | None = None
    graph: TransitionGraph | None = None


def compute_advantages(
    batch: StepBatch, settings: EstimatorSettings, *, cluster_eps: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per step, A = w_ep A^ep + w_step A^s (docs/concepts/math.md#combination), and the diagnostics
    (docs/concepts/math.md#diagnostics).

    Args:
        batch: N flat step records (`StepBatch`).
        settings: estimator knobs (`resolve_settings`).
        cluster_eps: ε of a partition that takes one; defaults to `settings.cluster_eps`,
            calibrated on this batch when that is "auto", once per batch object (a second
            call on the same `StepBatch` reuses that ε; use `StepAdvantageEstimator` to
            calibrate once and hold ε fixed across batches, as the trainer does).
    Returns:
        advantages: (N,) float32, A_i = w_ep A^ep_i + w_step A^s_i.
        diagnostics: flat dict of floats (advantage stats, cell stats, PACE branches, timings).
    """
    estimate = _estimate_once(batch, settings, cluster_eps, per_step=False)
    return estimate.advantage, estimate.diagnostics


def estimate_advantages(
    batch: StepBatch, settings: EstimatorSettings, *, cluster_eps: float | None = None
) -> StepEstimate:
    """`compute_advantages` plus each step's return, cell, PACE branch, HGPO levels or GAE
    terms (`StepEstimate`); the advantages are the very same tensor values."""
    return _estimate_once(batch, settings, cluster_eps, per_step=True)


# id(StepBatch) -> {(partition, target rate, cap): ε calibrated on it}, while the batch lives
_CALIBRATED: dict[int, dict[tuple[str, float, float], float]] = {}


def _estimate_once(batch, settings, cluster_eps, per_step) -> StepEstimate:
    """ε as given, else as the settings say; "auto" is calibrated on this batch once: the ε is
    kept for the batch object while it lives (`_CALIBRATED`), so the presets and baselines a
    study compares on one batch share one calibration (15 clusterings) instead of repeating it.
    A new StepBatch (even of the same rows) calibrates afresh."""
    if cluster_eps is not None:
        return _estimate(batch, settings, float(cluster_eps) if settings.partition_kind.takes_eps else None, per_step)
    estimator = StepAdvantageEstimator(settings)
    if not estimator.needs_calibration:
        return estimator._run(batch, None, per_step)
    key = (settings.step_partition, float(settings.target_singleton_rate), float(settings.max_cluster_eps))
    start = time.perf_counter()
    known = _CALIBRATED.get(id(batch), {})
    if key not in known:
        estimator.calibrate(batch)
        if estimator.cluster_eps is not None:
            if id(batch) not in _CALIBRATED:  # forget it with the batch: ids are reused after that
                weakref.finalize(batch, _CALIBRATED.pop, id(batch), None)
            known = _CALIBRATED.setdefault(id(batch), {})
            known[key] = estimator.cluster_eps
    seconds = time.perf_counter() - start
    estimate = _estimate(batch, settings, known.get(key, estimator.eps_in_use), per_step)
    estimate.diagnostics["time/calibration_s"] = seconds
    return estimate


def _estimate(batch: StepBatch, settings: EstimatorSettings, eps: float | None, per_step: bool) -> StepEstimate:
    """The estimate at a fixed ε (None for a partition that takes none)."""
    start = time.perf_counter()
    layout = BatchLayout.from_batch(batch)
    if settings.uses_milestones:  # a static plan becomes flags here, by BEACON's match at the set threshold
        batch = with_plan_flags(batch, layout, settings.milestone_threshold)
    ep_adv = episode_advantage(
        batch.reward,
        batch.valid,
        layout,
        norm=settings.advantage_norm,
        episode_stats=settings.episode_stats,
        invalid_penalty=settings.invalid_action_penalty,
    )
    step_adv = torch.zeros_like(ep_adv)
    partition, step_result, returns, graph = None, None, None, None
    partition_seconds = 0.0
    if settings.has_step_term and len(batch):
        partition_start = time.perf_counter()
        partition = _build_partition(settings, batch, layout, eps)
        partition_seconds = time.perf_counter() - partition_start
        env_returns, penalty, next_value, graph = _returns(settings, batch, layout, partition)
        returns = env_returns - penalty
        step_result = BASELINES[settings.step_baseline](
            returns,
            partition,
            action_key=batch.action_key,
            norm=settings.advantage_norm,
            pace_norm=settings.pace_norm,
            pace_evidence=settings.pace_evidence,
            pace_variance_gate=settings.pace_variance_gate,
            layout=layout,
            gamma=settings.step_gamma,
            lam=settings.gae_lambda,
            penalty=penalty,
            env_returns=env_returns,
            next_value=next_value,
            episode_advantage=ep_adv,
            level_baseline=settings.level_baseline,
            level_alpha=settings.level_alpha,
            level_weight_offset=LEVEL_WEIGHT_OFFSETS[settings.level_weights],
            drop_zero_levels=settings.drop_zero_levels,
            base_group=settings.base_group,
        )
        step_adv = step_result.advantage
    else:
        eps = None  # no cells were built, so no ε was used
    advantage = settings.w_ep * ep_adv + settings.w_step * step_adv
    diagnostics = _diagnostics(settings, partition, step_result, advantage, ep_adv, step_adv, eps)
    if graph is not None:
        diagnostics.update(graph_diagnostics(graph, layout))
    if settings.uses_milestones and batch.milestone is not None and len(batch):
        reached = batch.milestone.to(torch.float64)
        diagnostics["milestone/per_episode"] = float(reached.sum()) / max(layout.num_traj, 1)
        diagnostics["milestone/step_frac"] = float(reached.mean())
    diagnostics["time/partition_s"] = partition_seconds
    diagnostics["time/estimator_s"] = time.perf_counter() - start
    estimate = StepEstimate(advantage.to(torch.float32), diagnostics)
    if per_step:
        _add_per_step(estimate, batch, layout, settings, returns, partition, step_result, graph)
    return estimate


def _add_per_step(estimate: StepEstimate, batch, layout, settings, returns, partition, step_result, graph) -> None:
    """What `per_step=True` adds to `estimate`: each step's return, cell, branch, levels, GAE terms and graph."""
    if returns is None:  # no step term computed them
        returns = step_returns(batch.reward, batch.valid, layout, settings.step_gamma, settings.invalid_action_penalty)
    estimate.step_return = returns
    estimate.cell = partition.cell if partition is not None else None
    estimate.branch = step_result.branch if step_result is not None else None
    estimate.levels = step_result.levels if step_result is not None else None
    estimate.gae = step_result.gae if step_result is not None else None
    estimate.graph = graph


def _returns(settings, batch, layout, partition):
    """(R^env, the invalid-action penalty, the bootstrap value or None, the graph or None) per step.

    R = R^env - p (`step_returns`), with R^env kept apart for the baselines that keep the
    penalty out of their recursion (gae). Under step_return="graph", R^env is the graph
    return 10 γ^d (`graph`) over the cells of the base partition (no context levels); under
    "milestone", BEACON's 10 γ^(next(t) - t) toward the segment's milestone (`milestones`).
    """
    penalty = settings.invalid_action_penalty * (~batch.valid).to(torch.float64)
    if settings.step_return == "milestone":
        if batch.milestone is None:
            raise ValueError(
                "step_return='milestone' needs StepBatch.milestone (or milestone_plan and action_text): the env's milestones."
            )
        return milestone_returns(batch.milestone, layout, settings.step_gamma), penalty, None, None
    if settings.step_return == "graph":
        graph = _graph(settings, batch, layout, partition)
        return graph_returns(graph, settings.step_gamma, settings.normalize_distance), penalty, None, graph
    next_value = None
    if settings.bootstrap_truncated and bool(batch.truncated.any()):
        terminal = discounted_cumsum(batch.reward, layout, settings.step_gamma)
        next_value = truncation_value(terminal, partition.cell, partition.num_cells, batch.truncated)
    env_returns = step_returns(batch.reward, batch.valid, layout, settings.step_gamma, 0.0, next_value=next_value)
    return env_returns, penalty, next_value, None


def _graph(settings, batch, layout, partition) -> TransitionGraph:
    """The groups' state graphs: nodes are the base cells, or (hash with `next_anchor` or the
    similarity merge) the anchors themselves, merged by text similarity when asked. Over other
    cells (hidden clusters) a last step's recorded end joins a cell by its anchor (`known_state_cells`)."""
    base = partition.levels[0] if isinstance(partition, LevelledPartition) else partition
    success = episode_returns(batch.reward, layout) > 0
    use_anchors = settings.step_partition == "hash" and (batch.next_anchor is not None or settings.similarity_merge)
    if not use_anchors:
        if batch.next_anchor is None or batch.anchor is None:
            return transition_graph(base.cell, layout, success)
        following = following_labels(base.cell, layout)
        ends = known_state_cells(base.cell, batch.anchor, batch.next_anchor, layout)
        # a recorded end no step of the group saw: a state of the trajectory's own, which no step leaves
        fresh = torch.where(batch.next_anchor >= 0, int(base.cell.max()) + 1 + layout.traj_index, -1)
        ends = torch.where(ends >= 0, ends, fresh)
        return transition_graph(base.cell, layout, success, torch.where(following >= 0, following, ends))
    label, next_label = batch.anchor, batch.next_anchor
    if settings.similarity_merge:
        if batch.anchor_text is None:
            raise ValueError("similarity_merge needs the anchors' texts: give StepBatch.anchor as strings.")
        won = success[layout.traj_index] & (layout.grid_position == _last_position(layout))
        masked = None if next_label is None else torch.where(won, -1, next_label)
        label, next_label = similar_labels(label, batch.anchor_text, layout, settings.similarity_threshold, masked)
    if next_label is None:
        return transition_graph(Partition.from_labels(layout.group_index, label).cell, layout, success)
    n = label.shape[0]
    unrecorded = next_label < 0  # a dead end (or, merged, the goal: `transition_graph` puts wins there)
    both = Partition.from_labels(layout.group_index.repeat(2), torch.cat([label, torch.where(unrecorded, label, next_label)])).cell
    return transition_graph(both[:n], layout, success, torch.where(unrecorded, -1, both[n:]))


def _last_position(layout) -> torch.Tensor:
    """(N,) grid position of the last step of each step's trajectory."""
    return layout.traj_index * layout.max_length + layout.traj_length[layout.traj_index] - 1


def graph_diagnostics(graph: TransitionGraph, layout: BatchLayout) -> dict[str, float]:
    """Per batch: nodes and distinct edges per task group (means), the fraction of steps whose
    reached state can reach the goal, their mean distance, the fraction of steps alone on
    their node, the fraction of groups with no success (every d = 1 there), and how the
    trajectories that did not reach the goal ended (`_end_counts`)."""
    n, num_groups = graph.node.shape[0], max(layout.num_groups, 1)
    if not n:
        return {}
    used = torch.zeros(graph.num_nodes, dtype=torch.bool)
    used[graph.node] = True
    used[graph.next_node] = True
    visits = torch.bincount(graph.node, minlength=graph.num_nodes)
    edges = torch.unique(graph.node * graph.num_nodes + graph.next_node).shape[0]
    reach = graph.reachable[graph.next_node]
    goal_reached = torch.zeros(num_groups, dtype=torch.bool)
    goal_reached[graph.node_group[graph.next_node[graph.next_node == graph.num_state_nodes + layout.group_index]]] = True
    return {
        "graph/nodes": float(used.sum()) / num_groups,
        "graph/edges": float(edges) / num_groups,
        "graph/reachable_frac": float(reach.to(torch.float64).mean()),
        "graph/mean_distance": float(graph.distance[graph.next_node][reach].mean()) if bool(reach.any()) else 0.0,
        "graph/singleton_rate": float((visits[graph.node] == 1).to(torch.float64).mean()),
        "graph/no_goal_frac": 1.0 - float(goal_reached.to(torch.float64).mean()),
        **_end_counts(graph, layout, visits),
    }


def _end_counts(graph: TransitionGraph, layout: BatchLayout, visits: torch.Tensor) -> dict[str, float]:
    """Last steps that did not reach the goal, counted: `graph/failed_ends` (the env's final state
    was recorded), `graph/failed_ends_known` (of those, a state some step of the group was taken from:
    where the reference's graph and a dead-end rule differ) and `graph/dead_ends` (nothing recorded:
    an env fault, or a batch without `StepBatch.next_anchor`)."""
    last = layout.grid_position == _last_position(layout)
    reached = graph.next_node[last]
    dead = reached >= graph.num_state_nodes + layout.num_groups
    failed = (reached < graph.num_state_nodes) & ~dead
    return {
        "graph/failed_ends": float(failed.sum()),
        "graph/failed_ends_known": float((failed & (visits[reached] > 0)).sum()),
        "graph/dead_ends": float(dead.sum()),
    }


class StepAdvantageEstimator:
    """`compute_advantages` with state: the ε of `cluster_eps="auto"`, and its one owner.

    For a partition that takes ε (`PartitionKind.takes_eps`), ε is calibrated on the
    first batch and then held fixed (or re-calibrated every `recalibrate_eps_every` calls).
    In distributed training pass `reduce`, a function mapping this rank's ε (NaN when
    the rank's batch is empty) to the ranks' mean, so every rank clusters with the same
    ε. Until a calibration succeeds (every batch so far empty on every rank) the
    estimator clusters with `max_cluster_eps`; `eps_in_use` says which ε that is, for
    logs and the model card. `state_dict`/`load_state_dict` carry ε and the call count
    across a resume.
    """

    def __init__(self, settings: EstimatorSettings):
        self.settings = settings
        self.cluster_eps: float | None = None if settings.cluster_eps == "auto" else float(settings.cluster_eps)
        self.num_calls = 0

    @property
    def eps_in_use(self) -> float | None:
        """The ε the next call clusters with: the calibrated or fixed ε, `max_cluster_eps`
        before any calibration succeeded, None when the partition takes no ε."""
        if not self.settings.partition_kind.takes_eps:
            return None
        return self.cluster_eps if self.cluster_eps is not None else float(self.settings.max_cluster_eps)

    @property
    def needs_calibration(self) -> bool:
        s = self.settings
        if not s.partition_kind.takes_eps or s.cluster_eps != "auto" or not s.has_step_term:
            return False
        if self.cluster_eps is None:
            return True
        return s.recalibrate_eps_every > 0 and self.num_calls % s.recalibrate_eps_every == 0

    def calibrate(self, batch: StepBatch, reduce: Callable[[float], float] | None = None) -> None:
        """Set ε from `batch`: the smallest ε whose singleton rate is at most
        `target_singleton_rate`, capped at `max_cluster_eps` (`bisect_eps`; for `hidden`
        that is `calibrate_eps`), averaged over ranks by `reduce`."""
        s = self.settings
        eps = math.nan
        if len(batch):
            layout = BatchLayout.from_batch(batch)
            # ε is a property of the base partition (the state clusters), not of its context levels
            rate = lambda e: _build_partition(s, batch, layout, e, levels=False).singleton_rate()  # noqa: E731
            eps = bisect_eps(rate, s.target_singleton_rate, s.max_cluster_eps)
        if reduce is not None:
            eps = reduce(eps)
        if not math.isnan(eps):
            self.cluster_eps = float(eps)

    def __call__(
        self, batch: StepBatch, reduce: Callable[[float], float] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        estimate = self._run(batch, reduce, per_step=False)
        return estimate.advantage, estimate.diagnostics

    def estimate(self, batch: StepBatch, reduce: Callable[[float], float] | None = None) -> StepEstimate:
        """The same call, returning each step's return, cell and PACE branch too (`StepEstimate`)."""
        return self._run(batch, reduce, per_step=True)

    def _run(self, batch: StepBatch, reduce: Callable[[float], float] | None, per_step: bool) -> StepEstimate:
        calibration_seconds = 0.0
        if self.needs_calibration:
            start = time.perf_counter()
            self.calibrate(batch, reduce)
            calibration_seconds = time.perf_counter() - start
        self.num_calls += 1
        estimate = _estimate(batch, self.settings, self.eps_in_use, per_step)
        estimate.diagnostics["time/calibration_s"] = calibration_seconds
        return estimate

    def state_dict(self) -> dict[str, Any]:
        return {"cluster_eps": self.cluster_eps, "num_calls": self.num_calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cluster_eps = state["cluster_eps"]
        self.num_calls = int(state["num_calls"])
