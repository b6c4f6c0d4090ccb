"""HGPO's hierarchy (docs/concepts/math.md#hgpo): the context levels against a slow reference, the
edge cases the issue names, the hierarchy over hidden clusters, settings and diagnostics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.advantages import (
    BatchLayout,
    LevelledPartition,
    SettingsError,
    StepBatch,
    compute_advantages,
    context_partition,
    estimate_advantages,
    hash_partition,
    resolve_settings,
)

from .strategies import step_lists, to_batch


def contexts(steps, levels):
    """Slow reference: for every step and level k <= min(K, t), the tuple (group, anchors t-k..t)."""
    by_traj = {}
    for s in steps:
        by_traj.setdefault(s["traj"], {})[s["t"]] = s["anchor"]
    out = []
    for s in steps:
        history = by_traj[s["traj"]]
        window = range(min(levels, s["t"]) + 1)
        out.append({k: (s["group"], tuple(history[s["t"] - j] for j in range(k, -1, -1))) for k in window})
    return out


@settings(max_examples=80, deadline=None)
@given(steps=st.integers(2, 4).flatmap(lambda a: step_lists(max_traj=5, max_len=7, num_anchors=a)), levels=st.integers(0, 4))
def test_levels_are_the_cells_of_equal_contexts(steps, levels):
    """Two steps share a level-k cell iff both have level k and their k+1 anchors agree;
    the flat cell is the deepest level; levels nest."""
    batch = to_batch(steps)
    layout = BatchLayout.from_batch(batch)
    part = context_partition(hash_partition(batch.anchor, layout), layout, levels)
    assert isinstance(part, LevelledPartition) and part.depth == levels
    truth = contexts(steps, levels)
    n = len(steps)
    assert part.reach.tolist() == [min(levels, s["t"]) for s in steps]
    for k, level in enumerate(part.levels):
        cell = level.cell.tolist()
        for i in range(n):
            for j in range(i + 1, n):
                same = k in truth[i] and k in truth[j] and truth[i][k] == truth[j][k]
                assert (cell[i] == cell[j]) == same, (k, i, j)
        assert level.size.sum() == n and (torch.bincount(level.cell) == level.size).all()
    deepest = [(min(levels, s["t"]), truth[i][min(levels, s["t"])]) for i, s in enumerate(steps)]
    flat = part.cell.tolist()
    for i in range(n):
        for j in range(i + 1, n):
            assert (flat[i] == flat[j]) == (deepest[i] == deepest[j])


def rows_batch(trajectories, group=0, **extra):
    """A StepBatch from [(anchors, success)], one anchor per character, reward on the last step."""
    group_, traj, t, reward, anchor = [], [], [], [], []
    for j, (anchors, success) in enumerate(trajectories):
        for k, a in enumerate(anchors):
            group_.append(group)
            traj.append(j)
            t.append(k)
            reward.append(success if k == len(anchors) - 1 else 0.0)
            anchor.append(a)
    return StepBatch(group=group_, traj=traj, t=t, reward=reward, anchor=anchor, action_key=anchor, **extra)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists(), gamma=st.sampled_from([0.9, 0.95, 1.0]))
def test_k0_in_mean_mode_is_gigpos_step_term(steps, gamma):
    """K = 0: one level, the anchor cell; without the std the level advantage is GiGPO's
    step term, scaled by w/(w + 1e-6) (the code's weight normalisation)."""
    batch = to_batch(steps)
    hgpo = compute_advantages(batch, resolve_settings("hgpo", context_levels=0, advantage_norm="mean", step_gamma=gamma))[0]
    gigpo = compute_advantages(batch, resolve_settings("gigpo", w_ep=0.0, advantage_norm="mean", step_gamma=gamma))[0]
    torch.testing.assert_close(hgpo, gigpo * (2 / (2 + 1e-6)), atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists())
def test_k0_in_mean_std_mode_differs_from_gigpo_by_the_std_estimator_only(steps):
    """HGPO's code divides by the population std, GiGPO's by the unbiased one: per cell of
    n steps the two step terms differ by sqrt((n-1)/n) (up to the 1e-6 beside the std)."""
    batch = to_batch(steps)
    hgpo = estimate_advantages(batch, resolve_settings("hgpo", context_levels=0))
    gigpo = compute_advantages(batch, resolve_settings("gigpo", w_ep=0.0))[0].double()
    n = hgpo.levels.size[:, 0].double()
    scale = torch.where(n > 1, torch.sqrt(n / (n - 1).clamp(min=1)), torch.ones_like(n))
    # an a of 0 drops out either way; otherwise |a| > 0 and the ratio is the std ratio
    torch.testing.assert_close(hgpo.advantage.double(), gigpo * scale, atol=1e-4, rtol=1e-3)


def test_revisiting_a_state_pools_the_trajectorys_own_steps():
    """Trajectory 0 sees "a" at t = 0 and t = 2: both steps share the level-0 cell with
    trajectory 1's "a", and at level 1 its ("b","a") has no partner."""
    batch = rows_batch([("aba", 1.0), ("ac", 0.0)])
    est = estimate_advantages(batch, resolve_settings("hgpo", advantage_norm="mean", step_gamma=0.5))
    cell = est.levels.cell
    assert cell[0, 0] == cell[2, 0] == cell[3, 0]  # "a" three times, two of them trajectory 0's
    assert est.levels.size[0, 0] == 3 and est.levels.size[2, 1] == 1  # ("b","a") alone
    # returns (γ = 0.5): traj 0 (0.25, 0.5, 1), traj 1 (0, 0); level-0 cell "a": (0.25, 1, 0)
    mean = (0.25 + 1.0 + 0.0) / 3
    assert est.advantage[2].item() == pytest.approx((1.0 - mean) * 2 / (2 + 1e-6), abs=1e-6)
    assert not est.levels.used[2, 1:].any()


def test_all_singleton_levels_give_zero_or_the_episode_item():
    batch = rows_batch([("ab", 1.0), ("cd", 0.0)])
    plain = compute_advantages(batch, resolve_settings("hgpo"))[0]
    assert (plain == 0).all()
    with_base = estimate_advantages(batch, resolve_settings("hgpo", base_group=True, advantage_norm="mean"))
    episode = torch.tensor([0.5, 0.5, -0.5, -0.5])  # R^ep (1, 0) minus the group mean, per trajectory
    torch.testing.assert_close(with_base.advantage, (episode / (1 + 1e-6)).float())
    assert with_base.diagnostics["hierarchy/no_level_frac"] == 1.0


def test_steps_before_t_equals_k_have_only_their_levels():
    batch = rows_batch([("aaa", 1.0), ("aaa", 0.0)])
    est = estimate_advantages(batch, resolve_settings("hgpo", context_levels=4, advantage_norm="mean"))
    reach = [0, 1, 2, 0, 1, 2]
    for i, r in enumerate(reach):
        assert (est.levels.cell[i, : r + 1] >= 0).all() and (est.levels.cell[i, r + 1 :] == -1).all()
        assert (est.levels.size[i, r + 1 :] == 0).all() and not est.levels.used[i, r + 1 :].any()
    # t = 2: level 0 pools every "a" (returns 0.9025, 0.95, 1, 0, 0, 0), level 1 the four steps
    # with t >= 1, level 2 the two with t = 2; weights 2:3:4
    a0 = 1.0 - (0.9025 + 0.95 + 1.0) / 6
    a1 = 1.0 - (0.95 + 1.0) / 4
    a2 = 1.0 - 0.5
    assert est.advantage[2].item() == pytest.approx((2 * a0 + 3 * a1 + 4 * a2) / (9 + 1e-6), abs=1e-6)


def test_alpha_zero_weighs_levels_equally_and_alpha_two_favours_depth():
    batch = rows_batch([("aaa", 1.0), ("aaa", 0.0)])
    a = [1.0 - (0.9025 + 0.95 + 1.0) / 6, 1.0 - (0.95 + 1.0) / 4, 0.5]
    for alpha, weights in ((0.0, [1, 1, 1]), (2.0, [4, 9, 16])):
        adv = compute_advantages(batch, resolve_settings("hgpo", advantage_norm="mean", level_alpha=alpha))[0]
        expected = sum(w * x for w, x in zip(weights, a)) / (sum(weights) + 1e-6)
        assert adv[2].item() == pytest.approx(expected, abs=1e-6)


def one_hot(batch: StepBatch) -> torch.Tensor:
    return torch.nn.functional.one_hot(batch.anchor, int(batch.anchor.max()) + 1).to(torch.float32)


@settings(max_examples=40, deadline=None)
@given(steps=step_lists(max_len=7, num_anchors=3), norm=st.sampled_from(["mean", "mean_std"]))
def test_bihgpo_at_eps0_on_one_hot_states_is_hgpo(steps, norm):
    """The hierarchy over hidden clusters: with ε = 0 and one-hot states the clusters are
    the anchors, so every level (the sequence of clusters) is HGPO's."""
    batch = to_batch(steps)
    batch.hidden = one_hot(batch)
    hgpo = compute_advantages(batch, resolve_settings("hgpo", advantage_norm=norm))[0]
    bihgpo = compute_advantages(batch, resolve_settings("bihgpo", advantage_norm=norm, cluster_eps=0.0))[0]
    torch.testing.assert_close(hgpo, bihgpo, atol=0, rtol=0)


def test_bihpace_q_applies_pace_q_on_every_level():
    """Level 0 = the anchor cell, level 1 = (previous, current); PACE-Q per level: Q̂(a) − V̂."""
    batch = StepBatch(
        group=[0] * 6, traj=[0, 0, 1, 1, 2, 2], t=[0, 1] * 3, reward=[0, 1, 0, 0, 0, 1],
        anchor=["s", "x", "s", "x", "s", "x"], action_key=["go", "stop", "go", "wait", "go", "stop"],
    )  # fmt: skip
    batch.hidden = one_hot(batch)
    est = estimate_advantages(batch, resolve_settings("bihpace_q", cluster_eps=0.0, step_gamma=1.0))
    # at "x" (t = 1) levels 0 and 1 hold the same three steps: Q̂(stop) = 1, Q̂(wait) = 0, V̂ = 2/3
    assert est.levels.advantage[1, 0].item() == pytest.approx(1 / 3)
    assert est.levels.advantage[1, 1].item() == pytest.approx(1 / 3)
    assert est.levels.advantage[3, 0].item() == pytest.approx(-2 / 3)
    assert est.advantage[1].item() == pytest.approx(1 / 3 * 5 / (5 + 1e-6), abs=1e-6)
    # at "s" everyone said "go": one key, PACE-Q falls back to leave-one-out on returns (1, 0, 1)
    assert est.levels.advantage[2, 0].item() == pytest.approx(0 - 1.0)


def test_a_one_level_baseline_over_context_levels_uses_the_deepest_cells():
    """gigpo with context_levels = 2: the cells are the steps whose whole 2-step context agrees."""
    batch = rows_batch([("abc", 1.0), ("xbc", 0.0), ("abc", 0.0)])
    est = estimate_advantages(batch, resolve_settings("gigpo", context_levels=2, w_ep=0.0, advantage_norm="mean"))
    assert est.cell[2] != est.cell[5] and est.cell[2] == est.cell[8]  # ("x","b","c") apart from ("a","b","c")
    flat = estimate_advantages(batch, resolve_settings("gigpo", w_ep=0.0, advantage_norm="mean"))
    assert flat.cell[2] == flat.cell[5] == flat.cell[8]


def test_diagnostics_per_level():
    batch = rows_batch([("aaa", 1.0), ("aaa", 0.0), ("abc", 0.0)])
    _, diag = compute_advantages(batch, resolve_settings("hgpo"))
    fractions = [diag[f"hierarchy/deepest_level{k}_frac"] for k in range(3)] + [diag["hierarchy/no_level_frac"]]
    assert sum(fractions) == pytest.approx(1.0)
    # level 0: cells "a" (7 steps), "b", "c": 9 steps in 3 cells
    assert diag["hierarchy/level0/cell_size_mean"] == pytest.approx(3.0)
    # level 2 (t = 2 only): ("a","a","a") twice, ("a","b","c") once → 3 steps in 2 cells
    assert diag["hierarchy/level2/cell_size_mean"] == pytest.approx(1.5)
    assert diag["hierarchy/level2/singleton_rate"] == pytest.approx(1 / 3)
    # step "c" (t = 2 of trajectory 2) and "b" have no cell of two: no level survives
    assert diag["hierarchy/no_level_frac"] == pytest.approx(2 / 9)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(context_levels=-1), "context_levels"),
        (dict(context_levels=1.5), "context_levels"),
        (dict(level_weights="k+3"), "level_weights"),
        (dict(level_baseline="gae"), "level_baseline"),
        (dict(level_alpha=math.inf), "level_alpha"),
        (dict(drop_zero_levels="yes"), "drop_zero_levels"),
        (dict(base_group=1), "base_group"),
    ],
)
def test_bad_hierarchy_settings_name_the_field(overrides, field):
    with pytest.raises(SettingsError, match=field) as info:
        resolve_settings("hgpo", **overrides)
    assert info.value.field == field


def test_presets_are_the_spec_table():
    hgpo = resolve_settings("hgpo")
    assert (hgpo.step_partition, hgpo.step_baseline, hgpo.context_levels, hgpo.w_ep) == ("hash", "hierarchy", 2, 0.0)
    assert (hgpo.level_weights, hgpo.drop_zero_levels, hgpo.base_group, hgpo.level_alpha) == ("k+2", True, False, 1.0)
    assert resolve_settings("bihgpo").step_partition == "hidden" and resolve_settings("bihgpo").rollout_needs == {"hidden"}
    assert resolve_settings("bihpace_q").level_baseline == "pace_q"


def test_config_maps_the_hierarchy_fields_and_warns_past_the_history():
    from bipace_trainer import BiPACEConfig

    common = dict(output_dir="/tmp/unused", env_name="tiny", use_cpu=True, report_to=[])
    config = BiPACEConfig(preset="hgpo", level_weights="k+1", drop_zero_levels=False, base_group=True, **common)
    est = config.estimator
    assert (est.level_weights, est.drop_zero_levels, est.base_group, est.context_levels) == ("k+1", False, True, 2)
    with pytest.warns(UserWarning, match="context_levels=3 exceeds history_length=2"):
        BiPACEConfig(preset="hgpo", context_levels=3, **common)
    with pytest.raises(ValueError, match="level_weights"):
        BiPACEConfig(preset="hgpo", level_weights="k+3", **common)
