"""studies/oracle/study.py: the oracle's values on real TextCraft and ALFWorld play, the statistics on
hand-made cases, and the whole study at CI size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studies.oracle import metrics as oracle_metrics, study as oracle_study
from studies.oracle.truth import truth_rollouts

ROOT = Path(__file__).resolve().parents[2]

GAMMA = 0.95


def _textcraft_batch(expert_prob=0.5, seed=0):
    from envs.textcraft import TextCraftEnv

    ids = [spec.task_id for spec in TextCraftEnv.tasks("train")[:2]]
    return truth_rollouts("textcraft", ids, group_size=4, expert_prob=expert_prob, max_turns=30, seed=seed, gamma=GAMMA)


def _check_oracle(batch, max_turns):
    steps, truth = batch.rollout.steps, batch.truth
    position = {(s.traj, s.t): k for k, s in enumerate(steps)}
    winning = {(e.traj, e.length - 1) for e in batch.rollout.episodes if e.won}
    wasted = 0
    for step, info in zip(steps, truth):
        assert info.distance is not None and info.distance >= 1
        if info.distance <= max_turns - step.t:
            assert info.v_star == pytest.approx(GAMMA ** (info.distance - 1))
        if info.took_expert:  # the expert follows an optimal plan: no loss
            assert info.a_star == pytest.approx(0.0, abs=1e-12), (step.action, info.distance)
        if (step.traj, step.t) in winning:
            assert info.q_star == 1.0 and info.distance == 1
        after = position.get((step.traj, step.t + 1))
        if after is not None and truth[after].distance == info.distance and info.distance <= max_turns - step.t - 1:
            # a turn that brings the goal no closer costs one discount factor
            assert info.a_star == pytest.approx(GAMMA**info.distance - GAMMA ** (info.distance - 1))
            assert info.a_star < 0
            wasted += 1
    assert wasted > 0, "the behaviour policy at p = 0.5 wastes turns"
    return wasted


def test_textcraft_oracle_expert_zero_and_wasted_turn_negative():
    batch = _textcraft_batch()
    _check_oracle(batch, 30)
    random_steps = [t for t in batch.truth if not t.took_expert]
    assert random_steps and all(t.a_star <= 1e-12 for t in batch.truth), "no action beats the recipe solver here"
    # TextCraft's anchor is goal + inventory: exact matching is the true state
    assert all(step.anchor == info.state for step, info in zip(batch.rollout.steps, batch.truth))
    # the recorded prompt is the one run_rollouts built, with the task and the step number
    first = batch.truth[0].messages[0]["content"]
    assert "Crafting commands:" in first and "You are now at step 1" in first


def test_behaviour_skill_is_controlled():
    expert = _textcraft_batch(expert_prob=1.0)
    assert all(t.took_expert for t in expert.truth) and all(e.won for e in expert.rollout.episodes)
    shortest = {s.traj: t.distance for s, t in zip(expert.rollout.steps, expert.truth) if s.t == 0}
    assert all(e.length == shortest[e.traj] for e in expert.rollout.episodes)  # optimal length
    noisy = _textcraft_batch(expert_prob=0.3)
    assert sum(e.length for e in noisy.rollout.episodes) > sum(e.length for e in expert.rollout.episodes)


@pytest.mark.slow
def test_alfworld_oracle_expert_zero_and_wasted_turn_negative():
    pytest.importorskip("alfworld")
    from envs.alfworld import AlfWorldEnv

    ids = [AlfWorldEnv.tasks("train", source="generated")[12].task_id]
    batch = truth_rollouts(
        "alfworld", ids, group_size=2, expert_prob=0.5, max_turns=50, seed=0, gamma=GAMMA, env_kwargs={"source": "generated"}
    )
    _check_oracle(batch, 50)
    assert all(t.a_star <= 1e-12 for t in batch.truth), "the planner is optimal: nothing beats it"
    assert all(";" in t.state and "atlocation(agent1," in t.state for t in batch.truth)


def test_grouping_quality_hand_case():
    # one group, states [a a a b b], cells [0 0 1 1 2]: same-cell pairs (0,1) a-a, (2,3) a-b;
    # same-state pairs (0,1) (0,2) (1,2) (3,4): (0,1) kept together, 3 split
    q = oracle_metrics.grouping_quality([0, 0, 1, 1, 2], [0, 0, 0, 1, 1], [0] * 5)
    assert q["singleton_rate"] == pytest.approx(1 / 5)
    assert q["purity"] == pytest.approx(1 / 2)
    assert q["split_rate"] == pytest.approx(3 / 4)
    # cells never match across groups, even with equal ids
    q = oracle_metrics.grouping_quality([0, 0], [0, 0], [0, 1])
    assert q["singleton_rate"] == 1.0 and math.isnan(q["purity"]) and math.isnan(q["split_rate"])


def test_distance_separation_hand_case():
    # states 0, 0, 1 in one group: the same-state pair is at distance 0, the others at 1 and ~0.29
    hidden = [[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]]
    sep = oracle_metrics.distance_separation(hidden, [0, 0, 1], [0, 0, 0])
    assert sep["auc"] == 1.0 and sep["same_median"] == pytest.approx(0.0)
    assert sep["different_median"] == pytest.approx(1 - 1 / math.sqrt(2))
    # same-state pair (0, 2) at 0.29; different pairs at 0 (closer) and 0.29 (a tie, 1/2)
    swapped = oracle_metrics.distance_separation(hidden, [0, 1, 0], [0, 0, 0])
    assert swapped["auc"] == pytest.approx(0.25)


def test_pair_sign_agreement_hand_case():
    # state 0 holds steps with A* = [0, -1, 0]; state 1 one step (no pair)
    a_star = [0.0, -1.0, 0.0, 0.0]
    good = oracle_metrics.pair_sign_agreement([1.0, -1.0, 0.5, 9.0], a_star, [0, 0, 0, 1], [0, 0, 0, 0])
    assert good == {"sign_agreement": 1.0, "tie_rate": 0.0, "pairs": 2}
    half = oracle_metrics.pair_sign_agreement([1.0, 1.0, -2.0, 0.0], a_star, [0, 0, 0, 1], [0, 0, 0, 0])
    assert half["sign_agreement"] == pytest.approx(0.25) and half["tie_rate"] == pytest.approx(0.5)  # one tie, one wrong
    assert oracle_metrics.cell_means([1.0, 3.0, 5.0], [0, 0, 1]).tolist() == [2.0, 2.0, 5.0]
    assert oracle_metrics.value_error([1.0, 2.0], [1.0, 0.0])["rmse"] == pytest.approx(math.sqrt(2))


@pytest.mark.slow
def test_oracle_study_ci_size(tmp_path):
    pytest.importorskip("alfworld")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "studies.oracle.study",
        "--size",
        "ci",
        "--out",
        str(tmp_path),
        "--work-dir",
        str(tmp_path / "work"),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "oracle_study.json").read_text())
    assert (tmp_path / "oracle_accuracy.png").stat().st_size > 0 and (tmp_path / "oracle_grouping.png").stat().st_size > 0
    assert "grouping quality against the true state" in proc.stdout
    batches = result["batches"]
    assert {b["env"] for b in batches} == {"textcraft", "alfworld"}
    for b in batches:
        oracle = b["oracle"]
        assert oracle["expert_a_star_zero"] == 1.0 and oracle["a_star_positive"] == 0
        assert oracle["states_with_two_distances"] == 0
        true, exact = b["grouping"]["true"], b["grouping"]["hash"]
        assert true["purity"] == 1.0 and true["split_rate"] == 0.0  # the truth against itself
        if b["env"] == "textcraft":  # its anchor is goal + inventory: exact matching is the truth
            assert (exact["purity"], exact["split_rate"], exact["singleton_rate"]) == (1.0, 0.0, true["singleton_rate"])
    with_hidden = [b for b in batches if b["env"] == "textcraft" and "bipace_q" in b["estimators"]]
    assert len(with_hidden) == 1
    b = with_hidden[0]
    assert set(b["estimators"]) == {
        "grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff", "gagpo", "bigagpo", "hgpo", "bihgpo", "bihpace_q",
        "graphgpo", "bigraphgpo", "beacon",
    }  # fmt: skip
    for metrics in b["estimators"].values():  # each preset's step return against Q*
        assert math.isnan(metrics["return_vs_q_star"]["spearman"]) or -1.0 <= metrics["return_vs_q_star"]["spearman"] <= 1.0
    baselines = ("mean", "pace_q", "pace_diff", "gae", "hierarchy", "hierarchy_pace_q", *oracle_study.EVIDENCE)
    milestone = {f"{cells}/milestone" for cells in oracle_study.MILESTONE_CELLS}
    assert set(b["axes"]) == {f"{p}/{q}" for p in ("hash", "hidden", "true") for q in baselines} | milestone
    # BEACON's plan reached its rows: TextCraft's crafts flagged some steps, so its return is not 0 everywhere
    assert b["estimators"]["beacon"]["zero_rate"] < 1.0
    assert "PACE-Q with evidence − plain PACE-Q, paired by seed" in proc.stdout
    for batch in batches:  # HGPO's context inconsistency at K = 2, on every batch
        context = batch["context"]
        assert 0.0 <= context["pairs_differ"] <= 1.0 and context["levels"] == 2
        # context cells split anchor cells: more singletons, more same-state pairs apart
        assert context["context"]["singleton_rate"] >= context["anchor"]["singleton_rate"]
        if not math.isnan(context["anchor"]["split_rate"]):
            assert context["context"]["split_rate"] >= context["anchor"]["split_rate"] - 1e-12
    assert "context inconsistency at K = 2" in proc.stdout
    for metrics in [*b["estimators"].values(), *b["axes"].values()]:
        assert 0.0 <= metrics["sign_agreement"] <= 1.0
        if metrics["zero_rate"] < 1.0:  # an all-zero advantage has no correlation (NaN)
            assert -1.0 <= metrics["spearman"] <= 1.0
    # every episode wins within 30 turns at p = 0.5: GRPO's advantage is 0 everywhere, ties on every pair
    if b["success_rate"] == 1.0:
        assert b["estimators"]["grpo"]["zero_rate"] == 1.0 and b["estimators"]["grpo"]["sign_agreement"] == 0.5
    # the oracle's A* is -γ^(d-1)(1-γ) per wasted turn: a step term on the true state ranks them
    assert b["axes"]["true/pace_q"]["sign_agreement"] > 0.5
    # GRPO gives every step of an episode one value: it cannot order two actions in one state better than chance-ish
    assert b["estimators"]["grpo"]["sign_agreement"] < b["axes"]["true/pace_q"]["sign_agreement"]
    for key in ("hidden/pretrained/1", "hidden/random_init/-1"):
        entry = b["grouping"][key]
        assert 0.0 <= entry["calibrated_eps"] <= 0.3 and set(entry["sweep"]) == {str(e) for e in oracle_study.EPS_SWEEP}
        assert 0.0 <= entry["separation"]["auc"] <= 1.0
        rates = [entry["sweep"][e]["singleton_rate"] for e in entry["sweep"]]
        assert rates[0] >= rates[-1]  # coarser with ε
    summary = result["summary"]
    assert summary["textcraft/p=0.5"]["seeds"] == 2


@pytest.mark.slow
def test_oracle_variation_ci_size(tmp_path):
    """--variation: the same episodes at every level (true state, A*, `true/*` rows equal), hash cells
    collapse to singletons at level 1, the hidden rows exist per model, and the report prints."""
    pytest.importorskip("alfworld")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "studies.oracle.study", "--size", "ci", "--variation", "0", "1",
           "--out", str(tmp_path), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "under surface variation: grouping against the true state" in proc.stdout
    assert "flat → with HGPO's levels" in proc.stdout
    result = json.loads((tmp_path / "oracle_variation_textcraft_alfworld.json").read_text())
    assert (tmp_path / "oracle_variation_textcraft_alfworld.png").stat().st_size > 0
    by_key = {(b["env"], b["variation"]): b for b in result["batches"]}
    assert set(by_key) == {(e, v) for e in ("textcraft", "alfworld") for v in (0.0, 1.0)}
    for env_name in ("textcraft", "alfworld"):
        plain, varied = by_key[(env_name, 0.0)], by_key[(env_name, 1.0)]
        assert varied["texts"]["true_states"] == plain["texts"]["true_states"] and varied["steps"] == plain["steps"]
        assert varied["grouping"]["true"] == plain["grouping"]["true"]
        assert varied["axes"]["true/pace_q"] == plain["axes"]["true/pace_q"]
        # every rendering of a state is unique at level 1: the hash partition keeps no cell
        assert varied["grouping"]["hash"]["singleton_rate"] == 1.0 and varied["texts"]["anchors"] == varied["steps"]
        assert plain["grouping"]["hash"]["singleton_rate"] < 0.5
        model = varied["models"]["ci"]
        assert {"bipace_q", "bigpo", "bihgpo", "bihpace_q"} <= set(model["estimators"]) and model["accuracy_layer"] == -1
        assert {"hidden/hierarchy", "hidden/hierarchy_pace_q"} <= set(model["axes"])
        for key, entry in model["grouping"].items():
            assert key.startswith("hidden/ci/") and 0.0 <= entry["calibrated"]["singleton_rate"] <= 1.0
        # HGPO's context cells refine the cells they split: never fewer singletons than their base
        for base, context in (("hash", "hash/context"), ("hidden/ci/-1", "hidden/ci/-1/context")):
            source = plain["grouping"] if base == "hash" else plain["models"]["ci"]["grouping"]
            rates = [source[k] if base == "hash" else source[k]["calibrated"] for k in (base, context)]
            assert rates[1]["singleton_rate"] >= rates[0]["singleton_rate"]
            assert rates[1]["split_rate"] >= rates[0]["split_rate"]
        # the level-0 cells of the hierarchy are the flat partition: the true partition's hierarchy is defined
        assert {"true/hierarchy", "hash/hierarchy"} <= set(plain["axes"])
    # TextCraft's anchor is its state: at level 0 exact matching is the truth
    tc = by_key[("textcraft", 0.0)]["grouping"]
    assert (tc["hash"]["purity"], tc["hash"]["split_rate"]) == (1.0, 0.0)
