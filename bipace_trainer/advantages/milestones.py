"""Milestones (BEACON): which steps reached a subgoal, the segments between them, and their return.

BEACON (arXiv 2605.06078, ICML 2026; code: ZJU-REAL/BEACON, `migpo/core_migpo.py`) splits each
trajectory at the steps that reached a *milestone*, a subgoal the env can verify, and credits
each step by how soon its segment's milestone came (docs/concepts/math.md#milestones):

    m_τ         the steps of trajectory τ that reached a milestone (`StepBatch.milestone`)
    seg(t)      = |{t' ∈ m_τ : t' < t}|                         milestones reached before step t
    next(t)     = min{t' ∈ m_τ : t' ≥ t}                        the step that closes t's segment
    R_t         = 10 · γ^(next(t) − t)   if next(t) exists,  else 0   (after the last milestone)

`seg` is axis 1 (`segment` partition: cells = (task group, seg)), R is axis 3
(`step_return="milestone"`); BEACON compares R within those cells by the cell mean (axis 2).

Where the flags come from. An env either flags the step that reached a milestone (WebShop's
page phases, ScienceWorld's score increases: `StepBatch.milestone`), or gives each task a
static, ordered list of milestone actions (ALFWorld's and TextCraft's expert plans:
`StepBatch.milestone_plan`), which BEACON's rule turns into flags: walking the trajectory's
actions in order, an action whose difflib ratio with the next unmatched milestone is at least
the threshold matches it, and the pointer moves on (`match_milestones`). A trajectory with a
plan takes its flags from the plan; one without keeps the env's flags.
"""

from __future__ import annotations

import copy
from difflib import SequenceMatcher
from typing import Sequence

import torch

from .records import BatchLayout, StepBatch

__all__ = ["MILESTONE_SCALE", "match_milestones", "with_plan_flags", "segment_index", "milestone_returns"]

MILESTONE_SCALE = 10.0  # the reference's 10 · γ^d ("GiGPO's [0, 10] scale")


def match_milestones(
    actions: Sequence[str], plan: Sequence[str], threshold: float, cache: dict[tuple[str, str], bool] | None = None
) -> list[bool]:
    """BEACON's in-order match of a trajectory's actions against its task's milestone plan.

    For each action in order, while milestones remain: it reaches milestone k (the first one not
    yet matched) when `SequenceMatcher(None, action, plan[k]).ratio() >= threshold`; then k + 1
    is the one to look for. A milestone never matched stops the walk's progress: later milestones
    cannot be reached past it.

    Args:
        actions: the trajectory's actions, t = 0..L-1.
        plan: the task's milestone actions, in order.
        threshold: difflib ratio in (0, 1] (BEACON's scripts: 0.95).
        cache: (action, milestone) -> match, shared by the calls on one batch: the G rollouts of a
            task repeat their actions, and a difflib ratio is the slow part.
    Returns:
        L flags, True at the steps that reached a milestone.
    """
    cache = {} if cache is None else cache
    flags = [False] * len(actions)
    k = 0
    for t, action in enumerate(actions):
        if k >= len(plan):
            break
        pair = (action, plan[k])
        if pair not in cache:
            cache[pair] = SequenceMatcher(None, action, plan[k]).ratio() >= threshold
        if cache[pair]:
            flags[t] = True
            k += 1
    return flags


def with_plan_flags(batch: StepBatch, layout: BatchLayout, threshold: float) -> StepBatch:
    """`batch` with `milestone` flags from the plans (`match_milestones`) where a trajectory has one.

    A shallow copy: the caller's batch is left as it is. Without plans, `batch` itself.
    """
    if batch.milestone_plan is None:
        return batch
    flags = batch.milestone.clone() if batch.milestone is not None else torch.zeros(len(batch), dtype=torch.bool)
    order = torch.argsort(layout.grid_position)  # (traj, t): each trajectory's steps in order
    bounds = torch.cumsum(layout.traj_length, 0).tolist()
    cache: dict[tuple[str, str], bool] = {}
    start = 0
    for end in bounds:
        rows = order[start:end]
        start = end
        plan_id = int(batch.milestone_plan[rows[0]])
        if plan_id < 0:
            continue
        actions = [batch.action_text[i] for i in rows.tolist()]
        flags[rows] = torch.tensor(match_milestones(actions, batch.milestone_plans[plan_id], threshold, cache))
    resolved = copy.copy(batch)
    resolved.milestone = flags
    return resolved


def segment_index(milestone: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """(N,) int64 seg(t): the milestones its trajectory reached before step t (the step itself excluded)."""
    grid = layout.to_grid(milestone.to(torch.long))
    return layout.from_grid(torch.cumsum(grid, 1) - grid)


def milestone_returns(milestone: torch.Tensor, layout: BatchLayout, gamma: float) -> torch.Tensor:
    """(N,) float64 R_t = 10 · γ^(next(t) − t), 0 after a trajectory's last milestone (module docstring).

    next(t) is a reverse running minimum over the padded (trajectory, t) grid: each step's
    nearest milestone at or after it.
    """
    steps = layout.max_length
    position = torch.arange(steps).expand(layout.num_traj, steps)
    never = steps  # past every step: no milestone follows
    at = torch.where(layout.to_grid(milestone, fill=False), position, never)
    following = torch.flip(torch.cummin(torch.flip(at, [1]), 1).values, [1])
    distance = (following - position).to(torch.float64)
    grid = torch.where(following < never, MILESTONE_SCALE * gamma**distance, torch.zeros_like(distance))
    return layout.from_grid(grid)
