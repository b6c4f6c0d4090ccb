"""The agent's prompt: one user message per step, in the GiGPO format.

A step's prompt holds, in order (GiGPO's ALFWorld template, verl-agent
`agent_system/environments/prompts/alfworld.py`, generalised to any env):

    {env instruction}
    Your task is to: {task}
    Prior to this step, you have already taken {n} step(s). Below are the most recent
    {k} observations and the corresponding actions you took:
    [Observation 3: '...', Action 3: '...']
    [Observation 4: '...', Action 4: '...']
    You are now at step {n + 1} and your current observation is: {observation}
    Your admissible actions of the current situation are: ['go to fridge 1', ...].

    Now it's your turn to take an action. ...reason inside <think> </think>...
    ...then the action inside <action> </action>.

The history window is the last `history_length` (observation, action) pairs (window 2
in the papers, docs/concepts/math.md#paper-setups; 0 = no history). Admissible actions
appear only when the env knows them, at most `max_admissible_actions` of them with a
count of the rest, so a prompt stays bounded whatever the engine returns. Replies are parsed by
`bipace_trainer.rollout.actions.parse_reply`; `action_for_env` turns a parse into the
command the env receives.

Env text is untrusted: `safe_text` makes every piece of it safe to tokenize (a lone
surrogate becomes "?", and markup that a chat template treats as a control token,
such as `<|im_end|>`, `</s>` or `[INST]`, gets a space after its opening bracket, so
it is read as text) and bounds it: the task at MAX_TASK_CHARS, each admissible action
at MAX_ACTION_CHARS (observations are cut by `VectorEnv`). The trainer then bounds the
tokenized prompt by the model's context with `fit_prompt_ids`.
"""

from __future__ import annotations

import re
from typing import Sequence

from .actions import ParsedReply

__all__ = [
    "build_prompt",
    "build_messages",
    "action_for_env",
    "safe_text",
    "fit_prompt_ids",
    "DEFAULT_MAX_ADMISSIBLE_ACTIONS",
    "MAX_TASK_CHARS",
    "MAX_ACTION_CHARS",
]

DEFAULT_MAX_ADMISSIBLE_ACTIONS = 50
MAX_TASK_CHARS = 4000  # TextCraft's task, with its crafting commands, is ~2,000
MAX_ACTION_CHARS = 200  # ALFWorld and ScienceWorld actions stay under ~100

# Control-token markup of the common chat templates: ChatML/Qwen/Llama-3/Phi `<|...|>`,
# Llama-2/Mistral `<s>`, `</s>`, `[INST]`, `<<SYS>>`, Gemma `<start_of_turn>`, `<bos>`...
_CONTROL_MARKUP = re.compile(
    r"<\|[^<>|\s]{1,64}\|>|</?s>|\[/?INST\]|<</?SYS>>|</?(?:bos|eos|pad|unk|mask|start_of_turn|end_of_turn)>"
)

_REPLY_FORMAT = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. "
    "This reasoning process MUST be enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose {which} action for the current step "
    "and present it within <action> </action> tags."
)


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} more characters cut]"


def safe_text(text: str, limit: int | None = None) -> str:
    """`text` as plain text any tokenizer takes: lone surrogates become "?", control-token
    markup is broken with a space (`<|im_end|>` -> `< |im_end|>`), and with `limit` it is
    cut to that many characters, with a note."""
    text = str(text).encode("utf-8", "replace").decode("utf-8")
    text = _CONTROL_MARKUP.sub(lambda match: match.group(0)[0] + " " + match.group(0)[1:], text)
    return text if limit is None else _cap(text, limit)


def fit_prompt_ids(prompt_ids: Sequence[int], limit: int, cut_marker_ids: Sequence[int] = ()) -> list[int]:
    """At most `limit` token ids: a longer prompt keeps its first quarter (instruction and
    task) and its end (current observation, actions, reply format and the chat template's
    assistant header), joined by `cut_marker_ids`."""
    ids = list(prompt_ids)
    if len(ids) <= limit:
        return ids
    marker = list(cut_marker_ids)[: max(limit // 8, 0)]
    head = (limit - len(marker)) // 4
    tail = limit - len(marker) - head
    return ids[:head] + marker + (ids[-tail:] if tail else [])


def _format_admissible(actions: Sequence[str], limit: int) -> str:
    shown = ", ".join(f"'{safe_text(action, MAX_ACTION_CHARS)}'" for action in actions[:limit])
    hidden = len(actions) - limit
    return f"[{shown}, ... and {hidden} more]" if hidden > 0 else f"[{shown}]"


def build_prompt(
    instruction: str,
    task: str,
    history: Sequence[tuple[str, str]],
    observation: str,
    admissible_actions: Sequence[str] | None = None,
    step_index: int | None = None,
    history_length: int = 2,
    max_admissible_actions: int = DEFAULT_MAX_ADMISSIBLE_ACTIONS,
) -> str:
    """The user message for one step.

    Args:
        instruction: the env's one-line description (`TextEnv.instruction`).
        task: the goal of this episode (`TextEnv.task`).
        history: the episode's earlier (observation, action) pairs, oldest first; the
            action is what the env received.
        observation: the current observation.
        admissible_actions: the env's admissible actions now, or None when unknown.
        step_index: steps taken so far (default: len(history)).
        history_length: how many of the latest pairs to show; 0 shows none.
        max_admissible_actions: at most this many admissible actions are listed.
    """
    if history_length < 0:
        raise ValueError(f"history_length={history_length}: use 0 (no history) or a positive window.")
    if max_admissible_actions < 1:
        raise ValueError(f"max_admissible_actions={max_admissible_actions}: list at least one action.")
    steps_taken = len(history) if step_index is None else step_index
    window = [(safe_text(obs), safe_text(action)) for obs, action in history[-history_length:]] if history_length else []
    task, observation = safe_text(task, MAX_TASK_CHARS), safe_text(observation)

    lines = [instruction, f"Your task is to: {task}"]
    if window:
        first_step = steps_taken - len(window) + 1
        pairs = "".join(
            f"\n[Observation {first_step + j}: '{obs}', Action {first_step + j}: '{action}']"
            for j, (obs, action) in enumerate(window)
        )
        lines.append(
            f"Prior to this step, you have already taken {steps_taken} step(s). Below are the most recent "
            f"{len(window)} observation(s) and the corresponding actions you took:{pairs}"
        )
    elif steps_taken:
        lines.append(f"Prior to this step, you have already taken {steps_taken} step(s).")
    lines.append(f"You are now at step {steps_taken + 1} and your current observation is: {observation}")
    if admissible_actions is not None:
        listed = _format_admissible(list(admissible_actions), max_admissible_actions)
        lines.append(f"Your admissible actions of the current situation are: {listed}.")
    which = "an admissible" if admissible_actions is not None else "one"
    return "\n".join(lines) + "\n\n" + _REPLY_FORMAT.format(which=which)


def build_messages(
    instruction: str,
    task: str,
    history: Sequence[tuple[str, str]],
    observation: str,
    admissible_actions: Sequence[str] | None = None,
    step_index: int | None = None,
    history_length: int = 2,
    max_admissible_actions: int = DEFAULT_MAX_ADMISSIBLE_ACTIONS,
) -> list[dict[str, str]]:
    """`build_prompt` as a conversation, `[{"role": "user", "content": prompt}]`, for chat templates."""
    prompt = build_prompt(
        instruction, task, history, observation, admissible_actions, step_index, history_length, max_admissible_actions
    )
    return [{"role": "user", "content": prompt}]


def action_for_env(parsed: ParsedReply, invalid_action: str) -> str:
    """The command to send: the parsed action when the reply was valid, else the env's harmless `invalid_action`."""
    return parsed.action if parsed.valid else invalid_action
