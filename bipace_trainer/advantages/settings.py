"""The estimator's settings, each declared once: `EstimatorSettings`, the fully valued form the
estimator reads (its fields: name, type, default, the help of the flag that sets it, and the value
checks), and `EstimatorOverrides`, the same fields as a config holds them, each `T | None` with
None = "the preset's value", derived from it (`BiPACEConfig` inherits them; `presets.resolve_settings`
puts the set ones on top of a preset). The equations: docs/concepts/math.md.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from .baselines import BASELINES, LEVEL_BASELINES
from .partition import PARTITIONS, PartitionKind, resolve_partition

__all__ = ["ESTIMATOR_FIELDS", "EstimatorOverrides", "EstimatorSettings", "SettingsError"]

_GIGPO = "https://arxiv.org/abs/2505.10978"
_HGPO = "https://arxiv.org/abs/2602.22817"
_GRAPHGPO = "https://arxiv.org/abs/2605.26684"

NORMS = ("mean", "mean_std")
STEP_RETURNS = ("discounted", "graph", "milestone")
LEVEL_WEIGHT_OFFSETS = {"k+2": 2, "k+1": 1}  # verl-agent's code, the HGPO paper


class SettingsError(ValueError):
    """A bad estimator setting; `field` is the `EstimatorSettings` field it names (a `BiPACEConfig`
    field and train.py flag of the same name)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class EstimatorSettings:
    """Every knob of the step-level advantage estimator (the equations: docs/concepts/math.md).

    Attributes:
    Each field's metadata help is the help of train.py's flag of the same name: `BiPACEConfig`
    holds these fields as `EstimatorOverrides` (None: the preset's) and resolves them here.

        step_partition: state partition, a name in `partition.PARTITIONS` ("none" | "hash" |
            "hidden" built in) or "package.module:NAME" of a `PartitionKind`.
        step_baseline: step baseline, "mean" | "pace_q" | "pace_diff" | "gae" | "hierarchy"; None iff
            the partition has no cells ("none").
        advantage_norm: "mean_std" or "mean", for A^ep and the `mean` baseline.
        pace_norm: "mean" (default; the BiPACE paper does not publish a std) or
            "mean_std", for the PACE baselines.
        w_ep, w_step: weights of the episode and step terms.
        step_gamma: discount of step returns. gae_lambda: GAE λ (the `gae` baseline).
        invalid_action_penalty: subtracted from an invalid step's return after discounting.
        episode_stats: "trajectory" (A^ep over the G trajectories) or "steps"
            (GiGPO reference compatibility: over step rows).
        cluster_eps: cosine-distance threshold of a partition that takes ε (`hidden`),
            a float in [0, 2] (a string such as "0.10" is parsed here) or "auto".
        target_singleton_rate, max_cluster_eps: what "auto" aims for and its cap.
        recalibrate_eps_every: with "auto", re-calibrate ε every this many calls (0: never).
        importance_sampling_level: "token" or "sequence" (GAGPO); read by the trainer
            (docs/concepts/math.md#importance-ratio).
        bootstrap_truncated: False (GiGPO's behaviour): a trajectory cut by the turn
            budget ends with R_L = 0, as if the env had ended it. True: its last step
            bootstraps from the value proxy, R_L = V̄(s_{L-1}) (`returns.truncation_value`).

        HGPO (docs/concepts/math.md#hgpo; arXiv 2602.22817, verl-agent `recipe/hgpo/core_hgpo.py`):
        context_levels: K, previous steps a context compares (`partition.context_partition`
            over the partition above); 0: the flat partition. With a one-level baseline the
            cells are the deepest level (steps whose K-step context agrees). Set it to the
            history the prompt shows (`BiPACEConfig.history_length`; the public HGPO scripts: both 2).
        level_baseline: the advantage of each level under `step_baseline="hierarchy"`: "mean"
            (HGPO, population std under mean_std), "pace_q" or "pace_diff".
        level_alpha: α of the level weights. level_weights: "k+2" (w_k = (k+2)^α, the code
            that produced the published numbers) or "k+1" (the paper's formula).
        drop_zero_levels: True (the code): a level whose advantage is exactly 0 leaves the
            weighted mean; False (the paper): it stays in with its weight.
        base_group: add the episode advantage (`advantage_norm`, `episode_stats`) as one more item
            of weight 1 (the code's `base_group`, off by default); `w_ep` stays separate.

        Step return (docs/concepts/estimators.md, "Step return"; GraphGPO: arXiv 2605.26684,
        verl-agent `recipe/GraphGPO/core_graph.py`):
        step_return: "discounted" (R_t = r_t + γ R_{t+1}: GiGPO, HGPO, PACE, GAE) or "graph"
            (R_t = 10 γ^d, d the distance of the reached state to the goal on the group's
            state-transition graph over the partition's cells: `graph`). With "graph", γ is
            the graph's decay (GraphGPO: 0.1 on ALFWorld, 0.2 on WebShop).
        normalize_distance: "graph" only; R_t = 10 γ^{d(s_{t+1}) - d(s_t) + 1}, the distance closed.
        similarity_merge, similarity_threshold: "graph" over `hash` only; observations whose
            `difflib` ratio is >= the threshold are one graph node (`graph.similar_labels`);
            the baseline's cells stay the exact anchors, as in the reference.

        BEACON (docs/concepts/math.md#milestones; arXiv 2605.06078, ZJU-REAL/BEACON `migpo/core_migpo.py`):
        step_return="milestone": R_t = 10 γ^(next(t) - t), next(t) the step that reached the next
            milestone, 0 after the last (`milestones`); its usual cells are `step_partition="segment"`.
        milestone_threshold: the difflib ratio at which an action matches the next milestone of
            a static plan (`milestones.match_milestones`; BEACON's scripts: 0.95).

        PACE with evidence (docs/concepts/math.md#pace-evidence; ECPO's idea, arXiv 2606.05885):
        pace_evidence: κ >= 0; PACE-Q's Q̂(a) is shrunk toward V̂ by κ pseudo-counts, so its
            branch is n_a / (n_a + κ) · (Q̂(a) - V̂) (0: plain PACE-Q). Read by `pace_q` only
            (also as the hierarchy's level baseline).
        pace_variance_gate: PACE-Q's branch × the share of the cell's return spread that its
            actions explain (SS_between / SS_total).
    """

    step_partition: str = field(default="hidden", metadata={"help": "State partition: none | hash | hidden."})
    step_baseline: str | None = field(
        default="pace_q", metadata={"help": "Step baseline: mean | pace_q | pace_diff | gae | hierarchy."}
    )
    advantage_norm: str = field(
        default="mean_std", metadata={"help": f"mean_std | mean for the episode term and the mean baseline ({_GIGPO})."}
    )
    pace_norm: str = field(default="mean", metadata={"help": "mean | mean_std for the PACE baselines."})
    w_ep: float = field(default=1.0, metadata={"help": "Weight of the episode-level advantage."})
    w_step: float = field(default=1.0, metadata={"help": f"Weight of the step-level advantage (GiGPO's ω; {_GIGPO})."})
    step_gamma: float = field(
        default=0.95, metadata={"help": "Discount γ of step returns; None: the preset's (0.95, as the papers)."}
    )
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE λ of the gae baseline (GAGPO)."})
    invalid_action_penalty: float = field(
        default=0.1,
        metadata={"help": "Subtracted from an invalid step's return after discounting; None: the preset's (0.1, GiGPO)."},
    )
    episode_stats: str = field(
        default="trajectory", metadata={"help": "trajectory | steps (GiGPO reference compatibility)."}
    )
    cluster_eps: float | str = field(
        default="auto", metadata={"help": "Cosine-distance threshold ε (float) or 'auto'; None: the preset's ('auto')."}
    )
    target_singleton_rate: float = field(
        default=0.2, metadata={"help": "Singleton rate 'auto' calibrates ε to; None: the preset's (0.2)."}
    )
    max_cluster_eps: float = field(
        default=0.3, metadata={"help": "Upper bound of the calibrated ε; None: the preset's (0.3)."}
    )
    recalibrate_eps_every: int = field(
        default=0, metadata={"help": "Re-calibrate 'auto' ε every k steps (0: once); None: the preset's (0)."}
    )
    importance_sampling_level: str = field(
        default="token", metadata={"help": "token | sequence; None takes the preset's (sequence for GAGPO presets)."}
    )
    bootstrap_truncated: bool = field(
        default=False,
        metadata={
            "help": "true: a trajectory cut by max_turns bootstraps its last step from the value proxy instead of "
            "ending with return 0; None: the preset's (false, as GiGPO)."
        },
    )
    context_levels: int = field(
        default=0,
        metadata={
            "help": f"HGPO's K: context levels over the partition (0: none); None: the preset's (2 for HGPO presets). {_HGPO}"
        },
    )
    level_baseline: str = field(
        default="mean",
        metadata={"help": "Per-level advantage of the hierarchy baseline: mean (HGPO) | pace_q | pace_diff."},
    )
    level_alpha: float = field(
        default=1.0, metadata={"help": f"α of the level weights; None: the preset's (1, HGPO). {_HGPO}"}
    )
    level_weights: str = field(
        default="k+2",
        metadata={"help": "k+2: w_k = (k+2)^α, verl-agent's code (default) | k+1: the paper's (k+1)^α."},
    )
    drop_zero_levels: bool = field(
        default=True,
        metadata={"help": "A level whose advantage is exactly 0 leaves the weighted mean (the code: true; the paper: false)."},
    )
    base_group: bool = field(
        default=False,
        metadata={"help": "Add the episode advantage to the hierarchy's weighted mean with weight 1 (HGPO code)."},
    )
    step_return: str = field(
        default="discounted",
        metadata={"help": f"discounted | graph (GraphGPO {_GRAPHGPO}: 10·γ^d, d = distance to the goal on the group's graph)."},
    )
    normalize_distance: bool = field(
        default=False,
        metadata={"help": "graph: 10·γ^(d(next) - d(state) + 1), the distance closed (GraphGPO: false)."},
    )
    similarity_merge: bool = field(
        default=False,
        metadata={"help": "graph over hash: one node for texts of difflib ratio >= similarity_threshold."},
    )
    similarity_threshold: float = field(default=0.95, metadata={"help": "of similarity_merge (GraphGPO: 0.95)."})
    milestone_threshold: float = field(
        default=0.95, metadata={"help": "difflib ratio matching an action to a plan's milestone (BEACON: 0.95)."}
    )
    pace_evidence: float = field(
        default=0.0, metadata={"help": "PACE-Q: κ pseudo-counts pulling Q̂(a) to V̂ (0: off)."}
    )
    pace_variance_gate: bool = field(
        default=False, metadata={"help": "PACE-Q: × the share of a cell's spread its actions explain."}
    )

    def __post_init__(self):
        def fail(name, message):
            raise SettingsError(name, f"{name}={getattr(self, name)!r} {message}")

        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                fail(name, f"is not one of {allowed}.")

        try:
            kind = resolve_partition(self.step_partition)
        except ValueError as err:
            raise SettingsError("step_partition", str(err)) from None
        choice("advantage_norm", NORMS)
        choice("pace_norm", NORMS)
        choice("episode_stats", ("trajectory", "steps"))
        choice("importance_sampling_level", ("token", "sequence"))
        if not kind.has_cells and self.step_baseline is not None:
            with_cells = " or ".join(repr(name) for name, entry in PARTITIONS.items() if entry.has_cells)
            fail(
                "step_baseline",
                f"has no effect with step_partition={self.step_partition!r} (no step-level cells); "
                f"set step_baseline=None, or pick step_partition={with_cells}.",
            )
        if kind.has_cells:
            choice("step_baseline", tuple(BASELINES))
        if not 0.0 <= self.step_gamma <= 1.0:
            fail("step_gamma", "must lie in [0, 1].")
        if not 0.0 <= self.gae_lambda <= 1.0:
            fail("gae_lambda", "must lie in [0, 1].")
        if self.invalid_action_penalty < 0:
            fail("invalid_action_penalty", "must be >= 0 (it is subtracted).")
        if isinstance(self.cluster_eps, str) and self.cluster_eps != "auto":
            try:
                self.cluster_eps = float(self.cluster_eps)
            except ValueError:
                fail("cluster_eps", "is not a number: give a float in [0, 2] or 'auto'.")
        if not isinstance(self.cluster_eps, str) and not 0.0 <= self.cluster_eps <= 2.0:
            fail("cluster_eps", "must lie in [0, 2] (a cosine distance) or be 'auto'.")
        if not 0.0 <= self.target_singleton_rate <= 1.0:
            fail("target_singleton_rate", "must lie in [0, 1].")
        if not 0.0 < self.max_cluster_eps <= 2.0:
            fail("max_cluster_eps", "must lie in (0, 2].")
        if self.recalibrate_eps_every < 0:
            fail("recalibrate_eps_every", "must be >= 0 (0 = calibrate once).")
        if not isinstance(self.bootstrap_truncated, bool):
            fail("bootstrap_truncated", "must be True or False.")
        if isinstance(self.context_levels, bool) or not isinstance(self.context_levels, int) or self.context_levels < 0:
            fail("context_levels", "must be an integer >= 0 (K previous steps; 0 = no context levels).")
        choice("level_baseline", tuple(LEVEL_BASELINES))
        choice("level_weights", tuple(LEVEL_WEIGHT_OFFSETS))
        if isinstance(self.level_alpha, bool) or not math.isfinite(float(self.level_alpha)):
            fail("level_alpha", "must be a finite number (HGPO: 1).")
        for name in ("drop_zero_levels", "base_group", "normalize_distance", "similarity_merge", "pace_variance_gate"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be True or False.")
        if isinstance(self.pace_evidence, bool) or not 0.0 <= float(self.pace_evidence) < math.inf:
            fail("pace_evidence", "must be a finite number >= 0 (pseudo-counts; 0 = plain PACE-Q).")
        choice("step_return", STEP_RETURNS)
        self._check_graph(fail, kind)
        self._check_milestones(fail)
        self._check_finite(fail)

    def _check_finite(self, fail) -> None:
        """Every setting declared `float` is a finite number: NaN or infinity passes a check such as
        `x < 0` and would crash at step 1, blamed on the env (the ranges above catch some first)."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            try:
                finite = not isinstance(value, bool) and math.isfinite(float(value))
            except (TypeError, ValueError):
                finite = False
            if not finite:
                fail(name, "must be a finite number.")

    def _check_milestones(self, fail) -> None:
        """The combinations the milestone return does not have."""
        if isinstance(self.milestone_threshold, bool) or not 0.0 < float(self.milestone_threshold) <= 1.0:
            fail("milestone_threshold", "must lie in (0, 1] (a difflib ratio; BEACON: 0.95).")
        if self.step_return != "milestone":
            return
        if self.step_baseline == "gae":
            fail("step_return", "cannot be 'milestone' with step_baseline='gae' (GAE sums rewards; a milestone return is none).")
        if self.bootstrap_truncated:
            fail("bootstrap_truncated", "applies to step_return='discounted' only (a milestone return never bootstraps).")

    def _check_graph(self, fail, kind) -> None:
        """The combinations the graph return does not have."""
        if isinstance(self.similarity_threshold, bool) or not 0.0 < float(self.similarity_threshold) <= 1.0:
            fail("similarity_threshold", "must lie in (0, 1] (a difflib ratio; GraphGPO: 0.95).")
        if self.step_return != "graph":
            for name in ("normalize_distance", "similarity_merge"):
                if getattr(self, name):
                    fail(name, "applies to step_return='graph' only; set step_return='graph' or leave it False.")
            return
        if not kind.has_cells:
            fail("step_return", f"needs a partition with cells (its graph's nodes), not step_partition={self.step_partition!r}.")
        if self.step_baseline == "gae":
            fail("step_return", "cannot be 'graph' with step_baseline='gae' (GAE sums rewards; a distance is no reward sum).")
        if self.bootstrap_truncated:
            fail("bootstrap_truncated", "applies to step_return='discounted' only (a graph return never bootstraps).")
        if self.similarity_merge and self.step_partition != "hash":
            fail("similarity_merge", "merges observation texts: use it with step_partition='hash'.")

    @property
    def partition_kind(self) -> PartitionKind:
        """The `PartitionKind` that `partition` names."""
        return resolve_partition(self.step_partition)

    @property
    def has_step_term(self) -> bool:
        return self.partition_kind.has_cells and self.w_step != 0.0

    @property
    def uses_milestones(self) -> bool:
        """The step term reads the env's milestones (the `segment` cells or the milestone return)."""
        return self.has_step_term and ("milestone" in self.partition_kind.needs or self.step_return == "milestone")

    @property
    def rollout_needs(self) -> frozenset[str]:
        """The `StepBatch` fields the step term reads: what the rollout must record beyond rewards
        (the trainer captures hidden states iff "hidden", asks the envs for milestones iff "milestone")."""
        if not self.has_step_term:
            return frozenset()
        return self.partition_kind.needs | ({"milestone"} if self.uses_milestones else set())


# The settings' names, in declaration order: train.py's flags and `BiPACEConfig`'s fields.
ESTIMATOR_FIELDS = tuple(f.name for f in dataclasses.fields(EstimatorSettings))
_FLOAT_FIELDS = tuple(name for name, kind in typing.get_type_hints(EstimatorSettings).items() if kind is float)


def _as_overrides(settings: type) -> type:
    """`settings`' fields, each typed `T | None` with default None and the same metadata (its help):
    the form a config holds, in which None takes the preset's value."""
    types = typing.get_type_hints(settings)
    fields = [
        (f.name, types[f.name] | None, field(default=None, metadata=f.metadata)) for f in dataclasses.fields(settings)
    ]
    doc = (
        "`EstimatorSettings`' fields as a config holds them: each `T | None`, None (the default) = the preset's value "
        "(`presets.resolve_settings`), with the setting's help. `BiPACEConfig` inherits them."
    )
    return dataclasses.make_dataclass(
        f"{settings.__name__.removesuffix('Settings')}Overrides", fields, namespace={"__module__": __name__, "__doc__": doc}
    )


EstimatorOverrides = _as_overrides(EstimatorSettings)
