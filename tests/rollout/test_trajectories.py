"""Trajectory rows, rollout dumps and their terminal rendering, on a hand-made rollout."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import defaultdict, deque

import pytest

from bipace_trainer.reports import show
from bipace_trainer.rollout import trajectories
from bipace_trainer.advantages import estimate_advantages, resolve_settings
from bipace_trainer.rollout.loop import Episode, Rollout, StepRecord


def _step(traj, t, obs, action, reward, valid=True):
    return StepRecord(
        group=0, traj=traj, t=t, prompt_ids=[1, 2, 3], completion_ids=[4], reply=f"<action>{action}</action>",
        action=action, valid=valid, action_key=action, anchor=obs, reward=reward, observation=obs,
    )


def make_rollout() -> Rollout:
    """Two rollouts of task 7: the first wins in two turns, the second stumbles (one invalid reply)."""
    steps = [
        _step(0, 0, "at start", "go left", 0.0),
        _step(1, 0, "at start", "go right", 0.0),
        _step(0, 1, "at door", "open door", 1.0),
        _step(1, 1, "at wall", "jump", 0.0, valid=False),
    ]
    episodes = [
        Episode(0, 0, 7, {"type": "door"}, length=2, reward=1.0, won=True, task="open the door",
                final_observation="The door opens.", final_anchor="door open"),
        Episode(1, 0, 7, {"type": "door"}, length=2, invalid_steps=1, truncated=True, task="open the door",
                final_observation="You stand at the start.", final_anchor="at start"),
    ]
    return Rollout(steps=steps, episodes=episodes, seconds={})


def test_rows_carry_what_produced_each_advantage():
    rollout = make_rollout()
    estimate = estimate_advantages(rollout.step_batch(), resolve_settings("bipace_q", step_partition="hash"))
    rows = trajectories.step_rows(rollout, estimate, decode=lambda ids: "tokens " + " ".join(map(str, ids)))
    assert [(r["episode"], r["turn"]) for r in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # batch order
    first = rows[0]
    assert first["task"] == "open the door" and first["task_id"] == 7 and first["prompt_tail"] == "tokens 1 2 3"
    assert first["observation"] == "at start" and first["action"] == "go left" and first["valid"]
    assert [r["return"] for r in rows] == pytest.approx([0.95, 0.0, 1.0, -0.1])  # γ 0.95, penalty 0.1
    assert [r["advantage"] for r in rows] == pytest.approx(estimate.advantage.tolist())
    # both first steps share the "at start" cell with two different actions: the PACE branch
    assert rows[0]["cluster"] == rows[1]["cluster"] and rows[0]["branch"] == rows[1]["branch"] == "pace"
    assert rows[2]["branch"] == rows[3]["branch"] == "singleton" and rows[2]["cluster"] != rows[3]["cluster"]


def test_evaluation_rows_have_returns_but_no_advantage():
    rows = trajectories.step_rows(make_rollout(), None, gamma=0.5, invalid_penalty=0.2)
    assert [r["return"] for r in rows] == pytest.approx([0.5, 0.0, 1.0, -0.2])
    assert {r["advantage"] for r in rows} == {None} and {r["branch"] for r in rows} == {None}


def test_episode_records_hold_turns_in_order(tmp_path):
    rollout = make_rollout()
    rows = trajectories.step_rows(rollout, estimate_advantages(rollout.step_batch(), resolve_settings("gigpo")))
    records = trajectories.episode_records(rollout, rows, step=10, split="train")
    path = trajectories.write_jsonl(trajectories.dump_path(tmp_path, 10), records)
    assert path == tmp_path / "rollouts" / "step-000010.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["episode"] for line in lines] == [0, 1]
    won, lost = lines
    assert (won["step"], won["split"], won["won"], won["turns_taken"]) == (10, "train", True, 2)
    assert won["attributes"] == {"type": "door"}
    assert [t["turn"] for t in won["turns"]] == [0, 1] and won["turns"][1]["observation"] == "at door"
    assert lost["invalid_steps"] == 1 and lost["turns"][1]["valid"] is False
    assert set(trajectories.TURN_FIELDS) == set(won["turns"][0])
    # what the env returned after each episode's last action
    assert (won["final_observation"], lost["final_observation"]) == ("The door opens.", "You stand at the start.")


def test_the_estimators_input_leads_each_last_step_to_its_episodes_end():
    rollout = make_rollout()  # batch order: (0, 0), (1, 0), (0, 1), (1, 1)
    assert rollout.next_anchors() == ["at door", "at wall", "door open", "at start"]
    rollout.episodes[1].final_anchor = None  # an env fault: no state reached, a dead end of its own
    batch = rollout.step_batch()
    assert batch.next_anchor[3] == -1 and batch.anchor_text[int(batch.next_anchor[0])] == "at door"


def test_write_jsonl_is_atomic(tmp_path):
    path = tmp_path / "rollouts" / "step-000001.jsonl"
    trajectories.write_jsonl(path, [{"a": 1}])

    def broken():
        yield {"a": 2}
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        trajectories.write_jsonl(path, broken())
    assert path.read_text() == '{"a": 1}\n'  # the old file survives whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-000001.jsonl"]  # no partial left behind


@pytest.mark.parametrize(
    "first,count,every,expected",
    [(10, 1, 10, 10), (9, 1, 10, None), (9, 2, 10, 10), (1, 1, 1, 1), (5, 1, 0, None), (21, 4, 5, None), (21, 5, 5, 25)],
)
def test_dump_step(first, count, every, expected):
    assert trajectories.dump_step(first, count, every) == expected


def test_eval_dump_path(tmp_path):
    assert trajectories.dump_path(tmp_path, 3, "eval", "final").name == "eval-final-step-000003.jsonl"


def test_completion_logs_replace_the_previous_batch():
    rollout = make_rollout()
    rows = trajectories.step_rows(rollout, estimate_advantages(rollout.step_batch(), resolve_settings("grpo")))
    logs = {"prompt": deque(["old"], maxlen=1), "rewards": defaultdict(deque), "extra": defaultdict(deque)}
    trajectories.fill_completion_logs(logs, rows)
    assert list(logs["completion"]) == [r["reply"] for r in rows] and list(logs["rewards"]["reward"]) == [0, 0, 1, 0]
    assert list(logs["advantages"]) == [r["advantage"] for r in rows]
    assert dict(logs["extra"]) == {}  # TRL's four columns only: the rest of a step is in the rollout dumps
    assert len(logs["prompt"]) == 4


def _dump(tmp_path):
    rollout = make_rollout()
    estimate = estimate_advantages(rollout.step_batch(), resolve_settings("bipace_q", step_partition="hash"))
    rows = trajectories.step_rows(rollout, estimate)
    return trajectories.write_jsonl(tmp_path / "d.jsonl", trajectories.episode_records(rollout, rows, step=1, split="train"))


def test_show_renders_every_turn_and_colours_advantages_by_sign(tmp_path):
    path = _dump(tmp_path)
    out = io.StringIO()
    assert show.main([str(path), "--color", "always"], stream=out) == 0
    text = out.getvalue()
    for expected in ("at start", "open door", "(invalid reply)", "branch pace", "return 0.950", "2 episodes, 1 won (50%)"):
        assert expected in text
    episodes = show.load_episodes(path)
    advantages = [t["advantage"] for e in episodes for t in e["turns"]]
    assert any(a > 0 for a in advantages) and any(a < 0 for a in advantages)
    assert f"{show.GREEN}+" in text and f"{show.RED}-" in text


def test_show_one_episode_and_summary_lines(tmp_path):
    path = _dump(tmp_path)
    out = io.StringIO()
    show.main([str(path), "--episode", "1", "--color", "never"], stream=out)
    text = out.getvalue()
    assert text.splitlines()[0] == "episode 1 | task 7 open the door | truncated | 2 turns | 1 invalid | reward 0.00"
    assert "at wall" in text and "at door" not in text and "\033[" not in text
    assert "end You stand at the start." in " ".join(text.split())  # where the last action led
    out = io.StringIO()
    show.main([str(path), "--summary"], stream=out)
    assert out.getvalue().splitlines()[:2] == [
        "episode 0 | task 7 open the door | won | 2 turns | 0 invalid | reward 1.00",
        "episode 1 | task 7 open the door | truncated | 2 turns | 1 invalid | reward 0.00",
    ]


def test_show_command_line(tmp_path):
    path = _dump(tmp_path)
    command = [sys.executable, "-m", "bipace_trainer.reports.show", str(path), "--episode"]
    done = subprocess.run([*command, "0"], capture_output=True, text=True)
    assert done.returncode == 0 and "episode 0 | task 7 open the door | won" in done.stdout
    done = subprocess.run([*command, "9"], capture_output=True, text=True)
    assert done.returncode == 2 and "no episode 9" in done.stderr


@pytest.mark.parametrize("task,attributes,shown", [
    # TextCraft: the crafting commands first, the goal last
    ("Crafting commands:\ncraft 4 oak planks using 1 oak log\ncraft 4 stick using 2 oak planks\n"
     "craft 1 crafting table using 4 oak planks\n\nGoal: craft stick.", {"goal": "stick"}, "Goal: craft stick."),
    ("Look around.\nYour task is to: put a clean egg in microwave.", {}, "Your task is to: put a clean egg in microwave."),
    ("Welcome.\nYou are in a kitchen with many things in it.", {"goal": "boil water"}, "goal: boil water"),
    ("reach cell 3.", {"goal": 3}, "reach cell 3."),  # a goal attribute that is no text is not shown
    ("first\nsecond", None, "first second"),
])
def test_show_names_the_goal_of_the_task(task, attributes, shown):
    episode = {"episode": 0, "task_id": 5, "task": task, "attributes": attributes, "won": True, "turns": []}
    assert show.task_goal(episode) == shown
    assert show.summary_line(episode).startswith(f"episode 0 | task 5 {shown} | won")
