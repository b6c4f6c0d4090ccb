"""bench/surface_learning.py: intervals and paired gaps to GiGPO on hand-made runs."""

from __future__ import annotations

import math

import pytest

from bench.surface_learning import interval, summarise, table


def _run(preset, seed, train, heldout):
    curve = [{"train_success": v, "hash_singleton_rate": 1.0, "hidden_singleton_rate": 0.1} for v in train]
    evals = [{"split": "valid", "step": 5 * (i + 1), "success_rate": v} for i, v in enumerate(heldout)]
    return {"preset": preset, "seed": seed, "curve": curve, "evals": evals, "seconds": 10.0}


def test_interval_is_the_student_t_half_width():
    i = interval([0.1, 0.3, 0.5])
    # mean 0.3, sd 0.2, t(0.975, 2) = 4.302652729...
    assert i["mean"] == pytest.approx(0.3) and i["half_width"] == pytest.approx(4.302652729 * 0.2 / math.sqrt(3))
    assert math.isnan(interval([0.4])["half_width"]) and interval([])["n"] == 0


def test_paired_gap_to_gigpo_per_seed():
    runs = [
        _run("gigpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1, 0.2]),
        _run("gigpo", 1, [0.3, 0.3, 0.3, 0.3], [0.2, 0.2]),
        _run("bipace_q", 0, [0.2, 0.4, 0.7, 0.6], [0.1, 0.4]),  # second half: +0.2, +0.1
        _run("bipace_q", 1, [0.3, 0.3, 0.2, 0.3], [0.2, 0.1]),  # second half: -0.1, 0
    ]
    summary = summarise(runs, "valid")
    assert summary["bipace_q"]["minus_gigpo_per_seed"] == pytest.approx([0.15, -0.05])
    assert summary["gigpo"]["minus_gigpo_per_seed"] == pytest.approx([0.0, 0.0])
    assert summary["bipace_q"]["heldout_final"]["mean"] == pytest.approx(0.25)
    assert summary["bipace_q"]["train_last"]["mean"] == pytest.approx((0.6 + 0.3) / 2)
    text = table(summary, warm=0.1)
    assert "`bipace_q`" in text and "(+0.15, -0.05)" in text and "95% t-interval" in text
