"""ScienceWorld on the `scienceworld` package. Tests that start the JVM are marked slow."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("scienceworld", reason="pip install scienceworld==1.2.3")

from envs import EnvUnavailableError, make_env  # noqa: E402
from envs import scienceworld as sw_module  # noqa: E402
from envs.scienceworld import ScienceWorldEnv, decode_task_id, encode_task_id  # noqa: E402

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs Java 17+ on PATH")


def _task_id(task_name: str, variation: int) -> int:
    names = [name for name, _ in sw_module._task_table()]
    return encode_task_id(names.index(task_name), variation)


@given(st.integers(0, 29), st.integers(0, sw_module.TASK_ID_STRIDE - 1))
def test_task_id_round_trips(task_index, variation):
    assert decode_task_id(encode_task_id(task_index, variation)) == (task_index, variation)


def test_task_table_is_the_papers_thirty_tasks():
    table = sw_module._task_table()
    assert len(table) == 30
    assert table[0][0] == "boil" and table[-1][0] == "mendelian-genetics-unknown-plant"


def test_missing_java_raises_with_the_install_command(monkeypatch):
    monkeypatch.setattr(sw_module.shutil, "which", lambda name: None)
    with pytest.raises(EnvUnavailableError, match="java.*openjdk-17"):
        ScienceWorldEnv()


def test_bad_reward_mode_fails_before_starting_java():
    with pytest.raises(ValueError, match="reward='dense'"):
        ScienceWorldEnv(reward="dense")


@pytest.fixture(scope="module")
def env():
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs Java 17+ on PATH")
    env = ScienceWorldEnv(gold_path=True)
    yield env
    env.close()


@pytest.mark.slow
def test_reset_and_step(env):
    first = env.reset(_task_id("boil", 0))
    assert first.observation.startswith("This room is called the hallway.")
    assert env.task.startswith("Your task is to boil water.") and "focus on OBJ" in env.task
    assert "In your inventory, you see:" in first.anchor and first.admissible_actions is None
    step = env.step("open door to kitchen")
    assert step.observation == "The door is now open." and not step.done and step.reward == 0.0
    assert "A door to the kitchen (that is open)" in step.anchor and step.anchor != first.anchor
    assert env.step("look around").anchor == step.anchor  # looking changes nothing
    garbage = env.step("<action>fly to the moon</action>")
    assert not garbage.done and garbage.info["score"] == 0.0


# One task each from the train, test and valid variations.
@pytest.mark.slow
@pytest.mark.parametrize(
    "task_name, variation", [("find-living-thing", 3), ("lifespan-longest-lived", 100), ("power-component", 12)]
)
def test_gold_path_expert_wins(env, task_name, variation):
    result = env.reset(_task_id(task_name, variation))
    rewards = []
    while env.expert_action() is not None:
        result = env.step(env.expert_action())
        rewards.append(result.reward)
    assert result.won and result.done and result.info["score"] == 1.0
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0


@pytest.mark.slow
def test_failing_the_task_ends_the_episode_and_expert_stops_after_deviation(env):
    env.reset(_task_id("boil", 1))
    assert env.expert_action() is not None
    env.step("look around")  # not the gold path's first action
    assert env.expert_action() is None
    failed = env.step("focus on agent")  # focusing on the wrong object fails the task
    assert failed.done and not failed.won and failed.info["score"] < 0 and failed.reward == 0.0


@pytest.mark.slow
def test_score_reward_mode_sums_to_final_progress(env):
    env.reward_mode = "score"
    try:
        env.reset(_task_id("find-living-thing", 3))
        total = 0.0
        while env.expert_action() is not None:
            result = env.step(env.expert_action())
            total += result.reward
        assert result.won and total == pytest.approx(1.0)
    finally:
        env.reward_mode = "success"


@pytest.mark.slow
def test_out_of_range_task_ids_name_the_rule(env):
    with pytest.raises(ValueError, match="task index 30"):
        env.reset(encode_task_id(30, 0))
    with pytest.raises(ValueError, match="'boil' has variations 0..29"):
        env.reset(_task_id("boil", 30))


@needs_java
@pytest.mark.slow
def test_splits_come_from_the_engine_and_are_cached(tmp_path, monkeypatch):
    sw_module._variation_splits.cache_clear()
    splits = {split: ScienceWorldEnv.tasks(split, cache_dir=str(tmp_path)) for split in ScienceWorldEnv.splits()}
    ids = [spec.task_id for specs in splits.values() for spec in specs]
    assert len(ids) == len(set(ids)) == 7207  # every (task, variation) pair once
    boil = {
        split: [s.attributes["variation"] for s in specs if s.attributes["task_name"] == "boil"]
        for split, specs in splits.items()
    }
    assert boil == {"train": list(range(14)), "valid": list(range(14, 21)), "test": list(range(21, 30))}
    assert len(list(tmp_path.glob("scienceworld-*-variations.json"))) == 1
    sw_module._variation_splits.cache_clear()

    def no_jvm(*args, **kwargs):
        raise AssertionError("a JVM was started although the splits are cached")

    monkeypatch.setattr(sw_module, "_start_engine", no_jvm)
    assert ScienceWorldEnv.tasks("valid", cache_dir=str(tmp_path)) == splits["valid"]  # read from the cache


@needs_java
@pytest.mark.slow
def test_close_stops_the_jvm():
    env = make_env("scienceworld")
    java = env._engine._gateway.java_process
    env.close()
    java.wait(timeout=10)
    assert java.poll() is not None


@pytest.mark.slow
def test_a_step_whose_score_rose_reached_a_milestone(env):
    """BEACON's `subgoal_completed`: the steps of the gold path that raised the score are flagged, no other."""
    first = env.reset(_task_id("find-living-thing", 3))
    assert env.milestone_kind == "flag" and not first.info.get("milestone", False)
    previous, flagged, rose = 0.0, [], []
    while env.expert_action() is not None:
        result = env.step(env.expert_action())
        flagged.append(result.info["milestone"])
        rose.append(result.info["score"] > previous)
        previous = result.info["score"]
    assert flagged == rose and sum(flagged) >= 2 and flagged[-1]
