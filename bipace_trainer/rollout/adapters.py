"""Kinds of environment as the rollout loops play them: `EnvAdapter`, and `TextEnvAdapter` for our `TextEnv`s.

An adapter says what the prompt of env i is, how a reply becomes an action, and how the envs are
stepped; `tool_envs.ToolEnvAdapter` plays TRL's `environment_factory` envs. These change when a
kind of environment does; the loops (`lockstep`, `continuous`) do not.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from envs.base import StepResult

from .actions import parse_reply, token_prefix_key
from .prompting import action_for_env, build_messages
from .types import Action, RolloutSettings, TaskRef

__all__ = ["EnvAdapter", "TextEnvAdapter", "is_failure"]


class EnvAdapter:
    """One kind of environment as `run_rollouts` plays it: what the prompt of env i is,
    how a reply becomes an action, and how the envs are stepped.

    `start` resets the envs for `tasks` and returns the first results (a `StepResult`
    whose `info` has "env_failure" fails that episode); `messages(i, turn)` is env i's
    chat prompt; `act` parses env i's reply; `step` sends the actions (None: inactive)
    and returns the results, updating the adapter's own per-episode state (history, a
    chat); `finish` may add end-of-episode rewards once every episode is over. A result
    whose `info` holds "truncated" ends its episode as cut by a budget, not by the env.
    The trainer-side part of a kind (its tasks, its `VectorEnv`) is in `collector.py`.
    """

    uses_tools = False  # prompts are rendered with the tool schema of `environment(i)`

    def start(self, envs, tasks: Sequence[TaskRef]) -> list[StepResult | None]:
        raise NotImplementedError

    def messages(self, i: int, turn: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def environment(self, i: int) -> Hashable:
        return None

    def act(self, i: int, text: str, prompt_ids: list[int], completion_ids: list[int]) -> Action:
        raise NotImplementedError

    def step(self, envs, actions: list[Action | None]) -> list[StepResult | None]:
        raise NotImplementedError

    def finish(self, envs, rollout: "Rollout") -> None:
        """Called once, after the last turn; the default adds nothing."""


class TextEnvAdapter(EnvAdapter):
    """Our `TextEnv`s: a GiGPO-format prompt (`prompting.build_messages`) and an
    `<action>` reply (`actions.parse_reply`); a malformed one sends `invalid_action`."""

    def __init__(self, settings: RolloutSettings):
        self.settings = settings

    def start(self, envs, tasks):
        self.current = envs.reset([task.task_id for task in tasks]) if tasks else []
        self.task_text = [(r.info or {}).get("task", "") if r is not None else "" for r in self.current]
        self.history: list[list[tuple[str, str]]] = [[] for _ in tasks]
        return self.current

    def messages(self, i, turn):
        settings, current = self.settings, self.current[i]
        return build_messages(
            settings.instruction,
            self.task_text[i],
            self.history[i],
            current.observation,
            current.admissible_actions,
            step_index=turn,
            history_length=settings.history_length,
        )

    def act(self, i, text, prompt_ids, completion_ids):
        settings = self.settings
        reply = parse_reply(text, require_think=settings.require_think)
        key = token_prefix_key(completion_ids, settings.action_key_tokens) if settings.action_key_tokens else reply.key
        return Action(action_for_env(reply, settings.invalid_action), reply.valid, key, reply)

    def step(self, envs, actions):
        results = envs.step([a.command if a is not None else None for a in actions]) if any(actions) else [None] * len(actions)
        for i, (action, result) in enumerate(zip(actions, results)):
            if action is not None and not is_failure(result):
                self.history[i].append((self.current[i].observation, action.command))
                self.current[i] = result
        return results


def is_failure(result: StepResult | None) -> bool:
    return result is None or "env_failure" in (result.info or {})

