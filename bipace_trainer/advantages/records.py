"""The flat batch of step records the estimators read (docs/concepts/math.md#step-records), and its layout.

One rollout batch holds `num_tasks` task groups × G trajectories; each trajectory is a
list of steps and each step is one training sample. The estimators see the batch
flat, one row per step, in any order:

    group  (N,)   int64   task group id
    traj   (N,)   int64   trajectory id, unique in the batch
    t      (N,)   int64   step index within its trajectory, 0..L-1
    reward (N,)   float   env reward of the step
    valid  (N,)   bool    the reply held a well-formed action
    anchor (N,)   int64   id of the raw current observation (exact-match state)
    action_key (N,) int64 id of the normalised action
    hidden (N, d) float   actor hidden state at `cluster_layer`, last prompt token
    truncated (N,) bool   the turn budget ended the trajectory after this step (its
                          last step only): cut, not terminated by the env
    next_anchor (N,) int64 optional: id of the observation the step led to, in the
                          anchors' numbering; -1 (None among texts): none was recorded
                          (an env fault), a dead end. The graph return reads it; without
                          it, the next step's anchor, and a dead end after a failed last step
    milestone (N,) bool   optional: the step reached a milestone, as the env flagged it
                          (the `segment` partition and the milestone return read it)
    milestone_plan (N,) int64 optional: the step's task's ordered milestone actions, as
                          an id into `milestone_plans` (-1: none); given as one sequence of
                          strings (or None) per step, like the anchors
    action_text (N,)      optional: the action each step sent, the text a plan is matched on

Anchors given as strings (or any non-int values) keep their texts in `anchor_text`
(id -> value), which the graph return's string-similarity merge reads. Milestone plans
keep theirs in `milestone_plans` (id -> tuple of actions).

Strings (anchors, action keys) are turned into int64 ids with `factorize`, once,
outside the hot path. `BatchLayout` derives the dense indices every estimator needs
(trajectory, group, position in a padded (trajectory, t) grid) in a few vectorised
calls, and validates the batch while doing so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

__all__ = [
    "StepBatch",
    "BatchLayout",
    "factorize",
    "segment_sum",
    "segment_reference",
    "segment_mean_std",
    "zero_mean_residue",
    "MEAN_RESIDUE_TOL",
]

# |x_i - mean_S x| at most this times max_S |x| is a rounding residue: x_i is the mean.
# float64 means leave ~n·1e-16; rewards carry float32's 1e-7, so distinct values differ more.
MEAN_RESIDUE_TOL = 1e-9


def factorize(values: Iterable[Hashable]) -> torch.Tensor:
    """Map hashable values to dense int64 ids in order of first appearance.

    Returns:
        ids: (N,) int64, equal ids exactly where values are equal.
    """
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(v, len(table)) for v in values], dtype=torch.long)


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum `values` (N, ...) into `num_segments` rows by `index` (N,) → (num_segments, ...)."""
    out = values.new_zeros((num_segments, *values.shape[1:]))
    return out.index_add_(0, index, values)


def segment_reference(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The value of each segment's first member (S,), 0 for an empty segment.

    Sums of values relative to it are exact when a segment's values are all equal, so
    their mean is that value exactly and deviations from it are exactly 0: returns such
    as 0.95^3 repeated G times would otherwise leave a rounding residue that the std
    normalisation (÷ (std + 1e-6)) amplifies to ~1e-11 advantages.
    """
    n = values.shape[0]
    first = torch.full((num_segments,), n, dtype=torch.long, device=index.device)
    first.scatter_reduce_(0, index, torch.arange(n, device=index.device), reduce="amin")
    padded = torch.cat([values, values.new_zeros(1)])
    return padded[first]


def segment_mean_std(
    values: torch.Tensor, index: torch.Tensor, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment count, mean and unbiased std (two-pass, so large offsets stay exact).

    The mean is taken relative to each segment's first value (`segment_reference`):
    a segment of equal values has exactly that mean and std 0.

    Args:
        values: (N,) float.
        index: (N,) int64 in [0, num_segments).
    Returns:
        count (S,), mean (S,), std (S,); std is 0 for segments of fewer than 2 values.
    """
    count = torch.bincount(index, minlength=num_segments).to(values.dtype)
    reference = segment_reference(values, index, num_segments)
    mean = reference + segment_sum(values - reference[index], index, num_segments) / count.clamp(min=1)
    sq_dev = segment_sum((values - mean[index]) ** 2, index, num_segments)
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq_dev))
    return count, mean, std


def zero_mean_residue(centred: torch.Tensor, values: torch.Tensor, index: torch.Tensor, num_segments: int):
    """`centred` = values - their segment's mean, with rounding residues set to exactly 0.

    A value equal to the mean of unequal ones (scores (1, 1, 0, 0.9, 0.9) and mean 0.9,
    returns (-0.5, 0.5, 0.4, -0.6, ..., 0) and mean -0.6) has deviation 0 in exact
    arithmetic but ~1e-16 in float64, depending on the order of the sum. HGPO drops an
    item whose advantage is exactly 0 from its weighted mean (`hierarchy_baseline`), so
    that residue would halve the step's advantage instead of leaving it as it is.

    Args:
        centred: (N,) values - mean[index]; values: (N,); index: (N,) segment of each value.
    Returns:
        (N,) `centred`, 0 where |centred| <= MEAN_RESIDUE_TOL · max |values| of the segment.
    """
    scale = values.new_zeros(num_segments).scatter_reduce_(0, index, values.abs(), reduce="amax")
    return torch.where(centred.abs() <= MEAN_RESIDUE_TOL * scale[index], 0.0, centred)


def _as_long(name: str, value, n: int | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"StepBatch.{name} must hold integer ids, got dtype {value.dtype}.")
        tensor = value.to(torch.long)
    else:
        values = list(value)
        if values and not isinstance(values[0], int):
            tensor = factorize(values)
        else:
            tensor = torch.as_tensor(values, dtype=torch.long)
    if tensor.dim() != 1 or (n is not None and tensor.shape[0] != n):
        raise ValueError(f"StepBatch.{name} must have shape (N,)={(n,)}, got {tuple(tensor.shape)}.")
    return tensor


@dataclass
class StepBatch:
    """A flat batch of step records; see the module docstring for fields and shapes.

    Construct it with tensors or plain sequences: string anchors and action keys are
    factorised to ids. `anchor` is needed by the `hash` partition, `hidden` by the
    `hidden` partition, `action_key` by the `pace_*` baselines (each partition says
    what it reads: `partition.PARTITIONS`), `milestone` (or `milestone_plan` with
    `action_text`) by the `segment` partition and the milestone return (BEACON's).
    `truncated` defaults to all False (every trajectory ended by the env); only
    `bootstrap_truncated` reads it.
    """

    group: torch.Tensor
    traj: torch.Tensor
    t: torch.Tensor
    reward: torch.Tensor
    valid: torch.Tensor | None = None
    anchor: torch.Tensor | None = None
    action_key: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    next_anchor: torch.Tensor | None = None
    anchor_text: tuple | None = None
    milestone: torch.Tensor | None = None
    milestone_plan: torch.Tensor | None = None
    milestone_plans: tuple | None = None
    action_text: tuple | None = None

    def __post_init__(self):
        self.group = _as_long("group", self.group, None)
        n = self.group.shape[0]
        self.traj = _as_long("traj", self.traj, n)
        self.t = _as_long("t", self.t, n)
        self.reward = torch.as_tensor(self.reward, dtype=torch.float64).reshape(-1)
        if self.reward.shape[0] != n:
            raise ValueError(f"StepBatch.reward must have shape (N,)={(n,)}, got {tuple(self.reward.shape)}.")
        if not torch.isfinite(self.reward).all():
            raise ValueError("StepBatch.reward holds NaN or inf; drop or repair those steps before estimating.")
        if self.valid is None:
            self.valid = torch.ones(n, dtype=torch.bool)
        self.valid = torch.as_tensor(self.valid, dtype=torch.bool).reshape(-1)
        if self.valid.shape[0] != n:
            raise ValueError(f"StepBatch.valid must have shape (N,)={(n,)}, got {tuple(self.valid.shape)}.")
        self.truncated = torch.zeros(n, dtype=torch.bool) if self.truncated is None else self.truncated
        self.truncated = torch.as_tensor(self.truncated, dtype=torch.bool).reshape(-1)
        if self.truncated.shape[0] != n:
            raise ValueError(f"StepBatch.truncated must have shape (N,)={(n,)}, got {tuple(self.truncated.shape)}.")
        if self.next_anchor is not None and self.anchor is None:
            raise ValueError("StepBatch.next_anchor needs StepBatch.anchor (the same numbering).")
        if self.anchor is not None:
            self._anchor_ids(n)
        if self.action_key is not None:
            self.action_key = _as_long("action_key", self.action_key, n)
        if self.hidden is not None:
            self.hidden = torch.as_tensor(self.hidden)
            if self.hidden.dim() != 2 or self.hidden.shape[0] != n:
                raise ValueError(f"StepBatch.hidden must have shape (N, d) with N={n}, got {tuple(self.hidden.shape)}.")
        self._milestone_fields(n)

    def _milestone_fields(self, n: int) -> None:
        """Flags as bools; plans as ids into `milestone_plans` (tuples of strings), with the actions they match."""
        if self.milestone is not None:
            self.milestone = torch.as_tensor(self.milestone, dtype=torch.bool).reshape(-1)
            if self.milestone.shape[0] != n:
                raise ValueError(f"StepBatch.milestone must have shape (N,)={(n,)}, got {tuple(self.milestone.shape)}.")
        if self.action_text is not None:
            self.action_text = tuple(str(a) for a in self.action_text)
            if len(self.action_text) != n:
                raise ValueError(f"StepBatch.action_text must hold N={n} actions, got {len(self.action_text)}.")
        if self.milestone_plan is None or isinstance(self.milestone_plan, torch.Tensor):
            return
        if self.action_text is None:
            raise ValueError("StepBatch.milestone_plan needs StepBatch.action_text (the actions a plan is matched on).")
        table: dict[tuple, int] = {}
        ids = [-1 if plan is None else table.setdefault(tuple(str(m) for m in plan), len(table)) for plan in self.milestone_plan]
        self.milestone_plan = _as_long("milestone_plan", ids, n)
        self.milestone_plans = tuple(table)

    def __len__(self) -> int:
        return self.group.shape[0]

    def _anchor_ids(self, n: int) -> None:
        """Anchors (and next anchors) as ids; texts factorised in one table, kept in `anchor_text`.
        A next anchor of None (-1 among ids) is a state nobody recorded: a dead end. Next anchors
        given as values beside anchors already made ids (a `dataclasses.replace` of a batch) are
        numbered in the same table."""
        values = self.anchor if isinstance(self.anchor, torch.Tensor) else list(self.anchor)
        texts = not isinstance(values, torch.Tensor) and values and not isinstance(values[0], int)
        if texts:
            table: dict = {}
            self.anchor = _as_long("anchor", [table.setdefault(v, len(table)) for v in values], n)
        else:
            self.anchor = _as_long("anchor", values, n)
            table = {value: i for i, value in enumerate(self.anchor_text)} if self.anchor_text is not None else None
        if self.next_anchor is not None:
            self.next_anchor = self._next_ids(self.next_anchor, table, n)
        if table is not None:
            self.anchor_text = tuple(table)

    def _next_ids(self, nexts, table: dict | None, n: int) -> torch.Tensor:
        """`next_anchor` as ids in the anchors' numbering (`table`: value -> id, None when the anchors
        came as ids), -1 for None."""
        if isinstance(nexts, torch.Tensor) or table is None:
            if not isinstance(nexts, torch.Tensor):
                nexts = [-1 if v is None else v for v in nexts]
                if any(not isinstance(v, int) for v in nexts):
                    raise ValueError("StepBatch.next_anchor holds values, but StepBatch.anchor came as ids: give both as ids.")
            ids = _as_long("next_anchor", nexts, n)
        else:
            ids = _as_long("next_anchor", [-1 if v is None else table.setdefault(v, len(table)) for v in nexts], n)
        if bool((ids < -1).any()):
            raise ValueError("StepBatch.next_anchor holds ids below -1; use -1 (or None) for a state nobody recorded.")
        return ids


@dataclass
class BatchLayout:
    """Dense indices derived from a `StepBatch`, computed once per batch.

    Attributes:
        traj_index: (N,) int64 in [0, num_traj), trajectories sorted by id.
        group_index: (N,) int64 in [0, num_groups), groups sorted by id.
        traj_group: (num_traj,) group index of each trajectory.
        traj_length: (num_traj,) steps per trajectory.
        max_length: T, the longest trajectory.
        grid_position: (N,) position of each step in a row-major (num_traj, T) grid.
    """

    traj_index: torch.Tensor
    group_index: torch.Tensor
    traj_group: torch.Tensor
    traj_length: torch.Tensor
    max_length: int
    grid_position: torch.Tensor

    @property
    def num_traj(self) -> int:
        return self.traj_length.shape[0]

    @property
    def num_groups(self) -> int:
        return int(self.traj_group.max()) + 1 if self.num_traj else 0

    @classmethod
    def from_batch(cls, batch: StepBatch) -> "BatchLayout":
        """Derive the layout; raises ValueError if a trajectory's steps are not 0..L-1
        exactly once, or if one trajectory spans two task groups."""
        n = len(batch)
        _, traj_index, traj_length = torch.unique(batch.traj, return_inverse=True, return_counts=True)
        _, group_index = torch.unique(batch.group, return_inverse=True)
        num_traj = traj_length.shape[0]
        if n == 0:
            empty = torch.zeros(0, dtype=torch.long)
            return cls(traj_index, group_index, empty, traj_length, 0, empty)
        if (batch.t < 0).any() or (batch.t >= traj_length[traj_index]).any():
            raise ValueError("StepBatch.t must run 0..L-1 within each trajectory (found a gap or a negative index).")
        if (batch.truncated & (batch.t != traj_length[traj_index] - 1)).any():
            raise ValueError(
                "StepBatch.truncated marks a step that is not its trajectory's last; mark only the last step of a "
                "trajectory the turn budget cut."
            )
        max_length = int(traj_length.max())
        grid_position = traj_index * max_length + batch.t
        if torch.unique(grid_position).shape[0] != n:
            raise ValueError("StepBatch has two steps with the same (traj, t); each step index must appear once.")
        traj_group = torch.full((num_traj,), -1, dtype=torch.long).scatter_(0, traj_index, group_index)
        if (traj_group[traj_index] != group_index).any():
            raise ValueError("A trajectory appears in two task groups; StepBatch.group must be constant per traj.")
        return cls(traj_index, group_index, traj_group, traj_length, max_length, grid_position)

    def to_grid(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter per-step `values` (N,) into a (num_traj, T) grid padded with `fill`."""
        grid = values.new_full((self.num_traj * self.max_length,), fill)
        grid[self.grid_position] = values
        return grid.view(self.num_traj, self.max_length)

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """Gather a (num_traj, T) grid back to per-step order (N,)."""
        return grid.reshape(-1)[self.grid_position]
