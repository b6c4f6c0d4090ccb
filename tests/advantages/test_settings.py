"""`EstimatorSettings` checks the values it declares: every `float` setting refuses what is not a
finite number (NaN or infinity would pass a check such as `x < 0` and crash at step 1), naming the
field, whether the value comes from a preset, a registration or a config."""

from __future__ import annotations

import math
import typing

import pytest

from bipace_trainer.advantages import EstimatorSettings, SettingsError, register_preset, resolve_settings

FLOAT_SETTINGS = [name for name, kind in typing.get_type_hints(EstimatorSettings).items() if kind is float]


def test_the_float_settings_are_the_weights_discounts_and_thresholds():
    assert {"w_ep", "w_step", "step_gamma", "invalid_action_penalty", "pace_evidence"} <= set(FLOAT_SETTINGS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True])
@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_every_float_setting_refuses_what_is_not_a_finite_number(name, value):
    with pytest.raises(SettingsError, match=rf"^{name}=") as error:
        EstimatorSettings(**{name: value})
    assert error.value.field == name


def test_a_preset_with_a_weight_that_is_not_finite_is_refused_when_registered():
    with pytest.raises(SettingsError, match=r"^w_ep=nan must be a finite number"):
        register_preset("broken", step_partition="hash", step_baseline="mean", w_ep=math.nan)
    with pytest.raises(SettingsError, match="preset='broken' is unknown"):
        resolve_settings("broken")
