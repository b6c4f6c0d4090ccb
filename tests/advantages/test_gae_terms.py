"""GAGPO's per-step terms (`baselines.GaeTerms`, what the rollout dumps show under `gae`): they
leave the advantages bit-identical, equal a plain-loop transcription of docs/concepts/math.md#gae, and
redo each step's advantage from the terms alone (A_t = w_step (Σ_k (γλ)^k δ_{t+k} - p̃_t - μ_B) /
(σ_B + 1e-6), w_ep = 0 in the GAE presets)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import StepAdvantageEstimator, compute_advantages, estimate_advantages, resolve_settings
from bipace_trainer.rollout.trajectories import _gae as dump_terms

from . import reference
from .strategies import step_lists, to_batch

GAE_PRESETS = ["gagpo", "bigagpo"]
TERM_NAMES = ("value", "next_value", "delta", "discounted_sum", "penalty", "group_mean", "group_std")


def reference_terms(steps, cells, gamma, lam, penalty, bootstrap):
    """The terms step by step from docs/concepts/math.md#gae, given each step's cell: V̄ the mean env return
    of the cell, V̄(s_L) = 0 or the bootstrap R_L, δ, G by its recursion, the penalty centred on
    the cell, then μ_B and unbiased σ_B over the task group's shared steps."""
    members = reference.members_of(cells)
    after = {}
    if bootstrap:
        terminal = reference.env_returns(steps, gamma)
        after = {i: reference.mean([terminal[j] for j in members[cells[i]]]) for i, s in enumerate(steps) if s["truncated"]}
    env = reference.env_returns(steps, gamma, after)
    pen = reference.penalties(steps, penalty)
    terms = [dict(value=reference.mean([env[j] for j in members[cells[i]]])) for i in range(len(steps))]
    for i, term in enumerate(terms):
        term["penalty"] = pen[i] - reference.mean([pen[j] for j in members[cells[i]]])
        term["shared"] = len(members[cells[i]]) > 1
    for order in reference.trajectories(steps).values():
        running = 0.0
        for pos in reversed(range(len(order))):
            i = order[pos]
            terms[i]["next_value"] = terms[order[pos + 1]]["value"] if pos + 1 < len(order) else after.get(i, 0.0)
            terms[i]["delta"] = steps[i]["reward"] + gamma * terms[i]["next_value"] - terms[i]["value"]
            running = terms[i]["delta"] + gamma * lam * running
            terms[i]["discounted_sum"] = running
    for group in {s["group"] for s in steps}:
        shared = [i for i, s in enumerate(steps) if s["group"] == group and terms[i]["shared"]]
        raw = [terms[i]["discounted_sum"] - terms[i]["penalty"] for i in shared]
        for i in shared:
            terms[i]["group_mean"] = reference.mean(raw)
            terms[i]["group_std"] = reference.std_unbiased(raw) if len(raw) > 1 else 0.0
    return terms


def advantage_from_terms(steps, terms, gamma, lam, w_step):
    """Each step's advantage from the dumped terms alone: the discounted sum of its trajectory's
    δ from t on, minus the centred penalty, normalised by its group's μ and σ; 0 when alone."""
    advantage = [0.0] * len(steps)
    for order in reference.trajectories(steps).values():
        for pos, i in enumerate(order):
            if not terms[i]["shared"]:
                continue
            discounted = sum((gamma * lam) ** k * terms[j]["delta"] for k, j in enumerate(order[pos:]))
            raw = discounted - terms[i]["penalty"]
            advantage[i] = w_step * (raw - terms[i]["group_mean"]) / (terms[i]["group_std"] + reference.EPS)
    return advantage


@pytest.mark.parametrize("preset", GAE_PRESETS)
@settings(max_examples=60, deadline=None)
@given(
    steps=step_lists(),
    gamma=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    lam=st.sampled_from([0.0, 0.7, 0.95, 1.0]),
    penalty=st.sampled_from([0.0, 0.1]),
    w_step=st.sampled_from([1.0, 0.5]),
    bootstrap=st.booleans(),
    eps=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_terms_match_the_reference_and_redo_the_advantage(preset, steps, gamma, lam, penalty, w_step, bootstrap, eps):
    est = resolve_settings(preset, step_gamma=gamma, gae_lambda=lam, invalid_action_penalty=penalty, w_step=w_step,
                           bootstrap_truncated=bootstrap, cluster_eps=eps)  # fmt: skip
    advantage, _ = compute_advantages(to_batch(steps), est, cluster_eps=eps)
    estimate = estimate_advantages(to_batch(steps), est, cluster_eps=eps)
    assert torch.equal(estimate.advantage, advantage)  # the terms change no advantage, bit for bit
    terms = dump_terms(estimate.gae)  # as the dump holds them: one plain dict per step
    expected = reference_terms(steps, estimate.cell.tolist(), gamma, lam, penalty, bootstrap)
    for got, want in zip(terms, expected):
        assert got["shared"] == want["shared"]
        names = TERM_NAMES if want["shared"] else TERM_NAMES[:5]  # μ_B, σ_B normalise shared steps only
        assert [got[name] for name in names] == pytest.approx([want[name] for name in names], abs=1e-9)
    redone = advantage_from_terms(steps, terms, gamma, lam, w_step)
    torch.testing.assert_close(advantage.double(), torch.tensor(redone, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("preset", GAE_PRESETS)
def test_the_estimator_carries_the_terms_and_other_baselines_none(preset):
    steps = [dict(group=0, traj=tr, t=t, reward=float(t == 1 and tr == 0), valid=True, anchor=f"s{t}", key="a",
                  hidden=[1.0, 0.0, float(t)], truncated=False) for tr in range(2) for t in range(2)]  # fmt: skip
    estimator = StepAdvantageEstimator(resolve_settings(preset, cluster_eps=0.01))
    estimate = estimator.estimate(to_batch(steps))
    assert estimate.gae is not None and estimate.gae.shared.all()
    # s1 holds the returns 1 and 0: V̄ 0.5; s0 holds 0.95 and 0: V̄ 0.475
    assert estimate.gae.value.tolist() == pytest.approx([0.475, 0.5, 0.475, 0.5])
    assert estimate.gae.delta.tolist() == pytest.approx([0.95 * 0.5 - 0.475, 0.5, 0.95 * 0.5 - 0.475, -0.5])
    for other in ("gigpo", "bipace_q", "hgpo", "grpo"):
        assert estimate_advantages(to_batch(steps), resolve_settings(other, cluster_eps=0.01)).gae is None
