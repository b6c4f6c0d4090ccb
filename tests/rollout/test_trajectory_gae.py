"""GAGPO's GAE terms in the rollout dumps and the viewer: each step's V̄, next V̄, δ, their
discounted sum, the centred penalty and the group's μ and σ, enough to redo its advantage."""

from __future__ import annotations

import io
import json

import pytest

from bipace_trainer.reports import show
from bipace_trainer.rollout import trajectories
from bipace_trainer.advantages import estimate_advantages, resolve_settings

from .test_trajectories import make_rollout

# make_rollout, γ = λ = 0.95, penalty 0.1, rows in batch order (episode, turn) (0,0) (1,0) (0,1) (1,1):
# R^env (0.95, 0) share "at start" (V̄ 0.475); "at door" (R 1) and "at wall" (R 0, invalid) are alone.
VALUE = [0.475, 0.475, 1.0, 0.0]
NEXT_VALUE = [1.0, 0.0, 0.0, 0.0]
DELTA = [0.475, -0.475, 0.0, 0.0]  # r + γ V̄' - V̄
SHARED = [True, True, False, False]
GROUP_STD = 0.475 * 2**0.5  # unbiased σ of {+0.475, -0.475}


def gagpo_rows():
    rollout = make_rollout()
    estimate = estimate_advantages(rollout.step_batch(), resolve_settings("gagpo"))
    return rollout, trajectories.step_rows(rollout, estimate)


def test_rows_carry_each_steps_gae_terms():
    _, rows = gagpo_rows()
    terms = [row["gae"] for row in rows]
    assert all(list(term) == list(trajectories.GAE_FIELDS) for term in terms)
    assert [t["value"] for t in terms] == pytest.approx(VALUE)
    assert [t["next_value"] for t in terms] == pytest.approx(NEXT_VALUE)
    assert [t["delta"] for t in terms] == pytest.approx(DELTA)
    assert [t["discounted_sum"] for t in terms] == pytest.approx(DELTA)  # the next δ are 0
    assert [t["penalty"] for t in terms] == [0.0] * 4  # the invalid step is alone: p - mean_C p = 0
    assert [t["shared"] for t in terms] == SHARED
    assert terms[0]["group_mean"] == pytest.approx(0.0) and terms[0]["group_std"] == pytest.approx(GROUP_STD)
    expected = [0.475 / (GROUP_STD + 1e-6), -0.475 / (GROUP_STD + 1e-6), 0.0, 0.0]
    assert [row["advantage"] for row in rows] == pytest.approx(expected, abs=1e-6)


def test_the_dump_redoes_the_advantage_and_show_prints_the_terms(tmp_path):
    rollout, rows = gagpo_rows()
    path = trajectories.write_jsonl(tmp_path / "d.jsonl", trajectories.episode_records(rollout, rows, step=1))
    for episode in map(json.loads, path.read_text().splitlines()):
        for turn in episode["turns"]:
            gae, following = turn["gae"], [t["gae"]["delta"] for t in episode["turns"][turn["turn"]:]]
            assert gae["delta"] == pytest.approx(turn["reward"] + 0.95 * gae["next_value"] - gae["value"])
            assert gae["discounted_sum"] == pytest.approx(sum((0.95 * 0.95) ** k * d for k, d in enumerate(following)))
            redone = (gae["discounted_sum"] - gae["penalty"] - gae["group_mean"]) / (gae["group_std"] + 1e-6)
            assert turn["advantage"] == pytest.approx(redone if gae["shared"] else 0.0, abs=1e-6)
    out = io.StringIO()
    assert show.main([str(path), "--color", "never"], stream=out) == 0
    text = out.getvalue()
    assert "gae  V̄ 0.475  next 1.000  δ +0.475  Σ +0.475  penalty +0.000  group mean +0.000 std 0.672" in text
    assert "gae  V̄ 1.000  next 0.000  δ +0.000  Σ +0.000  penalty +0.000  (alone in its cell: A^s 0)\n" in text


def test_show_prints_wrong_typed_gae_terms_as_dashes():
    turn = {"turn": 0, "observation": "o", "reply": "r", "action": "a", "valid": True, "reward": 0.0, "return": 0.0,
            "advantage": 0.5, "gae": {"value": "high", "delta": None, "discounted_sum": [1], "shared": "yes",
                                      "group_std": True, "next_value": 0.25}}  # fmt: skip
    episode = {"episode": 0, "task_id": 1, "task": "t", "won": False, "turns": [turn, dict(turn, turn=1, gae="junk")]}
    text = show.render_episode(episode)
    assert "gae  V̄ –  next 0.250  δ –  Σ –  penalty –  group mean – std –" in text
    assert text.count("gae  ") == 1 and "alone" not in text  # a `gae` that is no object is left out


def test_other_estimators_and_evaluations_have_no_gae_terms():
    rollout = make_rollout()
    for preset in ("gigpo", "bipace_q", "hgpo"):
        estimate = estimate_advantages(rollout.step_batch(), resolve_settings(preset, step_partition="hash"))
        assert {row["gae"] is None for row in trajectories.step_rows(rollout, estimate)} == {True}
    assert {row["gae"] is None for row in trajectories.step_rows(rollout, None)} == {True}
