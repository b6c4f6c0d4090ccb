"""studies/surface_why/study.py: its random control, and a CI-sized run on a tiny saved model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studies.surface_why.study import PLANS, knob_settings, random_cells, run, tables


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=40), st.integers(0, 2**16))
def test_random_cells_keep_each_groups_cell_sizes(steps, seed):
    group = np.array([g for g, _ in steps])
    cell = np.array([10 * g + c for g, c in steps])  # cells never span groups, as the partitions' labels
    shuffled = random_cells(cell, group, np.random.default_rng(seed))
    for g in np.unique(group):
        members = group == g
        assert sorted(shuffled[members]) == sorted(cell[members])  # same labels, same sizes, same group


def test_knobs_move_one_setting_at_a_time():
    class Study:
        layer, history, target = -2, 1, 0.2

    rows = knob_settings(PLANS["full"], Study)
    study = (Study.layer, Study.history, Study.target)
    for knob, layer, history, target in rows:
        moved = [name for name, a, b in zip(("layer", "history", "target"), (layer, history, target), study) if a != b]
        assert moved in ([], [knob])
    assert sum(r[1:] == study for r in rows) == 1  # the study's own setting once (in the layer sweep)


@pytest.mark.slow
def test_ci_plan_on_a_tiny_saved_model(tmp_path):
    """The oracle's numbers (A*, GRPO, the true cells) cannot depend on the text; the hash cells must."""
    from bench import common
    from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2

    tokenizer = bpe_chat_tokenizer(["craft 1 oak planks using 1 oak log", "Got 1 oak log. Inventory: [oak log] (1)"], 400)
    tokenizer.add_tokens(common.fixed_prompt_text("textcraft"))
    warm = tmp_path / "warm"
    tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=0).save_pretrained(warm)
    tokenizer.save_pretrained(warm)
    result = run(PLANS["ci"], warm, tmp_path / "out", tmp_path / "work")

    by_level = {b["variation"]: b for b in result["batches"]}
    assert set(by_level) == {0.0, 1.0}
    unvaried, varied = by_level[0.0], by_level[1.0]
    for key in ("steps", "success", "grpo", "true_step", "true_full"):
        assert unvaried[key] == varied[key], key
    assert varied["hash_singletons"] > unvaried["hash_singletons"]
    knobs = {(r["knob"], r["layer"], r["history"], r["target"]) for r in varied["rows"]}
    assert knobs == {("layer", -2, 1, 0.2), ("layer", -1, 1, 0.2), ("history", -2, 0, 0.2), ("target", -2, 1, 0.6)}
    for row in varied["rows"]:
        assert 0 <= row["grouping"]["singleton_rate"] <= 1 and 0 <= row["eps"] <= 0.3  # the trainer's cap
    text = tables(result)
    assert text.count("| 1.0 | 0.3 | ") == 1 + 2 + 2 + 2  # the headline row, then two rows per knob


def test_a_retrained_checkpoint_gets_another_cache_key(tmp_path):
    from studies.surface_why.study import checkpoint_key

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    key = checkpoint_key(tmp_path)
    assert checkpoint_key(tmp_path) == key
    (tmp_path / "model.safetensors").write_bytes(b"retrained weights")
    assert checkpoint_key(tmp_path) != key
