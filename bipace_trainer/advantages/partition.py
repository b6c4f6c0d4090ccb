"""Axis 1 of the estimator design: the state partition (docs/concepts/math.md#state-partition).

A partition splits the steps of each task group into *cells*, the sets of steps that
count as "the same state" for the step baseline. Cells never cross task groups.

- `none`: no cells; the estimator has no step-level term (GRPO).
- `hash_partition`: steps with identical anchors share a cell (GiGPO, GAGPO).
- `hidden_partition`: leader clustering of the actor's hidden states by cosine
  distance (BiGPO), with `calibrate_eps` for `cluster_eps="auto"`.
- `context_partition`: HGPO's nested context levels over any of them (`context_levels`
  = K > 0): level k groups the steps whose last k+1 base cells agree
  (`LevelledPartition`).
- `segment_partition`: BEACON's segments, steps of a task group that reached the same
  number of milestones before them (`milestones`); not a state but a stage of the task.

`PARTITIONS` names them, as `BASELINES` names the step baselines. Each entry says which
`StepBatch` fields it reads (the trainer captures hidden states only for a partition
that reads `hidden`) and whether it takes the threshold ε (then `cluster_eps="auto"`
calibrates it). Adding a partition is one call, no edit of this package:

    register_partition("by_turn", lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.t))

or a `PartitionKind` object named by dotted path, `partition="my_package.cells:BY_ROOM"`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .milestones import segment_index
from .records import BatchLayout

if TYPE_CHECKING:
    from .records import StepBatch

__all__ = [
    "Partition",
    "LevelledPartition",
    "PartitionKind",
    "PARTITIONS",
    "register_partition",
    "resolve_partition",
    "hash_partition",
    "hidden_partition",
    "segment_partition",
    "context_partition",
    "leader_cluster",
    "calibrate_eps",
    "bisect_eps",
    "SAME_STATE_TOL",
]

# Leader clustering joins a cluster when d <= eps + SAME_STATE_TOL, so that two
# bit-identical hidden states always share a cell at eps = 0 despite float32 rounding
# in the dot product (|x·x - 1| reaches a few 1e-7 for d = 3,584); and two centroids
# whose distances to a step differ by at most SAME_STATE_TOL count as tied (the oldest wins).
SAME_STATE_TOL = 1e-5


@dataclass
class Partition:
    """Cells of a batch.

    Attributes:
        cell: (N,) int64 in [0, num_cells); cells are nested in task groups.
        size: (num_cells,) steps per cell.
    """

    cell: torch.Tensor
    size: torch.Tensor

    @property
    def num_cells(self) -> int:
        return self.size.shape[0]

    def step_cell_size(self) -> torch.Tensor:
        """(N,) size of each step's cell."""
        return self.size[self.cell]

    def singleton_rate(self) -> float:
        n = self.cell.shape[0]
        return float((self.step_cell_size() == 1).sum()) / n if n else 0.0

    @classmethod
    def from_labels(cls, group_index: torch.Tensor, label: torch.Tensor) -> "Partition":
        """Cells = distinct (group, label) pairs. label: (N,) int64, any range."""
        _, label_dense = torch.unique(label, return_inverse=True)
        num_labels = int(label_dense.max()) + 1 if label_dense.numel() else 1
        _, cell, size = torch.unique(group_index * num_labels + label_dense, return_inverse=True, return_counts=True)
        return cls(cell=cell, size=size)


@dataclass
class LevelledPartition(Partition):
    """Nested context levels over a base partition (HGPO, docs/concepts/math.md#context-levels): `context_partition`.

    Level k = 0..K holds the steps with t >= k, in cells of equal context
    C_k(t) = (c_{t-k}, ..., c_t), the base cells of the step and its k predecessors in
    its trajectory; level 0 is the base partition. Levels nest: G_0 ⊇ G_1 ⊇ ... ⊇ G_K.

    Attributes:
        cell, size: the flat partition a one-level baseline (`mean`, `pace_q`, ...) uses:
            each step in its deepest level, cells = distinct (min(K, t), C_min(K,t)), i.e.
            steps whose whole K-step context agrees (t < K: the whole history).
        levels: K+1 partitions of all N steps; a step without level k (t < k) sits in a
            cell of its own there, so a baseline gives it 0; `reach` says it is absent.
        reach: (N,) int64, min(K, t): the deepest level each step has.
    """

    levels: tuple[Partition, ...] = ()
    reach: torch.Tensor | None = None

    @property
    def depth(self) -> int:
        """K, the deepest level."""
        return len(self.levels) - 1


def context_partition(base: Partition, layout: BatchLayout, levels: int) -> LevelledPartition:
    """HGPO's hierarchy of context-consistent groups over the cells of `base` (docs/concepts/math.md#context-levels).

    Level-k label of step t: the level-(k-1) label paired with the base cell of step
    t-k of the same trajectory, so equal labels mean equal (c_{t-k}, ..., c_t); one
    `torch.unique` per level, O(K·N log N). The reference (verl-agent `core_hgpo.py`)
    keys its cells on the raw anchors of the window; over `hash_partition` the cells
    are the same, and a trajectory may put several of its steps into one cell.

    Args:
        base: cells of the batch (any partition: `hash`, `hidden`, a registered one).
        layout: the batch layout (trajectories, t).
        levels: K >= 0, the number of previous steps the deepest level compares.
    Returns:
        `LevelledPartition` with K+1 levels.
    """
    n = base.cell.shape[0]
    t = layout.grid_position - layout.traj_index * layout.max_length
    reach = t.clamp(max=levels)
    grid = layout.to_grid(base.cell, fill=-1).reshape(-1)
    unique_absent = -1 - torch.arange(n)  # a key no other step has
    label, labels, parts = base.cell, [base.cell], [base]
    for k in range(1, levels + 1):
        present = t >= k
        earlier = grid[(layout.grid_position - k).clamp(min=0)]  # base cell of step t-k
        key = torch.where(present, label * max(base.num_cells, 1) + earlier, unique_absent)
        _, label, size = torch.unique(key, return_inverse=True, return_counts=True)
        labels.append(label)
        parts.append(Partition(cell=label, size=size))
    stacked = torch.stack(labels)  # (K+1, N)
    deepest = stacked.gather(0, reach[None])[0] if n else reach
    _, cell, size = torch.unique(reach * max(n, 1) + deepest, return_inverse=True, return_counts=True)
    return LevelledPartition(cell=cell, size=size, levels=tuple(parts), reach=reach)


def hash_partition(anchor: torch.Tensor, layout: BatchLayout) -> Partition:
    """GiGPO's anchor-state grouping: one cell per distinct anchor within a task group
    (docs/concepts/math.md#anchor-partition).

    Args:
        anchor: (N,) int64 anchor ids (see `factorize`).
    """
    if anchor is None:
        raise ValueError("partition='hash' needs StepBatch.anchor (the raw current observation of each step).")
    return Partition.from_labels(layout.group_index, anchor)


def segment_partition(milestone: torch.Tensor, layout: BatchLayout) -> Partition:
    """BEACON's segment groups: one cell per (task group, milestones reached before the step)
    (docs/concepts/math.md#milestones).

    Args:
        milestone: (N,) bool, the steps that reached a milestone (`StepBatch.milestone`).
    """
    if milestone is None:
        raise ValueError(
            "partition='segment' needs StepBatch.milestone (or milestone_plan and action_text): the env's milestones."
        )
    return Partition.from_labels(layout.group_index, segment_index(milestone, layout))


def _visit_order(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps sorted by (group, traj, t); groups ordered by decreasing size.

    Returns (order (N,), group_start (G,), group_size (G,)) with groups in that order,
    so the groups still active at round r of the clustering are a prefix.
    """
    by_time = torch.argsort(layout.grid_position)  # (traj, t) order; traj ids sorted
    group_size = torch.bincount(layout.group_index, minlength=layout.num_groups)
    group_rank = torch.empty_like(group_size)
    group_rank[torch.argsort(-group_size, stable=True)] = torch.arange(group_size.shape[0])
    order = by_time[torch.argsort(group_rank[layout.group_index[by_time]], stable=True)]
    size_sorted = group_size[torch.argsort(group_rank)]
    start = torch.cumsum(size_sorted, 0) - size_sorted
    return order, start, size_sorted


def leader_cluster(hidden: torch.Tensor, layout: BatchLayout, eps: float, block: int = 32) -> torch.Tensor:
    """Leader clustering of steps by cosine distance, independently in each task group
    (docs/concepts/math.md#hidden-partition).

    φ(s) = h / ‖h‖₂ and d(u, v) = 1 - uᵀv. Steps are visited in (trajectory, t)
    order; a step joins the nearest centroid of its group if d <= eps (ties, within
    SAME_STATE_TOL: the oldest cluster), else founds a new cluster. A centroid is the
    re-normalised mean of its members, i.e. the direction of the member sum s_k.

    The sequential rule is evaluated exactly, but blockwise, so the d-dimensional work
    runs as dense matrix products instead of one small product per step. Each cluster
    is kept as its member sum s_k (unit rows summed, float32) and ‖s_k‖ (float64), so
    the centroid never has to be re-normalised. The task groups of a chunk (as many as
    keep one block of rows within 8 MiB) advance together; for the next `block` steps
    of every group:

        P = X_b Sᵀ          x_i · s_k for the sums at block start
        Q = X_b X_bᵀ        dots between the block's steps
        x_i · s_k = P[i, k] + Σ_{j<i in block, j joined k} Q[i, j]
        ‖s_k + x_i‖² = ‖s_k‖² + 2 x_i · s_k + ‖x_i‖²
        similarity to centroid k = x_i · s_k / ‖s_k‖

    so the walk through the block touches only scalars (numpy, float64), and the sums
    take the block's rows with one scatter-add.

    Cost for N steps, d dimensions, G groups of at most n steps, K clusters and C
    chunks: 2·N·(K + block)·d flops in batched GEMMs (the floor: every step meets every
    centroid of its group, as the rule demands), each row read from memory once
    (normalised, multiplied and scattered while its block is in cache), and C·n
    iterations of the scalar walk on (G/C, K + block) arrays. Measured by bench/estimators.py
    on batches of groups × 8 rollouts × 50 steps at d = 3,584: with ~30 distinct states
    (K ≈ 30) per group, 110-140k steps/s on 2 idle cores from 6,400 to 100k steps, 4-5× the
    GiGPO reference timed in the same run (docs/performance.md); with 170-400 distinct
    states (K ≈ 150-250) per group the cost per step grows with K: 19-30k steps/s per thread
    on an idle machine (issue 51), 3.2-5.3k on one thread of a loaded one
    (`--clustering`, docs/results/graphgpo.md).

    Args:
        hidden: (N, d) float hidden states (any scale; rows are L2-normalised here).
        layout: the batch layout (groups, visit order).
        eps: cosine-distance threshold in [0, 2].
        block: steps per group handled per dense product (a speed knob only).
    Returns:
        (N,) int64 cluster label, local to the step's task group (0, 1, ... in order
        of foundation).
    """
    n, dim = hidden.shape
    label = torch.zeros(n, dtype=torch.long)
    if n == 0:
        return label
    order, start, size = _visit_order(layout)
    hidden = hidden.to(torch.float32)
    threshold = 1.0 - eps - SAME_STATE_TOL  # join when similarity >= 1 - eps (- tol)
    # Groups are independent: take them `chunk` at a time, so that one block of rows
    # (chunk × block × d floats) stays near the cache instead of streaming from memory.
    chunk = max(1, min(size.shape[0], _BLOCK_FLOATS // (block * dim)))
    for g0 in range(0, size.shape[0], chunk):
        _cluster_groups(hidden, order, start[g0 : g0 + chunk], size[g0 : g0 + chunk], threshold, block, label)
    return label


# Floats per block of rows (8 MiB, 18 groups at d = 3,584 and block 32): measured on
# 2 cores, 15-20% faster on 25.6k- and 100k-step batches than all groups at once.
_BLOCK_FLOATS = 2**21


def _cluster_groups(hidden, order, start, size, threshold, block, label) -> None:
    """`leader_cluster` on the groups (start, size), sorted by decreasing size; writes `label`."""
    n, dim = hidden.shape
    num_groups, rounds = size.shape[0], int(size[0])
    # A group founds at most one cluster per step, so `rounds` slots always suffice. The sums
    # are allocated once, uninitialised (untouched pages cost nothing), and each slot is zeroed
    # when it first comes into use: growing by doubling copied every sum at each growth
    # (torch.cat), 22-35% of the clustering at 170-400 states per group.
    capacity = _padded(rounds)
    member_sum = hidden.new_empty(num_groups, capacity, dim)  # s_k, valid for the slots below `zeroed`
    member_norm = np.zeros((num_groups, capacity))  # ‖s_k‖
    zeroed = 0
    num_clusters = np.zeros(num_groups, dtype=np.int64)
    x_buffer = hidden.new_empty(num_groups * block, dim)  # reused: fresh multi-MB tensors page-fault
    for r0 in range(0, rounds, block):
        active = int((size > r0).sum())  # groups are sorted by size: a prefix
        width = min(block, rounds - r0)
        rank = r0 + torch.arange(width)
        present_t = rank[None, :] < size[:active, None]  # (A, b) step exists
        present = present_t.numpy()
        steps = order[(start[:active, None] + rank[None, :]).clamp(max=n - 1)].reshape(-1)
        x_b = torch.index_select(hidden, 0, steps, out=x_buffer[: active * width])
        # Unit rows, absent rows 0; normalised here while the block is in cache.
        x_b.mul_((present_t.reshape(-1) / torch.linalg.vector_norm(x_b, dim=1).clamp(min=1e-30))[:, None])
        k0 = int(num_clusters[:active].max())
        slots = k0 + width  # existing clusters + at most one new per step (<= rounds)
        if _padded(slots) > zeroed:  # the GEMM below reads slots up to _padded(k0): keep them finite
            member_sum[:, zeroed : _padded(slots)].zero_()
            zeroed = _padded(slots)
        x_g = x_b.view(active, width, dim)
        gram = torch.bmm(x_g, x_g.transpose(1, 2)).double().numpy()  # (A, b, b)
        dots = np.zeros((active, width, slots))  # x_i · s_k for the clusters at block start
        if k0:
            # GEMM kernels are much faster on multiples of 16 columns; extra slots hold 0.
            sums = member_sum[:active, : min(_padded(k0), capacity)]
            dots[..., :k0] = torch.bmm(x_g, sums.transpose(1, 2))[..., :k0].double().numpy()
        # ‖s_k‖ of the active groups, a view: the walk updates it in place
        block_label = _walk_block(dots, gram, member_norm[:active, :slots], num_clusters[:active], present, threshold)
        # s_k += Σ members. Absent rows are 0 and point at a slot in range: adding them is a no-op.
        flat = torch.from_numpy((np.arange(active)[:, None] * capacity + block_label).reshape(-1))
        member_sum.view(-1, dim).scatter_add_(0, flat[:, None].expand(-1, dim), x_b)
        label[steps.view(active, width)[present_t]] = torch.from_numpy(block_label[present])


def _padded(k: int, multiple: int = 16) -> int:
    return -(-k // multiple) * multiple


def _walk_block(dots, gram, norm, num_clusters, present, threshold) -> np.ndarray:
    """The sequential leader rule over one block, on scalars only (float64, in place).

    Args:
        dots: (A, b, S) x_i · s_k for the clusters at block start (0 for new slots).
        gram: (A, b, b) x_i · x_j within the block.
        norm: (A, S) ‖s_k‖, updated as steps join.
        num_clusters: (A,) clusters per group, updated as steps found new ones.
        present: (A, b) which steps exist.
    Returns:
        (A, b) cluster index of each step.
    """
    active, width, slots = dots.shape
    joined = np.zeros((active, width, slots))  # joined[a, j, k] = 1: block step j went to cluster k
    labels = np.zeros((active, width), dtype=np.int64)
    rows = np.arange(active)
    slot_ids = np.arange(slots)
    for i in range(width):
        dot = dots[:, i] + np.matmul(gram[:, i, None, :i], joined[:, :i])[:, 0]  # x_i · s_k now
        with np.errstate(divide="ignore", invalid="ignore"):
            sim = np.where(slot_ids < num_clusters[:, None], dot / norm, -np.inf)
        # Ties go to the oldest cluster, and a tie is within SAME_STATE_TOL: equal distances
        # reach here through different float32 sums (a centroid of 4 equal members and one
        # of 1 give x·s/‖s‖ a few 1e-8 apart), and a bare argmax would follow that rounding.
        near_best = sim >= sim.max(axis=1, keepdims=True) - SAME_STATE_TOL
        best = near_best.argmax(axis=1)  # first True: the oldest cluster within the tolerance
        join = sim[rows, best] >= threshold
        target = np.where(join, best, num_clusters)
        here = present[:, i]
        r, k = rows[here], target[here]
        norm[r, k] = np.sqrt(np.maximum(norm[r, k] ** 2 + 2 * dot[r, k] + gram[r, i, i], 0.0))
        joined[r, i, k] = 1.0
        num_clusters[r] += ~join[here]
        labels[:, i] = target
    return labels


def hidden_partition(hidden: torch.Tensor, layout: BatchLayout, eps: float) -> Partition:
    """BiGPO's partition: leader clusters of hidden states within each task group."""
    if hidden is None:
        raise ValueError("partition='hidden' needs StepBatch.hidden (hidden states at cluster_layer).")
    return Partition.from_labels(layout.group_index, leader_cluster(hidden, layout, eps))


def calibrate_eps(
    hidden: torch.Tensor,
    layout: BatchLayout,
    target_singleton_rate: float,
    max_eps: float,
    iterations: int = 12,
) -> float:
    """Smallest ε whose singleton rate is at most `target_singleton_rate`, capped at `max_eps`
    (docs/concepts/math.md#eps-calibration).

    The singleton rate falls (almost always monotonically) as ε grows, so the boundary
    is found by bisection on [0, max_eps] to a resolution of max_eps / 2**iterations;
    the returned ε satisfies the target unless even `max_eps` does not, in which case
    `max_eps` is returned. Each probe is one `leader_cluster` call on the batch.
    """
    rate = lambda eps: hidden_partition(hidden, layout, eps).singleton_rate()  # noqa: E731
    return bisect_eps(rate, target_singleton_rate, max_eps, iterations)


def bisect_eps(
    rate: Callable[[float], float], target_singleton_rate: float, max_eps: float, iterations: int = 12
) -> float:
    """`calibrate_eps` for any partition that takes ε: `rate(ε)` is its singleton rate on the batch."""
    if rate(0.0) <= target_singleton_rate:
        return 0.0
    if rate(max_eps) > target_singleton_rate:
        return float(max_eps)
    low, high = 0.0, float(max_eps)  # rate(low) > target >= rate(high)
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        if rate(mid) <= target_singleton_rate:
            high = mid
        else:
            low = mid
    return high


@dataclass(frozen=True)
class PartitionKind:
    """A state partition the estimator can use (docs/concepts/math.md#state-partition), as `PARTITIONS` holds it.

    Attributes:
        build: (batch, layout, eps) -> `Partition`, cells nested in task groups; eps is
            a float in [0, 2] when `takes_eps`, else None. None for the `none`
            partition: no cells, so no step-level term.
        needs: the `StepBatch` fields `build` reads ("anchor", "hidden", ...): the
            rollout must fill them, and the trainer captures hidden states only when
            "hidden" is among them.
        takes_eps: `build` reads the threshold ε, so `cluster_eps` applies to it
            ("auto": the smallest ε reaching `target_singleton_rate`, `bisect_eps`).
    """

    build: Callable[["StepBatch", BatchLayout, float | None], Partition] | None
    needs: frozenset[str] = field(default_factory=frozenset)
    takes_eps: bool = False

    @property
    def has_cells(self) -> bool:
        return self.build is not None


PARTITIONS: dict[str, PartitionKind] = {
    "none": PartitionKind(build=None),
    "hash": PartitionKind(
        build=lambda batch, layout, eps: hash_partition(batch.anchor, layout), needs=frozenset({"anchor"})
    ),
    "hidden": PartitionKind(
        build=lambda batch, layout, eps: hidden_partition(batch.hidden, layout, eps),
        needs=frozenset({"hidden"}),
        takes_eps=True,
    ),
    "segment": PartitionKind(
        build=lambda batch, layout, eps: segment_partition(batch.milestone, layout), needs=frozenset({"milestone"})
    ),
}


def register_partition(
    name: str,
    build: Callable[["StepBatch", BatchLayout, float | None], Partition],
    *,
    needs: tuple[str, ...] | frozenset[str] = (),
    takes_eps: bool = False,
) -> PartitionKind:
    """Add a partition under `name` (see `PartitionKind` for the arguments); returns the entry."""
    from .records import StepBatch

    fields = set(StepBatch.__dataclass_fields__)
    unknown = set(needs) - fields
    if unknown:
        raise ValueError(
            f"register_partition({name!r}): needs={sorted(unknown)} are not StepBatch fields; use some of {sorted(fields)}."
        )
    kind = PartitionKind(build=build, needs=frozenset(needs), takes_eps=takes_eps)
    PARTITIONS[name] = kind
    return kind


def resolve_partition(name: str) -> PartitionKind:
    """The registered partition `name`, or a `PartitionKind` imported from "package.module:NAME"."""
    if name in PARTITIONS:
        return PARTITIONS[name]
    if isinstance(name, str) and ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            kind = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"partition={name!r}: could not import {attr!r} from {module_name!r} ({err}).") from None
        if not isinstance(kind, PartitionKind):
            raise ValueError(f"partition={name!r} is {kind!r}, not a bipace_trainer.advantages.PartitionKind.")
        return kind
    raise ValueError(
        f"partition={name!r} is not a registered partition; choose one of {sorted(PARTITIONS)}, add one with "
        "bipace_trainer.advantages.register_partition, or give a dotted path 'package.module:NAME'."
    )
