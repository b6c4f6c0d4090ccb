"""studies/oracle/graph_ends.py: how GraphGPO's failed episodes end, counted on a played rollout whose ends are
known, and the scripted measurement at CI size; bench/reference_fidelity.py at CI size (GraphGPO and BEACON)."""

from __future__ import annotations

import json

import pytest

from studies.oracle import graph_ends
from tests.advantages.test_graphgpo_compat import played_tiny_rollout


def test_end_counts_on_a_played_rollout():
    """The tiny env's rollout (tests/advantages): three groups of four, the third's env raising at its first step."""
    rollout = played_tiny_rollout()
    counts = graph_ends.end_counts(rollout)
    episodes = rollout.episodes
    lost = [e for e in episodes if not e.won and not e.failed]
    assert counts["episodes"] == 12 and counts["env_failed"] == 4 and counts["won"] == sum(e.won for e in episodes)
    assert counts["failed_ends"] == len(lost)  # env-failed episodes leave the batch, as in training
    anchors = {(s.group, s.anchor) for s in rollout.steps if s.traj not in {e.traj for e in episodes if e.failed}}
    assert counts["failed_ends_known"] == sum((e.group, e.final_anchor) in anchors for e in lost) > 0
    assert counts["steps"] == sum(not e.failed for e in episodes for _ in range(e.length))
    # a known end in a group with a success moves advantages; without one (every d = 1) nothing would
    assert counts["steps_changed"] > 0 and counts["max_change"] > graph_ends.CHANGED


def test_scripted_play_is_counted_per_batch(monkeypatch, tmp_path):
    size = dict(graph_ends.SCRIPTED["textcraft"], seeds=(4,), expert_probs=(0.2,))
    monkeypatch.setitem(graph_ends.SCRIPTED, "textcraft", size)
    (batch,) = graph_ends.scripted_batches("textcraft")
    assert batch["episodes"] == 8 * size["tasks"] and 0 <= batch["failed_ends_known"] <= batch["failed_ends"]
    path = tmp_path / "ends.json"
    path.write_text(json.dumps({"source": "scripted", "env": "textcraft", "totals": graph_ends.totals([batch])}))
    assert "| scripted textcraft |" in graph_ends.report([path])


def test_reference_fidelity_at_ci_size():
    from bench import reference_fidelity

    found = reference_fidelity.measure("graphgpo", 8)
    assert all(f["algorithm"] < 1e-5 and f["code_unequal"] < 2e-4 for f in found.values())
    noise = reference_fidelity.equal_return_noise("graphgpo", 0.95, sizes=[15], lengths=[4])
    assert noise["noise"] == pytest.approx(0.641, abs=0.01)  # the float32 code's mean of 15 equal returns


def test_reference_fidelity_beacon_at_ci_size():
    """BEACON's row: bounds per unit of its run scripts' segment weights (10 at γ 0.9, 1 at γ 0.95)."""
    from bench import reference_fidelity

    found = reference_fidelity.measure("beacon", 8)
    for gamma, f in found.items():
        weight = reference_fidelity.BEACON_WEIGHTS[float(gamma)]
        assert f["algorithm"] < 1e-5 * weight and f["code_unequal"] < 2e-4 * weight, (gamma, f)
    noise = reference_fidelity.equal_return_noise("beacon", 0.9, sizes=[10], lengths=[3])
    assert 0 < noise["noise"] < 1e-3  # segments pool 10·γ^d at every distance: no mean over equal values
