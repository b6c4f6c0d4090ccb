"""Step-level advantage estimators: pure torch, no trainer, model or env state.

Map from SPEC to code:

    §1 step records            records.StepBatch, records.BatchLayout, records.factorize
    §2 returns, penalty        returns.step_returns, returns.episode_returns; truncated
                               trajectories: returns.truncation_value (bootstrap_truncated)
    §3 episode advantage       returns.episode_advantage (episode_stats="steps": GiGPO compat)
    §4 axis 1, partition       partition.PARTITIONS (register_partition): hash_partition,
                               hidden_partition, leader_cluster, calibrate_eps
    §4 axis 2, baseline        baselines.mean_baseline, pace_q_baseline, pace_diff_baseline,
                               gae_baseline
    §4 HGPO                    partition.context_partition (LevelledPartition: levels k = 0..K
                               over any partition), baselines.hierarchy_baseline (LevelDetail);
                               per-level diagnostics: presets.level_diagnostics
    step return (axis 3)       returns.step_returns (discounted), graph.transition_graph +
                               graph.graph_returns (GraphGPO's 10·γ^d; `step_return="graph"`),
                               graph.similar_labels (the similarity merge); per-step diagnostics:
                               presets.graph_diagnostics (docs/concepts/estimators.md)
    §4 combination, presets    presets.PRESETS, presets.resolve_settings,
                               presets.compute_advantages, presets.StepAdvantageEstimator
                               (the one owner of "auto" ε and its fallback: eps_in_use)
    §5 diagnostics             the dict returned by compute_advantages; per step (return,
                               cell, PACE branch, HGPO levels, GAE terms: baselines.GaeTerms):
                               presets.estimate_advantages
"""

from .baselines import BASELINES
from .graph import TransitionGraph, goal_distances, graph_returns, similar_labels, transition_graph
from .partition import (
    PARTITIONS,
    LevelledPartition,
    Partition,
    PartitionKind,
    calibrate_eps,
    context_partition,
    hash_partition,
    hidden_partition,
    leader_cluster,
    register_partition,
    resolve_partition,
)
from .presets import (
    PRESETS,
    EstimatorSettings,
    SettingsError,
    StepAdvantageEstimator,
    StepEstimate,
    compute_advantages,
    estimate_advantages,
    register_preset,
    resolve_settings,
)
from .records import BatchLayout, StepBatch, factorize
from .returns import episode_advantage, episode_returns, step_returns, truncation_value

__all__ = [
    "BASELINES",
    "PARTITIONS",
    "PRESETS",
    "BatchLayout",
    "LevelledPartition",
    "EstimatorSettings",
    "Partition",
    "PartitionKind",
    "SettingsError",
    "StepAdvantageEstimator",
    "StepBatch",
    "StepEstimate",
    "TransitionGraph",
    "calibrate_eps",
    "compute_advantages",
    "context_partition",
    "estimate_advantages",
    "episode_advantage",
    "episode_returns",
    "factorize",
    "goal_distances",
    "graph_returns",
    "hash_partition",
    "hidden_partition",
    "leader_cluster",
    "register_partition",
    "register_preset",
    "resolve_partition",
    "resolve_settings",
    "similar_labels",
    "step_returns",
    "transition_graph",
    "truncation_value",
]
