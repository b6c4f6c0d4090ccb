"""Demonstration data from an env's expert, for supervised warm starts (TRL's SFTTrainer).

An instruct model starts RL succeeding *sometimes*; a tiny or randomly initialised
model never does, since it cannot even produce the reply format. A short SFT on
(perturbed) expert trajectories gives it that starting point:

    rows = collect_demonstrations("tiny", task_ids, expert_prob=0.5, seed=0)
    SFTTrainer(model, train_dataset=Dataset.from_list(rows), ...)

Each row is one step in TRL's conversational prompt-completion format, with the
prompt built by `prompting.build_messages` exactly as the rollout builds it, so the
warm-started policy sees at RL time the prompts it was trained on. With probability
`1 - expert_prob` a step takes a random admissible action instead of the expert's
(and the demonstration records that action), so the data holds recoverable
mistakes and the warm-started policy's success rate lands between random and expert.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from envs.base import TextEnv
from envs.factory import make_env

from ..rollout.prompting import build_messages

__all__ = ["collect_demonstrations", "format_reply"]


def format_reply(action: str, thought: str = "") -> str:
    """The reply format the parser accepts: ``<think>…</think><action>…</action>``."""
    return f"<think>{thought}</think><action>{action}</action>"


def collect_demonstrations(
    env: str | TextEnv,
    task_ids: Sequence[int],
    *,
    env_kwargs: dict[str, Any] | None = None,
    expert_prob: float = 1.0,
    episodes_per_task: int = 1,
    max_turns: int = 15,
    history_length: int = 2,
    seed: int = 0,
    thought: str = "",
) -> list[dict[str, Any]]:
    """Roll out the (perturbed) expert and return one SFT row per step.

    Args:
        env: registry name, or an env instance to reuse.
        task_ids: tasks to play.
        expert_prob: probability of taking the expert's action at each step; otherwise
            a uniformly random admissible action (the expert's when the env lists none).
        episodes_per_task: rollouts per task (they differ when expert_prob < 1).
        max_turns, history_length: as in the rollout.
        thought: text placed inside <think></think> of every reply.
    Returns:
        rows {"prompt": [user message], "completion": [assistant message], "task_id", "won"}.
    """
    if not 0.0 <= expert_prob <= 1.0:
        raise ValueError(f"expert_prob={expert_prob} must lie in [0, 1].")
    rng = random.Random(seed)
    instance = make_env(env, **(env_kwargs or {})) if isinstance(env, str) else env
    rows: list[dict[str, Any]] = []
    try:
        for task_id in task_ids:
            for _ in range(episodes_per_task):
                rows.extend(_episode(instance, task_id, rng, expert_prob, max_turns, history_length, thought))
    finally:
        if isinstance(env, str):
            instance.close()
    return rows


def _episode(env: TextEnv, task_id, rng, expert_prob, max_turns, history_length, thought):
    result = env.reset(task_id)
    history: list[tuple[str, str]] = []
    steps = []
    won = False
    for turn in range(max_turns):
        if result.done:
            break
        expert = env.expert_action()
        choices = result.admissible_actions or ([expert] if expert else [])
        if not choices:
            break
        action = expert if expert is not None and rng.random() < expert_prob else rng.choice(choices)
        prompt = build_messages(
            env.instruction,
            env.task,
            history,
            result.observation,
            result.admissible_actions,
            step_index=turn,
            history_length=history_length,
        )
        steps.append({"prompt": prompt, "completion": [{"role": "assistant", "content": format_reply(action, thought)}]})
        history.append((result.observation, action))
        result = env.step(action)
        won = won or result.won
    return [dict(row, task_id=task_id, won=won) for row in steps]
