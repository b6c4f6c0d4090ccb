"""Presets are data; settings fail early with the field's name; ε "auto" is calibrated once."""

from __future__ import annotations

import pytest
import torch

from bipace_trainer.advantages import (
    PRESETS,
    BatchLayout,
    StepAdvantageEstimator,
    StepBatch,
    calibrate_eps,
    compute_advantages,
    hidden_partition,
    register_preset,
    resolve_settings,
)

PRESET_TABLE = {  # docs/concepts/math.md#presets: partition, baseline, w_ep, importance ratio
    "grpo": ("none", None, 1.0, "token"),
    "gigpo": ("hash", "mean", 1.0, "token"),
    "bigpo": ("hidden", "mean", 1.0, "token"),
    "bipace_q": ("hidden", "pace_q", 1.0, "token"),
    "bipace_diff": ("hidden", "pace_diff", 1.0, "token"),
    "gagpo": ("hash", "gae", 0.0, "sequence"),
    "bigagpo": ("hidden", "gae", 0.0, "sequence"),
}


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_presets_follow_the_spec_table(name):
    s = resolve_settings(name)
    assert (s.step_partition, s.step_baseline, s.w_ep, s.importance_sampling_level) == PRESET_TABLE[name]
    assert s.step_gamma == 0.95 and s.invalid_action_penalty == 0.1


def test_every_axis_stays_settable():
    s = resolve_settings("gigpo", advantage_norm="mean", w_step=0.8)
    assert (s.step_partition, s.step_baseline, s.advantage_norm, s.w_step) == ("hash", "mean", "mean", 0.8)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(preset="nope"), "preset"),
        (dict(preset="gigpo", cluster_eps=-0.1), "cluster_eps"),
        (dict(preset="gigpo", cluster_eps="tiny"), "cluster_eps"),
        (dict(preset="gigpo", norm="l2"), "norm"),
        (dict(preset="gigpo", baseline="median"), "baseline"),
        (dict(preset="grpo", baseline="mean"), "baseline"),  # contradictory override
        (dict(preset="gigpo", gamma=1.5), "gamma"),
        (dict(preset="gagpo", lam=-1.0), "lam"),
        (dict(preset="gigpo", invalid_penalty=-0.1), "invalid_penalty"),
        (dict(preset="gigpo", target_singleton_rate=2.0), "target_singleton_rate"),
        (dict(preset="gigpo", bogus=1), "bogus"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        resolve_settings(**kwargs)


def test_register_preset_validates_and_adds():
    register_preset("gigpo_no_std", step_partition="hash", step_baseline="mean", advantage_norm="mean")
    try:
        assert resolve_settings("gigpo_no_std").advantage_norm == "mean"
        with pytest.raises(ValueError, match="unknown fields"):
            register_preset("broken", step_partition="hash", colour="red")
    finally:
        PRESETS.pop("gigpo_no_std")


def clustered_batch(num_groups=4, rollouts=4, length=6, dim=16, noise=0.05, seed=0):
    """Hidden states = one of a few state directions per (group, t) + noise."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(num_groups, length, dim, generator=gen)
    rows = []
    for g in range(num_groups):
        for r in range(rollouts):
            success = float(r % 2)
            for t in range(length):
                rows.append((g, g * rollouts + r, t, success if t == length - 1 else 0.0, f"k{(r + t) % 2}"))
    group, traj, t, reward, key = (list(c) for c in zip(*rows))
    hidden = torch.stack([states[g, s] for g, s in zip(group, t)]) + noise * torch.randn(len(rows), dim, generator=gen)
    return StepBatch(group=group, traj=traj, t=t, reward=reward, action_key=key, hidden=hidden)


def test_auto_eps_reaches_target_and_is_smallest():
    batch = clustered_batch()
    layout = BatchLayout.from_batch(batch)
    eps = calibrate_eps(batch.hidden, layout, target_singleton_rate=0.2, max_eps=0.5)
    assert 0.0 < eps < 0.5
    assert hidden_partition(batch.hidden, layout, eps).singleton_rate() <= 0.2
    assert hidden_partition(batch.hidden, layout, eps * 0.9).singleton_rate() > 0.2


def test_auto_eps_is_capped():
    batch = clustered_batch(noise=10.0)  # noise drowns the states: nothing clusters
    eps = calibrate_eps(batch.hidden, BatchLayout.from_batch(batch), 0.0, max_eps=0.05)
    assert eps == 0.05


def test_estimator_calibrates_once_then_holds_eps_and_restores_it():
    estimator = StepAdvantageEstimator(resolve_settings("bipace_q", target_singleton_rate=0.2))
    _, first = estimator(clustered_batch(seed=0))
    calibrated = estimator.cluster_eps
    assert first["estimator/cluster_eps"] == calibrated and first["time/calibration_s"] > 0
    _, second = estimator(clustered_batch(seed=1, noise=0.3))
    assert second["estimator/cluster_eps"] == calibrated and second["time/calibration_s"] == 0.0

    restored = StepAdvantageEstimator(resolve_settings("bipace_q"))
    restored.load_state_dict(estimator.state_dict())
    batch = clustered_batch(seed=2)
    torch.testing.assert_close(restored(batch)[0], estimator(batch)[0])


def test_estimator_recalibrates_every_k_calls():
    estimator = StepAdvantageEstimator(resolve_settings("bipace_q", recalibrate_eps_every=2))
    estimator(clustered_batch(noise=0.05))
    low_noise = estimator.cluster_eps
    estimator(clustered_batch(noise=0.5))
    assert estimator.cluster_eps == low_noise  # call 2: held
    estimator(clustered_batch(noise=0.5))
    assert estimator.cluster_eps > low_noise  # call 3: re-calibrated on noisier states


def test_diagnostics_cover_spec_section_5():
    _, diag = compute_advantages(clustered_batch(), resolve_settings("bipace_q", cluster_eps=0.1))
    for key in [
        "estimator/singleton_rate", "estimator/num_cells", "estimator/cell_size_mean", "estimator/cell_size_p90",
        "estimator/cluster_eps", "estimator/branch_pace_frac", "estimator/branch_loo_frac",
        "estimator/branch_singleton_frac", "estimator/action_keys_per_cell", "advantage/mean", "advantage/std",
        "advantage/iqr", "time/estimator_s",
    ]:
        assert key in diag, key
    fractions = [diag[f"estimator/branch_{b}_frac"] for b in ("pace", "loo", "singleton")]
    assert sum(fractions) == pytest.approx(1.0)
    assert diag["estimator/singleton_rate"] == pytest.approx(diag["estimator/branch_singleton_frac"])


def test_empty_batch_gives_empty_advantages():
    empty = StepBatch(group=[], traj=[], t=[], reward=[], anchor=[], action_key=[], hidden=torch.zeros(0, 4))
    for name in PRESETS:
        advantages, diag = compute_advantages(empty, resolve_settings(name, cluster_eps=0.1))
        assert advantages.shape == (0,)
        assert all(v == v for v in diag.values())  # no NaN


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(t=[0, 2]), "0..L-1"),
        (dict(t=[0, 0]), "same"),
        (dict(group=[0, 1]), "two task groups"),
        (dict(reward=[0.0, float("nan")]), "NaN"),
        (dict(reward=[0.0]), "reward"),
    ],
)
def test_malformed_batches_are_rejected_with_the_field(fields, match):
    base = dict(group=[0, 0], traj=[5, 5], t=[0, 1], reward=[0.0, 1.0])
    with pytest.raises(ValueError, match=match):
        BatchLayout.from_batch(StepBatch(**{**base, **fields}))
