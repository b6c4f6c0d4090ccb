"""What `run_rollouts` reports of itself: its wall time by phase, the hidden-state pass apart."""

from __future__ import annotations

import time

import pytest

from bipace_trainer.rollout.loop import Generation, RolloutSettings, TaskRef, run_rollouts
from envs.vector import VectorEnv


def test_the_rollout_times_itself_and_reports_the_hidden_state_pass_apart():
    def generate(messages):
        time.sleep(0.02)  # half of it, says the generator, spent on a pass only for hidden states
        n = len(messages)
        return Generation([[1]] * n, [[2]] * n, ["<action>right</action>"] * n, hidden_seconds=0.01)

    with VectorEnv("tiny", 2) as envs:
        rollout = run_rollouts(envs, [TaskRef(0, 0), TaskRef(1, 0)], generate, RolloutSettings(max_turns=3))
    seconds, calls = rollout.seconds, rollout.generate_calls
    assert calls > 0
    assert seconds["hidden"] == pytest.approx(0.01 * calls)
    assert seconds["generate"] >= 0.01 * calls  # the call's own time, without the hidden-state pass
    assert seconds["rollout"] >= seconds["generate"] + seconds["env"] + seconds["hidden"]
    assert rollout.metrics()["time/rollout_s"] == seconds["rollout"]
