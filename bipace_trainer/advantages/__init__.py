"""Step-level advantage estimators: pure torch, no trainer, model or env state.

Map from the equations (docs/concepts/math.md, by section anchor) to code:

    #step-records          records.StepBatch, records.BatchLayout, records.factorize
    #step-returns          returns.step_returns, returns.episode_returns; truncated
    #truncation            trajectories: returns.truncation_value (bootstrap_truncated)
    #episode-advantage     returns.episode_advantage (#episode-stats-steps: GiGPO compat)
    #state-partition       partition.PARTITIONS (register_partition): hash_partition
                           (#anchor-partition), hidden_partition and leader_cluster
                           (#hidden-partition), calibrate_eps (#eps-calibration)
    #step-baseline         baselines.mean_baseline (#mean-baseline), pace_q_baseline
                           (#pace-q, with evidence: #pace-evidence), pace_diff_baseline
                           (#pace-diff), gae_baseline (#gae)
    #context-levels, #hgpo partition.context_partition (LevelledPartition: levels k = 0..K
                           over any partition), baselines.hierarchy_baseline (LevelDetail);
                           per-level diagnostics: presets.level_diagnostics
    step return (axis 3)   returns.step_returns (discounted), graph.transition_graph and
                           graph.graph_returns (GraphGPO's 10·γ^d, step_return="graph"),
                           graph.similar_labels (the similarity merge), presets.graph_diagnostics
                           (docs/concepts/estimators.md, "The graph return")
    #milestones            BEACON: milestones.match_milestones and with_plan_flags (a plan made
                           flags), partition.segment_partition (axis 1), milestones.milestone_returns
                           (axis 3, step_return="milestone")
    #combination, #presets settings.EstimatorSettings (every knob, declared once with its flag's help;
                           settings.EstimatorOverrides: the config's form), presets.PRESETS, presets.resolve_settings,
                           presets.compute_advantages, presets.StepAdvantageEstimator
                           (the one owner of "auto" ε and its fallback: eps_in_use)
    #diagnostics           the dict returned by compute_advantages; per step (return,
                           cell, PACE branch, HGPO levels, GAE terms: baselines.GaeTerms):
                           presets.estimate_advantages
"""

from .baselines import BASELINES
from .graph import TransitionGraph, goal_distances, graph_returns, similar_labels, transition_graph
from .milestones import match_milestones, milestone_returns
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
    segment_partition,
)
from .presets import (
    PRESETS,
    StepAdvantageEstimator,
    StepEstimate,
    compute_advantages,
    estimate_advantages,
    register_preset,
    resolve_settings,
)
from .records import BatchLayout, StepBatch, factorize
from .returns import episode_advantage, episode_returns, step_returns, truncation_value
from .settings import ESTIMATOR_FIELDS, EstimatorOverrides, EstimatorSettings, SettingsError

__all__ = [
    "BASELINES",
    "ESTIMATOR_FIELDS",
    "PARTITIONS",
    "PRESETS",
    "BatchLayout",
    "LevelledPartition",
    "EstimatorOverrides",
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
    "match_milestones",
    "milestone_returns",
    "register_partition",
    "register_preset",
    "resolve_partition",
    "resolve_settings",
    "segment_partition",
    "similar_labels",
    "step_returns",
    "transition_graph",
    "truncation_value",
]
