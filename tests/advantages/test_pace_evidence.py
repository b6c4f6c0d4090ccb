"""PACE-Q with evidence (docs/concepts/math.md#pace-evidence) against a slow reference written from that page.

    w_i   = n_a / (n_a + κ)                          · SS_between / SS_total (with the gate)
    A^s_i = w_i · (Q̂(a_i) − V̂)                      the PACE branch (≥ 2 distinct actions in the cell)
    A^s_i = R_i − mean_{j∈C, j≠i} R_j                the leave-one-out fallback, as plain PACE-Q

The reference is plain loops over the cells; the package's is segment reductions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import compute_advantages, estimate_advantages, resolve_settings
from bipace_trainer.advantages import EstimatorSettings

from . import reference
from .strategies import step_lists, to_batch


def evidence_step_advantage(steps, cells, returns, kappa, gate, pace_norm):
    """The equations above, cell by cell (no vectorisation, nothing shared with the package)."""
    members = reference.members_of(cells)
    adv = [0.0] * len(steps)
    for i, step in enumerate(steps):
        cell = members[cells[i]]
        if len(cell) == 1:
            continue
        values = [returns[j] for j in cell]
        v_hat = reference.mean(values)
        keys = {steps[j]["key"] for j in cell}
        if len(keys) == 1:
            a = returns[i] - reference.mean([returns[j] for j in cell if j != i])
        else:
            same = [returns[j] for j in cell if steps[j]["key"] == step["key"]]
            weight = len(same) / (len(same) + kappa)
            if gate:
                by_key = {k: [returns[j] for j in cell if steps[j]["key"] == k] for k in keys}
                between = sum(len(r) * (reference.mean(r) - v_hat) ** 2 for r in by_key.values())
                total = sum((r - v_hat) ** 2 for r in values)
                weight *= between / total if total > 0 else 0.0
            a = weight * (reference.mean(same) - v_hat)
        if pace_norm == "mean_std":
            a /= reference.std_unbiased(values) + reference.EPS
        adv[i] = a
    return adv


def expected_advantages(steps, est, eps):
    ep = reference.episode_advantage(steps, est.advantage_norm, est.episode_stats, est.invalid_action_penalty)
    cells, margin = reference.hidden_cells(steps, eps) if est.step_partition == "hidden" else (reference.hash_cells(steps), 1.0)
    returns = reference.step_returns(steps, est.step_gamma, est.invalid_action_penalty)
    step = evidence_step_advantage(steps, cells, returns, est.pace_evidence, est.pace_variance_gate, est.pace_norm)
    return [est.w_ep * a + est.w_step * b for a, b in zip(ep, step)], margin


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=step_lists(num_keys=3),
    partition=st.sampled_from(["hash", "hidden"]),
    kappa=st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0]),
    gate=st.booleans(),
    pace_norm=st.sampled_from(["mean", "mean_std"]),
    eps=st.sampled_from([0.0, 0.1, 0.3]),
    w_ep=st.sampled_from([0.0, 1.0]),
)
def test_matches_the_slow_reference(steps, partition, kappa, gate, pace_norm, eps, w_ep):
    est = EstimatorSettings(
        step_partition=partition, step_baseline="pace_q", pace_norm=pace_norm, pace_evidence=kappa, pace_variance_gate=gate,
        cluster_eps=eps, w_ep=w_ep,
    )  # fmt: skip
    expected, margin = expected_advantages(steps, est, eps)
    assume(margin > 1e-4)  # a hidden-state join decided within float rounding of ε
    got, _ = compute_advantages(to_batch(steps), est, cluster_eps=eps if partition == "hidden" else None)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=2e-4, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists(num_keys=3), kappa=st.sampled_from([0.5, 1.0, 3.0]), gate=st.booleans())
def test_evidence_only_shrinks_the_pace_branch(steps, kappa, gate):
    """Against plain PACE-Q on the same cells: a PACE-branch step keeps its sign and loses magnitude
    (by n_a / (n_a + κ) exactly without the gate); a leave-one-out or singleton step is unchanged."""
    batch = to_batch(steps)
    plain = estimate_advantages(batch, resolve_settings("gigpo", step_baseline="pace_q", w_ep=0.0))
    shrunk = estimate_advantages(
        batch, resolve_settings("gigpo", step_baseline="pace_q", w_ep=0.0, pace_evidence=kappa, pace_variance_gate=gate)
    )
    assert torch.equal(plain.branch, shrunk.branch)
    pace = plain.branch == 0
    assert torch.equal(plain.advantage[~pace], shrunk.advantage[~pace])
    a0, a1 = plain.advantage[pace].double(), shrunk.advantage[pace].double()
    assert (a1.abs() <= a0.abs() + 1e-6).all() and (a0 * a1 >= 0).all()
    if not gate:
        same = {}
        for i in torch.nonzero(pace).flatten().tolist():
            same.setdefault((int(plain.cell[i]), steps[i]["key"]), []).append(i)
        for rows in same.values():
            factor = len(rows) / (len(rows) + kappa)
            torch.testing.assert_close(shrunk.advantage[rows], plain.advantage[rows] * factor, atol=1e-6, rtol=1e-5)


def test_a_lucky_action_seen_once_gets_less_than_its_raw_estimate():
    """ECPO's divergent anchor: one state, an action taken once that happened to win (R = 1) and an
    action taken three times with returns 0.5, 0.5, 0.9. Plain PACE-Q credits the lucky one with
    Q̂ − V̂ = 1 − 0.725 = 0.275; with κ = 1 it gets half of that, the well-sampled action 3/4 of its."""
    steps = [
        dict(group=0, traj=j, t=0, reward=r, valid=True, anchor="s", key=k, hidden=[1.0, 0.0, 0.0])
        for j, (k, r) in enumerate([("lucky", 1.0), ("common", 0.5), ("common", 0.5), ("common", 0.9)])
    ]
    batch = to_batch(steps)
    settings_ = dict(step_baseline="pace_q", w_ep=0.0)
    plain = compute_advantages(batch, resolve_settings("gigpo", **settings_))[0]
    shrunk = compute_advantages(batch, resolve_settings("gigpo", pace_evidence=1.0, **settings_))[0]
    torch.testing.assert_close(plain, torch.tensor([0.275, -0.091667, -0.091667, -0.091667]), atol=1e-6, rtol=0)
    torch.testing.assert_close(shrunk, torch.tensor([0.1375, -0.06875, -0.06875, -0.06875]), atol=1e-6, rtol=0)
    # the variance gate: the actions explain SS_between / SS_total = 0.100833 / 0.2075 of the cell's spread
    gated = compute_advantages(batch, resolve_settings("gigpo", pace_variance_gate=True, **settings_))[0]
    torch.testing.assert_close(gated, plain * (0.10083333 / 0.2075), atol=1e-6, rtol=0)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True])
def test_a_bad_pace_evidence_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"pace_evidence=.* must be a finite number >= 0"):
        resolve_settings("bipace_q", pace_evidence=value)
