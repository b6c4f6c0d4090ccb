"""Each estimator setting is declared once (`EstimatorSettings`: name, type, default, help) and
`BiPACEConfig` inherits it as the field of the same name (`EstimatorOverrides`, None = the preset's):
a preset's value holds unless a recipe or flag sets the field, and a bad value names the config
field and the fix."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from bipace_trainer import BiPACEConfig
from bipace_trainer.advantages import (
    ESTIMATOR_FIELDS,
    PARTITIONS,
    PRESETS,
    EstimatorSettings,
    Partition,
    register_partition,
    register_preset,
    resolve_settings,
)
from bipace_trainer.config import FIELD_GROUPS

BASE = dict(output_dir="unused", use_cpu=True, env_name="tiny")

# A value for each setting that differs from every built-in preset's, with the config field that sets it.
NOT_A_DEFAULT = {
    "step_gamma": ("step_gamma", 0.9),
    "invalid_action_penalty": ("invalid_action_penalty", 0.25),
    "cluster_eps": ("cluster_eps", 0.1),
    "target_singleton_rate": ("target_singleton_rate", 0.35),
    "max_cluster_eps": ("max_cluster_eps", 0.5),
    "recalibrate_eps_every": ("recalibrate_eps_every", 4),
    "bootstrap_truncated": ("bootstrap_truncated", True),
    "gae_lambda": ("gae_lambda", 0.7),
    "w_step": ("w_step", 0.8),
    "advantage_norm": ("advantage_norm", "mean"),
}


def test_every_estimator_setting_is_the_config_field_of_the_same_name_type_and_help():
    settings = dataclasses.fields(EstimatorSettings)
    assert ESTIMATOR_FIELDS == tuple(setting.name for setting in settings)
    config_fields = {f.name: f for f in dataclasses.fields(BiPACEConfig)}
    # annotations, not `Field.type`: building a parser rewrites `Field.type` in place (HfArgumentParser)
    setting_types, config_types = typing.get_type_hints(EstimatorSettings), typing.get_type_hints(BiPACEConfig)
    for setting in settings:
        assert config_fields[setting.name].metadata["help"] == setting.metadata["help"], setting.name
        assert config_types[setting.name] == setting_types[setting.name] | None, setting.name


def test_every_field_the_config_adds_to_grpo_config_has_one_heading_in_train_py_help():
    from trl import GRPOConfig

    added = {f.name for f in dataclasses.fields(BiPACEConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    grouped = [name for names in FIELD_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(added | {"importance_sampling_level"})  # GRPOConfig's, its default now the preset's


def test_every_estimator_field_defaults_to_the_presets_value():
    defaults = {f.name: f.default for f in dataclasses.fields(BiPACEConfig)}
    assert {name: defaults[name] for name in ESTIMATOR_FIELDS} == dict.fromkeys(ESTIMATOR_FIELDS)
    for preset in PRESETS:
        config = BiPACEConfig(**BASE, preset=preset)
        assert config.estimator == resolve_settings(preset)


@pytest.mark.parametrize("config_field", sorted(NOT_A_DEFAULT))
def test_a_registered_presets_value_is_honoured_through_the_config(config_field):
    setting, value = NOT_A_DEFAULT[config_field]
    register_preset("custom", step_partition="hidden", step_baseline="gae", **{setting: value})
    try:
        assert getattr(BiPACEConfig(**BASE, preset="custom").estimator, setting) == value
        # and a field set in the config (a recipe, a flag) still goes on top of the preset
        other = {"cluster_eps": "auto", "bootstrap_truncated": False, "advantage_norm": "mean_std",
                 "recalibrate_eps_every": 0}.get(config_field, 0.6)  # fmt: skip
        overridden = BiPACEConfig(**BASE, preset="custom", **{config_field: other}).estimator
        assert getattr(overridden, setting) == other
    finally:
        PRESETS.pop("custom")


def test_cluster_eps_is_parsed_once_by_the_estimator_settings():
    config = BiPACEConfig(**BASE, cluster_eps="0.10")
    assert config.cluster_eps == "0.10"  # what the recipe says, as written
    assert config.estimator.cluster_eps == 0.1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(step_partition="hashed"), r"step_partition: partition='hashed' is not a registered partition"),
        (dict(recalibrate_eps_every=-1), r"^recalibrate_eps_every=-1 must be >= 0"),
        (dict(max_cluster_eps=3.0), r"max_cluster_eps=3.0 must lie in \(0, 2\]"),
        (dict(gae_lambda=2.0), r"^gae_lambda=2.0 must lie in \[0, 1\]"),
        (dict(step_baseline="median"), r"^step_baseline='median' is not one of"),
    ],
)
def test_bad_estimator_fields_name_the_config_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        BiPACEConfig(**BASE, **overrides)


def test_a_registered_partition_is_a_valid_step_partition():
    register_partition("by_turn", lambda batch, layout, eps: Partition.from_labels(layout.group_index, batch.t))
    try:
        config = BiPACEConfig(**BASE, preset="gigpo", step_partition="by_turn")
        assert config.estimator.step_partition == "by_turn" and config.estimator.rollout_needs == frozenset()
    finally:
        PARTITIONS.pop("by_turn")
