"""The step prompt (GiGPO format) and the path from a reply to an env command."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.rollout.actions import parse_reply
from bipace_trainer.rollout.prompting import (
    DEFAULT_MAX_ADMISSIBLE_ACTIONS,
    action_for_env,
    build_messages,
    build_prompt,
)
from envs import TinyEnv

HISTORY = [("obs one", "go east"), ("obs two", "go west"), ("obs three", "open door")]


def test_prompt_holds_every_part_in_order():
    prompt = build_prompt("You are a robot.", "reach cell 3.", HISTORY, "You are at cell 2.", ["left", "right"])
    parts = [
        "You are a robot.",
        "Your task is to: reach cell 3.",
        "you have already taken 3 step(s)",
        "[Observation 2: 'obs two', Action 2: 'go west']",
        "[Observation 3: 'obs three', Action 3: 'open door']",
        "You are now at step 4 and your current observation is: You are at cell 2.",
        "Your admissible actions of the current situation are: ['left', 'right'].",
        "<think> </think>",
        "<action> </action>",
    ]
    positions = [prompt.index(part) for part in parts]
    assert positions == sorted(positions)
    assert "obs one" not in prompt  # outside the window of 2


@pytest.mark.parametrize("history_length, shown", [(0, 0), (1, 1), (2, 2), (5, 3)])
def test_history_window(history_length, shown):
    prompt = build_prompt("I.", "T.", HISTORY, "now", None, history_length=history_length)
    assert prompt.count("[Observation ") == shown
    assert "you have already taken 3 step(s)" in prompt  # the step count is shown even without history


def test_first_step_has_no_history_section():
    prompt = build_prompt("I.", "T.", [], "start", None)
    assert "Prior to this step" not in prompt and "You are now at step 1 " in prompt


def test_step_index_overrides_history_length():
    prompt = build_prompt("I.", "T.", HISTORY[-2:], "now", None, step_index=7, history_length=2)
    assert "taken 7 step(s)" in prompt and "[Observation 6: 'obs two'" in prompt and "at step 8 " in prompt


def test_unknown_admissible_actions_are_not_listed():
    prompt = build_prompt("I.", "T.", [], "now", None)
    assert "admissible actions of the current situation" not in prompt
    assert "choose one action" in prompt
    assert "choose an admissible action" in build_prompt("I.", "T.", [], "now", ["look"])


def test_admissible_list_is_capped():
    actions = [f"take item {i}" for i in range(500)]
    prompt = build_prompt("I.", "T.", [], "now", actions)
    assert prompt.count("'take item ") == DEFAULT_MAX_ADMISSIBLE_ACTIONS
    assert f"... and {500 - DEFAULT_MAX_ADMISSIBLE_ACTIONS} more]" in prompt
    small = build_prompt("I.", "T.", [], "now", actions, max_admissible_actions=3)
    assert "['take item 0', 'take item 1', 'take item 2', ... and 497 more]" in small


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="history_length=-1"):
        build_prompt("I.", "T.", [], "now", None, history_length=-1)
    with pytest.raises(ValueError, match="max_admissible_actions=0"):
        build_prompt("I.", "T.", [], "now", ["a"], max_admissible_actions=0)


def test_build_messages_wraps_the_same_prompt():
    messages = build_messages("I.", "T.", HISTORY, "now", ["a"], history_length=1)
    assert messages == [{"role": "user", "content": build_prompt("I.", "T.", HISTORY, "now", ["a"], history_length=1)}]


def test_action_for_env_sends_invalid_action_on_bad_reply():
    assert action_for_env(parse_reply("<think>x</think><action>right</action>"), "stay") == "right"
    assert action_for_env(parse_reply("I go right"), "stay") == "stay"
    assert action_for_env(parse_reply("<action>right"), "stay") == "stay"


def test_prompt_to_env_round_trip_on_tiny():
    env = TinyEnv(size=4)
    result = env.reset(2)  # start 0, goal 3
    history: list[tuple[str, str]] = []
    while not result.done:
        prompt = build_prompt(env.instruction, env.task, history, result.observation, result.admissible_actions)
        assert result.observation in prompt
        reply = f"<think>goal is right</think><action>{env.expert_action()}</action>"
        action = action_for_env(parse_reply(reply), env.invalid_action)
        history.append((result.observation, action))
        result = env.step(action)
    assert result.won and len(history) == 3


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.text(max_size=30), st.text(max_size=30)), max_size=8),
    st.integers(0, 10),
    st.lists(st.text(max_size=20), max_size=80) | st.none(),
)
def test_prompt_size_is_bounded_by_its_inputs(history, history_length, admissible):
    prompt = build_prompt("I.", "T.", history, "now", admissible, history_length=history_length)
    assert prompt.count("[Observation ") == min(len(history), history_length)
    shown = min(len(admissible), DEFAULT_MAX_ADMISSIBLE_ACTIONS) if admissible is not None else 0
    assert len(prompt) < 1000 + 70 * min(len(history), history_length) + 24 * shown
