"""HGPO's context levels in the rollout dumps and the viewer: each step's levels, their
cells and advantages, and which of them the weighted mean used."""

from __future__ import annotations

import io

import pytest

from bipace_trainer.reports import show
from bipace_trainer.rollout import trajectories
from bipace_trainer.advantages import estimate_advantages, resolve_settings

from .test_trajectories import make_rollout


def test_rows_and_dumps_carry_each_steps_levels(tmp_path):
    rollout = make_rollout()  # both first steps share "at start"; the second steps differ
    estimate = estimate_advantages(rollout.step_batch(), resolve_settings("hgpo", advantage_norm="mean"))
    rows = trajectories.step_rows(rollout, estimate)
    first = rows[0]["levels"]
    assert [level["k"] for level in first] == [0]  # t = 0: level 0 only
    assert first[0]["size"] == 2 and first[0]["used"] and first[0]["advantage"] == pytest.approx(0.95 / 2)
    assert rows[0]["advantage"] == pytest.approx(0.95 / 2 * 2 / (2 + 1e-6))
    second = rows[2]["levels"]  # t = 1, "at door": alone at levels 0 and 1
    assert [level["k"] for level in second] == [0, 1] and not any(level["used"] for level in second)
    assert {level["size"] for level in second} == {1}
    path = trajectories.write_jsonl(tmp_path / "d.jsonl", trajectories.episode_records(rollout, rows, step=1))
    turns = show.load_episodes(path)[0]["turns"]
    assert turns[0]["levels"] == first
    out = io.StringIO()
    assert show.main([str(path), "--color", "never"], stream=out) == 0
    assert "levels  k0 +0.475* (n 2)" in out.getvalue() and "k1 +0.000 (n 1)" in out.getvalue()


def test_other_estimators_have_no_levels():
    rollout = make_rollout()
    estimate = estimate_advantages(rollout.step_batch(), resolve_settings("gigpo"))
    assert {row["levels"] is None for row in trajectories.step_rows(rollout, estimate)} == {True}
    assert {row["levels"] is None for row in trajectories.step_rows(rollout, None)} == {True}
