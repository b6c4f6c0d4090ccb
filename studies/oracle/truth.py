"""Rollouts with known truth, for `oracle_study.py`: a behaviour policy of controllable skill,
each step's true env state, and the oracle's V*, Q* and A* from the env's own solver.

    batch = truth_rollouts("textcraft", task_ids=[128, 129], group_size=8, expert_prob=0.7,
                           max_turns=30, seed=0)
    batch.rollout.steps[k]   # the trainer's StepRecord (prompt built by run_rollouts)
    batch.truth[k]           # TruthStep: true state, solver distance, expert or random, V*, Q*, A*

The episodes are played by the trainer's own `run_rollouts` (prompt builder, reply parser,
action keys, anchors); only the policy is scripted: at each step it takes the env's expert
action with probability `expert_prob`, otherwise a uniformly random admissible action
(ALFWorld) or a random plausible command (TextCraft, which lists no admissible actions: one
of the task's crafting commands, a `get` of an item they name, or `inventory`).

Oracle. Rewards are sparse (1 on the step that wins), so with discount γ and a turn budget T,
from state s at turn t with d(s) the length of the solver's plan from s:

    V*(s, t)    = γ^(d(s) - 1)   if 1 <= d(s) <= T - t, else 0
    Q*(s, a, t) = 1 if a wins, else γ V*(s', t + 1)      (V* = 0 past the budget)
    A*(s, a, t) = Q*(s, a, t) - V*(s, t)

An action on the solver's plan has A* = 0; a turn that leaves d unchanged has
A* = γ^d - γ^(d-1) < 0. d comes from TextCraft's recipe solver (`envs.textcraft._plan`,
the plan `expert_action` follows, recomputed from the inventory) and from ALFWorld's planner
(`AlfWorldEnv._expert_plan`: fast-downward's uniform-cost search from the current PDDL
state, optimal), memoised per true state. TextCraft's solver is a greedy recipe expansion,
not a proven optimum: an action with A* > 0 would be one that beats it, and the study
counts them.

The true state is TextCraft's goal and inventory (the env's anchor is exactly that), and
ALFWorld's PDDL fact set. Under surface variation (`env_kwargs={"surface_variation": ...}`) the
oracle reads the engine behind the wrapper and its unvaried result, so the true state, the
plans and the behaviour policy are those of the unvaried episode; only the text the trainer's
prompts and anchors are built from varies. Neither env has a public accessor for its state or its solver,
so `_TextCraftTruth` and `_AlfWorldTruth` read the engines' attributes here (kept in these
two small classes, the only place that does).
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from bipace_trainer.run.demonstrations import format_reply
from bipace_trainer.rollout.loop import Generation, Rollout, RolloutSettings, TaskRef, run_rollouts
from envs.base import MILESTONE_PLAN, StepResult, resolve_env_class
from envs.factory import build_env
from envs.surface import SurfaceVariation, unwrap

__all__ = ["TruthStep", "TruthBatch", "truth_rollouts", "oracle_values", "TRUTH"]


@dataclass
class TruthStep:
    """What the oracle knows about one step (aligned with `Rollout.steps`)."""

    state: str  # the true state s_t, as a canonical string
    distance: int | None  # d(s_t): solver plan length, None when the solver finds no plan
    expert_action: str | None
    took_expert: bool
    messages: list[dict[str, str]]  # the prompt the trainer would build
    v_star: float = 0.0
    q_star: float = 0.0
    a_star: float = 0.0


@dataclass
class TruthBatch:
    rollout: Rollout
    truth: list[TruthStep]
    seconds: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------- per-env truth


class _TextCraftTruth:
    """TextCraft: state = goal + inventory (the anchor), d = length of the recipe solver's plan."""

    _COMMAND = re.compile(r"^craft \d+ .+ using .+$")
    _INGREDIENT = re.compile(r"(\d+) ([a-z][a-z ]*[a-z])")

    def state(self, env, result: StepResult) -> str:
        return result.anchor

    def plan(self, env) -> list[str] | None:
        from envs.textcraft import _plan

        if env.done or env._goal_item is None:
            return []
        return _plan(env._engine.crafting_tree, env._goal_item, env._engine.inventory)

    def random_action(self, env, result: StepResult, rng: random.Random) -> str:
        """One of the task's crafting commands, a `get` of an item they name (count 1-4), or `inventory`."""
        commands = sorted(line for line in env.task.splitlines() if self._COMMAND.match(line))
        items = sorted({name for line in commands for _, name in self._INGREDIENT.findall(line.partition(" using ")[2])})
        choices = commands + [f"get {{}} {item}" for item in items] + ["inventory"]
        choice = rng.choice(choices)
        return choice.format(rng.randint(1, 4)) if "{}" in choice else choice


class _AlfWorldTruth:
    """ALFWorld: state = the engine's PDDL fact set, d = planner's plan length (memoised per fact set).

    The state leaves out the `not_*` atoms: the translated domain adds e.g.
    `not_atlocation(agent1, l)` for every place the agent has left, a record of the path
    rather than of the room (two visits to the same room with the same objects differ only
    there). Plans are memoised on the full fact set; the study checks that states equal
    without those atoms always get the same d.
    """

    def __init__(self):
        self._plans: dict[tuple[str, frozenset], list[str] | None] = {}

    @staticmethod
    def _atoms(env) -> list[str]:
        facts = env._engine._env.unwrapped._pddl_state.facts
        return [
            f"{fact.name}({','.join(v.name for v in fact.arguments)})" for fact in facts if not fact.name.startswith("new-axiom@")
        ]

    def state(self, env, result: StepResult) -> str:
        return ";".join(sorted(atom for atom in self._atoms(env) if not atom.startswith("not_")))

    def plan(self, env) -> list[str] | None:
        if env.done:
            return []
        key = (env._game.path, frozenset(self._atoms(env)))
        if key not in self._plans:
            self._plans[key] = env._expert_plan()
        return self._plans[key]

    def random_action(self, env, result: StepResult, rng: random.Random) -> str:
        return rng.choice(result.admissible_actions)


TRUTH = {"textcraft": _TextCraftTruth, "alfworld": _AlfWorldTruth}


# ---------------------------------------------------------------------- rollouts


class _TruthEnvs:
    """The reset/step contract `run_rollouts` expects (as `VectorEnv`'s serial backend), over
    env instances this process can inspect; remembers each env's latest result.

    With `surface_variation` in env_kwargs, env i is wrapped in `SurfaceVariation` with stream i
    (a batch renders the same whatever ran before it in the process), and `view(i)` gives the
    oracle the engine and its unvaried result: the true state never sees the variation.
    """

    def __init__(self, env: str, num_envs: int, env_kwargs: dict[str, Any]):
        env_class = resolve_env_class(env)
        self.envs = [build_env(env_class, env_kwargs, stream=i) for i in range(num_envs)]
        self.latest: list[StepResult | None] = [None] * num_envs
        self.seconds = 0.0

    def view(self, i: int) -> tuple[Any, StepResult | None]:
        """(the engine of env i, its latest result as the engine rendered it)."""
        instance = self.envs[i]
        if isinstance(instance, SurfaceVariation):
            return unwrap(instance), instance.last_unvaried
        return instance, self.latest[i]

    def reset(self, task_ids: Sequence[int]) -> list[StepResult]:
        start = time.perf_counter()
        results = []
        for env, task_id in zip(self.envs, task_ids):
            result = env.reset(task_id)
            result.info = {**(result.info or {}), "task": env.task}
            if env.milestone_kind == "plan":  # as VectorEnv(milestones=True) does: BEACON's plan rows
                result.info[MILESTONE_PLAN] = env.milestones()
            results.append(result)
        self.latest = list(results)
        self.seconds += time.perf_counter() - start
        return results

    def step(self, actions: Sequence[str | None]) -> list[StepResult | None]:
        start = time.perf_counter()
        results = [env.step(action) if action is not None else None for env, action in zip(self.envs, actions)]
        self.latest = [new if new is not None else old for new, old in zip(results, self.latest)]
        self.seconds += time.perf_counter() - start
        return results

    def close(self) -> None:
        for env in self.envs:
            env.close()


def truth_rollouts(
    env: str,
    task_ids: Sequence[int],
    *,
    group_size: int,
    expert_prob: float,
    max_turns: int,
    seed: int,
    gamma: float = 0.95,
    history_length: int = 2,
    env_kwargs: dict[str, Any] | None = None,
    truth=None,
) -> TruthBatch:
    """`group_size` rollouts of each task by the behaviour policy, with the oracle's values per step.

    Args:
        env: "textcraft" or "alfworld".
        task_ids: one task group per id (G rollouts each, as in training).
        expert_prob: probability of the expert's action at each step.
        max_turns, gamma: the training turn budget and discount (they define V*).
        truth: a `TRUTH[env]()` instance to reuse (ALFWorld memoises plans per state in it).
    """
    truth = truth or TRUTH[env]()
    rng = random.Random(f"{env}/{seed}/{expert_prob}")
    tasks = [TaskRef(task_id, group) for group, task_id in enumerate(task_ids) for _ in range(group_size)]
    envs = _TruthEnvs(env, len(tasks), env_kwargs or {})
    per_env: list[list[TruthStep]] = [[] for _ in tasks]
    seconds = {"solver": 0.0}

    def policy(messages: list) -> Generation:
        active = [i for i, result in enumerate(envs.latest) if result is not None and not result.done]
        active = [i for i in active if len(per_env[i]) < max_turns][: len(messages)]
        assert len(active) == len(messages), "policy and rollout disagree on the active envs"
        texts = []
        for i, message in zip(active, messages):
            instance, result = envs.view(i)
            start = time.perf_counter()
            state = truth.state(instance, result)
            plan = truth.plan(instance)
            expert = instance.expert_action()
            seconds["solver"] += time.perf_counter() - start
            took_expert = expert is not None and rng.random() < expert_prob
            action = expert if took_expert else truth.random_action(instance, result, rng)
            distance = None if plan is None else len(plan)
            per_env[i].append(TruthStep(state, distance, expert, took_expert, message))
            texts.append(format_reply(action))
        return Generation([[] for _ in texts], [[] for _ in texts], texts)

    settings = RolloutSettings(
        max_turns=max_turns,
        history_length=history_length,
        instruction=envs.envs[0].instruction,
        invalid_action=envs.envs[0].invalid_action,
    )
    try:
        rollout = run_rollouts(envs, tasks, policy, settings)
    finally:
        envs.close()
    seconds["env"] = envs.seconds
    aligned = [per_env[step.traj][step.t] for step in rollout.steps]
    oracle_values(rollout, aligned, max_turns, gamma)
    return TruthBatch(rollout, aligned, seconds)


def oracle_values(rollout: Rollout, truth: list[TruthStep], max_turns: int, gamma: float) -> None:
    """Fill V*, Q*, A* of every step in place (see the module docstring)."""

    def value(distance: int | None, turn: int) -> float:
        if distance is None or distance < 1 or distance > max_turns - turn:
            return 0.0
        return gamma ** (distance - 1)

    by_position = {(step.traj, step.t): k for k, step in enumerate(rollout.steps)}
    winning = {(e.traj, e.length - 1) for e in rollout.episodes if e.won}  # the step that won each won episode
    for k, step in enumerate(rollout.steps):
        info = truth[k]
        info.v_star = value(info.distance, step.t)
        if (step.traj, step.t) in winning:
            info.q_star = 1.0
        else:
            after = by_position.get((step.traj, step.t + 1))
            info.q_star = gamma * value(truth[after].distance, step.t + 1) if after is not None else 0.0
        info.a_star = info.q_star - info.v_star
