"""Partitions are a registry (`PARTITIONS`), as baselines are: a new one is a few lines,
each entry says what it reads from the rollout, and a name that is none fails at once."""

from __future__ import annotations

import pytest
import torch

from bipace_trainer.advantages import (
    PARTITIONS,
    Partition,
    PartitionKind,
    StepAdvantageEstimator,
    StepBatch,
    compute_advantages,
    register_partition,
    resolve_partition,
    resolve_settings,
)

# Cells = the turn index: a stand-in for "steps at the same depth are comparable", imported by dotted path below.
BY_TURN = PartitionKind(build=lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.t))


@pytest.fixture
def registered():
    """Names registered in a test are removed after it (the registry is global)."""
    added = []
    yield added
    for name in added:
        PARTITIONS.pop(name, None)


def batch() -> StepBatch:
    return StepBatch(
        group=[0] * 6, traj=[0, 0, 0, 1, 1, 1], t=[0, 1, 2] * 2, reward=[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        anchor=["a", "b", "c", "d", "e", "f"], action_key=["x", "y", "z", "x", "z", "y"],
        hidden=torch.eye(6),
    )  # fmt: skip


def test_built_in_partitions_state_what_they_read():
    assert not PARTITIONS["none"].has_cells and not PARTITIONS["none"].needs
    assert PARTITIONS["hash"].needs == {"anchor"} and not PARTITIONS["hash"].takes_eps
    assert PARTITIONS["hidden"].needs == {"hidden"} and PARTITIONS["hidden"].takes_eps
    assert resolve_settings("bipace_q").rollout_needs == {"hidden"}
    assert resolve_settings("gigpo").rollout_needs == {"anchor"}
    assert resolve_settings("grpo").rollout_needs == frozenset()
    assert resolve_settings("bipace_q", w_step=0.0).rollout_needs == frozenset()  # no step term: nothing to capture


def test_a_registered_partition_is_used_by_name(registered):
    register_partition("by_turn", lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.t))
    registered.append("by_turn")
    settings = resolve_settings("gigpo", step_partition="by_turn", advantage_norm="mean", w_ep=0.0)
    assert settings.rollout_needs == frozenset()
    advantage, diagnostics = compute_advantages(batch(), settings)
    # cells {t=0}, {t=1}, {t=2}; returns (γ = 0.95): [0.9025, 0.95, 1 | 0, 0, 0] → ± half of each
    expected = torch.tensor([0.9025, 0.95, 1.0, -0.9025, -0.95, -1.0]) / 2
    torch.testing.assert_close(advantage, expected)
    assert diagnostics["estimator/num_cells"] == 3 and "estimator/cluster_eps" not in diagnostics


def test_a_partition_by_dotted_path():
    settings = resolve_settings("gigpo", step_partition="tests.advantages.test_partition_registry:BY_TURN")
    assert settings.partition_kind is BY_TURN
    assert compute_advantages(batch(), settings)[1]["estimator/num_cells"] == 3


def test_a_partition_that_takes_eps_is_calibrated_by_the_estimator(registered):
    """ε "auto" works for any partition that takes ε: the estimator bisects on its singleton rate."""
    seen = []

    def by_reward(batch, layout, eps):  # one cell per group once eps >= 0.5, else one per step
        seen.append(eps)
        label = torch.zeros(len(batch), dtype=torch.long) if eps >= 0.5 else torch.arange(len(batch))
        return Partition.from_labels(layout.group_index, label)

    register_partition("coarse", by_reward, takes_eps=True)
    registered.append("coarse")
    estimator = StepAdvantageEstimator(resolve_settings("gigpo", step_partition="coarse", max_cluster_eps=1.0))
    assert estimator.eps_in_use == 1.0  # before calibration: the fallback, max_cluster_eps
    _, diagnostics = estimator(batch())
    assert 0.5 <= estimator.cluster_eps < 0.51 and diagnostics["estimator/cluster_eps"] == estimator.cluster_eps
    assert estimator.eps_in_use == estimator.cluster_eps and len(seen) > 2


def test_eps_in_use_is_none_without_eps():
    assert StepAdvantageEstimator(resolve_settings("gigpo")).eps_in_use is None
    assert StepAdvantageEstimator(resolve_settings("bipace_q", cluster_eps="0.10")).eps_in_use == 0.1


def test_a_missing_field_names_the_partition_and_the_field(registered):
    register_partition("by_key", lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.action_key),
                       needs=("action_key",))  # fmt: skip
    registered.append("by_key")
    no_keys = StepBatch(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"partition='by_key' needs StepBatch.action_key"):
        compute_advantages(no_keys, resolve_settings("gigpo", step_partition="by_key"))


@pytest.mark.parametrize(
    "name,match",
    [
        ("hashed", r"partition='hashed' is not a registered partition.*register_partition"),
        ("tests.advantages.test_partition_registry:NOPE", "could not import 'NOPE'"),
        ("tests.advantages.test_partition_registry:batch", "not a bipace_trainer.advantages.PartitionKind"),
    ],
)
def test_unknown_partitions_fail_when_the_settings_are_made(name, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings("gigpo", step_partition=name)
    with pytest.raises(ValueError, match=match):
        resolve_partition(name)


def test_register_partition_checks_the_fields_it_needs():
    with pytest.raises(ValueError, match="needs=\\['hiden'\\] are not StepBatch fields"):
        register_partition("typo", lambda batch, layout, eps: None, needs=("hiden",))
    assert "typo" not in PARTITIONS
