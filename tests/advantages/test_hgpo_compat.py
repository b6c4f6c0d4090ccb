"""`hgpo` reproduces verl-agent's `compute_hgpo_outcome_advantage`: its algorithm (float64, means of
equal values exact) to 1e-5; the code's float32 means of equal values differ (docs/results/fidelity.md).

The reference is transcribed in `hgpo_reference.py` (upstream commit b4918cc). The
compatibility setting is the `hgpo` preset itself, with `episode_stats="steps"` when
`base_group` is on (the episode item is GiGPO's row-wise normalisation). Hand-made
cases isolate the code's quirks; the property test checks arbitrary batches over both
modes, `base_group` on and off, K = 0..4 and α ∈ {0, 1, 2}.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import StepBatch, compute_advantages, resolve_settings
from bipace_trainer.advantages.records import segment_mean_std, zero_mean_residue

from .hgpo_reference import hgpo_advantages
from .strategies import step_lists

MODES = {"mean_std": "mean_std_norm", "mean": "mean_norm"}


def both(
    rows, *, levels=2, norm="mean_std", alpha=1.0, base_group=False, gamma=0.95, penalty=0.1, dtype=torch.float64,
    exact_mean=True,
):  # fmt: skip
    """(ours, reference) for rows (group, traj, t, reward, valid, anchor) in trajectory order."""
    group, traj, t, reward, valid, anchor = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor)
    est = resolve_settings(
        "hgpo", episode_stats="steps", advantage_norm=norm, context_levels=levels, level_alpha=alpha, base_group=base_group,
        step_gamma=gamma, invalid_action_penalty=penalty,
    )  # fmt: skip
    ours = compute_advantages(batch, est)[0]
    ref = hgpo_advantages(
        group, traj, reward, valid, anchor, history_length=levels, gamma=gamma, penalty_coef=penalty,
        mode=MODES[norm], alpha=alpha, base_group=base_group, dtype=dtype, exact_mean=exact_mean,
    )  # fmt: skip
    return ours, ref.to(torch.float32)


def rows_of(trajectories, group=0, first_traj=0):
    """Rows from [(anchors, success), ...]: one anchor per character, the success reward on
    the last step, all valid."""
    rows = []
    for j, (anchors, success) in enumerate(trajectories):
        for t, anchor in enumerate(anchors):
            rows.append((group, first_traj + j, t, success if t == len(anchors) - 1 else 0.0, True, anchor))
    return rows


QUIRKS = {
    # Contexts differ although the current anchor is the same: level 0 pools "c" of every
    # trajectory, level 1 splits ("a","c") from ("b","c").
    "context_splits_a_shared_anchor": rows_of([("acg", 1.0), ("bcg", 0.0), ("ach", 0.0), ("bch", 1.0)]),
    # A trajectory revisiting a state puts two of its own steps into one cell.
    "revisit_within_a_trajectory": rows_of([("ababg", 1.0), ("abg", 0.0), ("abab", 0.0)]),
    # Every anchor distinct: no cell of two, every step 0 (no base group).
    "all_singletons": rows_of([("ab", 1.0), ("cd", 0.0)]),
    # t < K: the first steps have only the levels their history allows.
    "short_histories": rows_of([("aaa", 1.0), ("aa", 0.0), ("a", 1.0)]),
    # A level whose advantage is exactly 0 (equal returns in its cell) leaves the mean.
    "zero_levels_dropped": rows_of([("abg", 1.0), ("abg", 1.0), ("cbh", 0.0)]),
    # Cells never cross task groups.
    "groups_apart": rows_of([("ab", 1.0), ("ac", 0.0)]) + rows_of([("ab", 0.0), ("ab", 1.0)], 1, first_traj=10),
}


@pytest.mark.parametrize("base_group", [False, True])
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("case", sorted(QUIRKS))
def test_quirk_matches_reference(case, norm, base_group):
    for levels in (0, 1, 2, 4):
        ours, ref = both(QUIRKS[case], levels=levels, norm=norm, base_group=base_group)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
        _, ref32 = both(QUIRKS[case], levels=levels, norm=norm, base_group=base_group, dtype=torch.float32)
        torch.testing.assert_close(ours, ref32, atol=1e-5, rtol=0)


def test_weights_are_k_plus_2_and_zero_levels_leave_the_mean():
    """Two trajectories share ("a", "b") and differ after: at "b" (t = 1) level 0 and level 1
    hold the same two steps, so a_0 = a_1 and the weighted mean is a_0 · (2+3)/(5+1e-6)."""
    rows = [(0, 0, 0, 0.0, True, "a"), (0, 0, 1, 1.0, True, "b"), (0, 1, 0, 0.0, True, "a"), (0, 1, 1, 0.0, True, "b")]
    ours, ref = both(rows, levels=2, norm="mean")
    # returns: traj 0 (0.95, 1), traj 1 (0, 0); at "b": a = ±0.5 on both levels
    assert ours[1].item() == pytest.approx(0.5 * 5 / (5 + 1e-6), abs=1e-7)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # the paper's weights change nothing when all surviving levels agree ...
    paper = resolve_settings("hgpo", advantage_norm="mean", level_weights="k+1", drop_zero_levels=False)
    batch = StepBatch(*(list(c) for c in zip(*[(g, tr, t, r) for g, tr, t, r, _, _ in rows])), anchor=["a", "b", "a", "b"])
    assert compute_advantages(batch, paper)[0][1].item() == pytest.approx(0.5, abs=1e-6)


def test_paper_setting_keeps_zero_levels_in_the_mean():
    """At "b" of trajectories 0 and 1, level 1 ("a","b") holds two equal returns (a_1 = 0)
    while level 0 ("b") also holds trajectory 2's: the code drops a_1, the paper averages it in."""
    rows = rows_of([("ab", 1.0), ("ab", 1.0), ("cb", 0.0)])
    batch = StepBatch(*(list(c) for c in zip(*[(g, tr, t, r) for g, tr, t, r, _, _ in rows])), anchor=[r[5] for r in rows])
    code = compute_advantages(batch, resolve_settings("hgpo", advantage_norm="mean"))[0]
    paper = compute_advantages(batch, resolve_settings("hgpo", advantage_norm="mean", level_weights="k+1", drop_zero_levels=False))[0]
    a0 = 1.0 - 2.0 / 3.0  # level 0 "b": returns (1, 1, 0)
    assert code[1].item() == pytest.approx(a0, abs=1e-6)  # level 1 dropped
    assert paper[1].item() == pytest.approx(1 * a0 / (1 + 2), abs=1e-6)  # w = (1, 2), a_1 = 0 kept


def _steps(rows):
    """Property-test steps from rows (group, traj, t, reward, valid, anchor)."""
    keys = ("group", "traj", "t", "reward", "valid", "anchor")
    return [dict(zip(keys, row), key="act-0", hidden=[1.0, 0.0, 0.0], truncated=False) for row in rows]


# Hypothesis' counterexample: at traj 1001, t = 1 (invalid, return -0.5 - 0.1) the return
# equals the mean of its level-0 cell "obs-2" (-0.5, 0.5, 0.4, -0.6, -1.5, -2, -1.1, 0), so
# a_0 = 0 and the code drops the level, leaving the episode item alone (-1.557). The float64
# mean left a 1e-16 residue instead, the level stayed in as ~0 and halved it (-0.778).
RETURN_AT_ITS_CELL_MEAN = _steps(
    [(0, 1000, t, r, v, a) for t, (r, v, a) in enumerate(
        [(0.0, True, "obs-2"), (-1.0, True, "obs-0"), (0.0, True, "obs-2"), (0.5, False, "obs-2")]
    )]
    + [(0, 1001, t, r, v, a) for t, (r, v, a) in enumerate(
        [(0.0, True, "obs-0"), (0.5, False, "obs-2"), (0.5, True, "obs-0"), (0.5, True, "obs-2"),
         (-1.0, True, "obs-2"), (-1.0, False, "obs-2"), (0.0, True, "obs-2")]
    )]
)  # fmt: skip


# Another: the base item. Rows score 1 (18), 0 (2) and 0.9 (6 invalid rows), and the mean
# of the 26 is 0.9, so A^ep = 0 there and the code drops it; a float64 residue kept it as
# ~0 in the reference's mean (the package's sum gave exactly 0), halving those 6 steps.
SCORE_AT_ITS_GROUP_MEAN = _steps(
    [(1, traj, t, float(won and t == n - 1), t not in invalid, "obs-0")
     for traj, (n, won, invalid) in enumerate(
        [(6, 1, ()), (7, 1, ()), (2, 0, ()), (2, 1, ()), (5, 1, (3, 4)), (4, 1, (0, 1, 2, 3))], start=1004
     )
     for t in range(n)]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@example(steps=SCORE_AT_ITS_GROUP_MEAN, norm="mean_std", base_group=True, levels=0, alpha=0.0, gamma=0.9, penalty=0.1)
@example(steps=SCORE_AT_ITS_GROUP_MEAN, norm="mean", base_group=True, levels=1, alpha=1.0, gamma=0.9, penalty=0.1)
@example(steps=RETURN_AT_ITS_CELL_MEAN, norm="mean_std", base_group=True, levels=0, alpha=0.0, gamma=1.0, penalty=0.1)
@example(steps=RETURN_AT_ITS_CELL_MEAN, norm="mean", base_group=False, levels=2, alpha=1.0, gamma=1.0, penalty=0.1)
@given(
    steps=st.integers(2, 4).flatmap(lambda a: step_lists(max_groups=4, max_traj=6, max_len=8, num_anchors=a)),
    norm=st.sampled_from(["mean_std", "mean"]),
    base_group=st.booleans(),
    levels=st.integers(0, 4),
    alpha=st.sampled_from([0.0, 1.0, 2.0]),
    gamma=st.sampled_from([0.9, 0.95, 1.0]),
    penalty=st.sampled_from([0.0, 0.1]),
)
def test_matches_reference_on_any_batch(steps, norm, base_group, levels, alpha, gamma, penalty):
    """1e-5 against the reference's algorithm (float64, so a rounding residue the
    reference's own float32 would leave in a cell of equal returns is not mistaken for a
    difference in method)."""
    steps = sorted(steps, key=lambda s: (s["traj"], s["t"]))
    rows = [(s["group"], s["traj"], s["t"], s["reward"], s["valid"], s["anchor"]) for s in steps]
    ours, ref = both(rows, levels=levels, norm=norm, alpha=alpha, base_group=base_group, gamma=gamma, penalty=penalty)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_the_codes_float32_mean_leaves_a_residue_that_escapes_the_zero_drop():
    """G = 8 successes through the same two states: at "a" every return is 0.95. The code's
    float32 `r.mean()` of eight 0.95s is off by one ulp (6e-8), so r − mean is not 0, the
    level is not dropped, and ÷ (σ + 1e-6) with σ the same 6e-8 turns it into +0.056 for
    all eight steps. This project's cell means are exact for equal returns: 0, as the
    code's rule intends (`hgpo_reference` module docstring)."""
    rows = rows_of([("ab", 1.0)] * 8)
    ours, code = both(rows, dtype=torch.float32, exact_mean=False)
    _, intended = both(rows, dtype=torch.float32, exact_mean=True)
    first = torch.tensor([t == 0 for _, _, t, _, _, _ in rows])
    assert (ours == 0).all() and (intended == 0).all()
    assert code[first].tolist() == pytest.approx([0.05625] * 8, abs=1e-4)  # d / (d + 1e-6), d = 2^-24
    assert (code[~first] == 0).all()  # returns of 1.0: the float32 mean is exact there


def test_a_value_equal_to_its_mean_is_centred_to_exactly_zero():
    """The cell of the first counterexample above: the package's float64 mean of these
    returns is -0.6000000000000001, so R - mean at R = -0.6 is 1.1e-16, not the 0 that
    HGPO's zero-drop reads. `zero_mean_residue` (episode and level advantages) makes it 0
    and leaves every real deviation as it was."""
    returns = torch.tensor([-0.5, 0.5, 0.5 - 0.1, -0.5 - 0.1, -1.5, -2.0, -1.0 - 0.1, 0.0], dtype=torch.float64)
    cell = torch.zeros(8, dtype=torch.long)
    _, mean, _ = segment_mean_std(returns, cell, 1)
    centred = returns - mean[cell]
    assert 0 < abs(centred[3].item()) < 1e-15  # the residue this guards against
    snapped = zero_mean_residue(centred, returns, cell, 1)
    assert snapped[3].item() == 0.0
    keep = torch.arange(8) != 3
    assert torch.equal(snapped[keep], centred[keep])
