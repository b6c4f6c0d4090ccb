"""A tiny deterministic env with an exact optimal policy, for unit and end-to-end tests.

The agent stands on a numbered line of `size` cells and must walk to a goal cell:

    Task: reach cell 3.    Observation: "You are at cell 1. The goal is cell 3, to your right."
    Admissible actions: ["left", "right"] (only the moves that stay on the line)

Reward 1.0 and `won` when the agent steps onto the goal; every move costs nothing.
The observation names the goal's side, so a small model can learn the optimal policy
by reading one word: the env tests the RL machinery, not reasoning.
Anchors repeat across rollouts of one task (same cell, same goal), so exact-match
grouping has non-singleton cells, and the optimal policy is known exactly:
move toward the goal, taking |goal - start| steps. An action that is not admissible
leaves the agent where it is ("Nothing happens.").

Milestones (`milestone_kind = "flag"`): a move that brings the agent nearer the goal than it
has been in this episode reaches one (`info["milestone"]`), so the optimal policy reaches one
every step and a detour none until it makes up the lost ground.

Task ids enumerate (start, goal) pairs with start != goal; `split="valid"` holds
every fifth pair out of `train`. `goal_side="right"` keeps only goals to the right of
the start, so the optimal policy ("right") no longer depends on the state: a policy
that starts at random then learns within a few RL steps (the CI learning test).
"""

from __future__ import annotations

from typing import Any

from .base import MILESTONE_FLAG, StepResult, TaskSpec, TextEnv, normalise_action, register_env

__all__ = ["TinyEnv"]


def _pairs(size: int, goal_side: str = "any") -> list[tuple[int, int]]:
    if goal_side not in ("any", "right"):
        raise ValueError(f"TinyEnv goal_side={goal_side!r}: use 'any' or 'right'.")
    return [
        (start, goal)
        for start in range(size)
        for goal in range(size)
        if start != goal and (goal_side == "any" or goal > start)
    ]


@register_env("tiny")
class TinyEnv(TextEnv):
    instruction = "You are an agent on a numbered line of cells. Move left or right to reach the goal cell."
    invalid_action = "stay"
    report_key = "distance"
    milestone_kind = "flag"

    def __init__(self, size: int = 4, goal_side: str = "any"):
        if size < 2:
            raise ValueError(f"TinyEnv size={size}: the line needs at least 2 cells; set size >= 2.")
        _pairs(size, goal_side)  # validates goal_side
        self.size = size
        self.goal_side = goal_side
        self.position = 0
        self.goal = 1
        self.nearest = 0  # the episode's smallest distance to the goal so far
        self.done = True

    @classmethod
    def tasks(cls, split: str = "train", size: int = 4, goal_side: str = "any", **_: Any) -> list[TaskSpec]:
        if split not in cls.splits():
            raise ValueError(f"split={split!r} is not a TinyEnv split; use one of {cls.splits()}.")
        specs = []
        for task_id, (start, goal) in enumerate(_pairs(size, goal_side)):
            held_out = task_id % 5 == 4
            if (split == "valid") == held_out:
                specs.append(TaskSpec(task_id, split, {"start": start, "goal": goal, "distance": abs(goal - start)}))
        return specs

    def _admissible(self) -> list[str]:
        moves = []
        if self.position > 0:
            moves.append("left")
        if self.position < self.size - 1:
            moves.append("right")
        return moves

    def _result(self, feedback: str, reward: float = 0.0, milestone: bool = False) -> StepResult:
        side = "here" if self.position == self.goal else ("to your right" if self.goal > self.position else "to your left")
        anchor = f"You are at cell {self.position}. The goal is cell {self.goal}, {side}."
        observation = f"{feedback} {anchor}".strip()
        won = self.position == self.goal
        return StepResult(
            observation=observation,
            reward=reward,
            done=self.done,
            won=won and self.done,
            admissible_actions=None if self.done else self._admissible(),
            anchor=anchor,
            info={MILESTONE_FLAG: milestone},
        )

    def reset(self, task_id: int) -> StepResult:
        pairs = _pairs(self.size, self.goal_side)
        self.position, self.goal = pairs[task_id % len(pairs)]
        self.done = False
        self.nearest = abs(self.goal - self.position)
        self.task = f"reach cell {self.goal}."
        return self._result("")

    def step(self, action: str) -> StepResult:
        if self.done:
            return self._result("The episode is over.")
        move = normalise_action(action)
        if move not in self._admissible():
            return self._result("Nothing happens.")
        self.position += 1 if move == "right" else -1
        closer = abs(self.goal - self.position) < self.nearest
        self.nearest = min(self.nearest, abs(self.goal - self.position))
        if self.position == self.goal:
            self.done = True
            return self._result("You reached the goal!", reward=1.0, milestone=closer)
        return self._result(f"You moved {move}.", milestone=closer)

    def expert_action(self) -> str | None:
        if self.done:
            return None
        return "right" if self.goal > self.position else "left"
