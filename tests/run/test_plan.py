"""The run plan (`bipace_trainer.run.plan`): a trainer derives what depends on its model and data once,
and writes nothing into the caller's config, so two trainers built from one config are independent."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from datasets import Dataset

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.config import FIELD_GROUPS
from bipace_trainer.advantages import EstimatorSettings
from bipace_trainer.rollout.loop import EnvSpec, RolloutSettings
from bipace_trainer.run.plan import derive_plan, env_spec, one_step_settings, rollout_settings
from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args


@pytest.fixture(scope="module")
def tiny_policy():
    tokenizer = make_tokenizer()
    return make_model(tokenizer), tokenizer


def ours(args: BiPACEConfig) -> dict:
    """The fields BiPACEConfig adds to GRPOConfig, and its resolved estimator."""
    values = {name: getattr(args, name) for names in FIELD_GROUPS.values() for name in names}
    return copy.deepcopy({**values, "estimator": args.estimator})


def test_two_trainers_built_from_one_config_are_independent_and_the_config_is_unchanged(tiny_policy, tmp_path):
    model, tokenizer = tiny_policy
    # the hidden partition resolves cluster_layer=-8 (the default) for the tiny model's 2 layers: -2
    args = tiny_args(tmp_path, preset="bipace_q", cluster_layer=-8, evaluate_before_training=False)
    before = ours(args)
    first = BiPACETrainer(model=model, args=args, processing_class=tokenizer)
    second = BiPACETrainer(model=model, args=args, processing_class=tokenizer)
    try:
        assert ours(args) == before
        assert first.plan == second.plan and first.plan is not second.plan
        assert first.plan.hidden.source == "prefill" and first.plan.cluster_layer == -2
        assert first.collector is not second.collector and first.estimator is not second.estimator
        # the rollout is built from the plan's values (`RolloutSettings`, `EnvSpec`), the env's prompt filled in
        settings = first.collector.settings
        assert dataclasses.replace(settings, instruction="", invalid_action="look") == first.plan.rollout
        assert first.collector.source.env == first.plan.env == env_spec(args)
        with pytest.raises(AttributeError):  # frozen: a plan is derived, never edited
            first.plan.one_step = True
    finally:
        first.close_envs()
        second.close_envs()


def test_plain_prompts_train_the_episode_term_without_changing_the_callers_estimator(tiny_policy, tmp_path):
    model, tokenizer = tiny_policy
    args = BiPACEConfig(output_dir=str(tmp_path), preset="bipace_q", num_generations=2, per_device_train_batch_size=2,
                        tasks_per_iteration=1, max_completion_length=4, use_cpu=True, bf16=False, report_to="none")
    estimator = args.estimator
    trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                            train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
    try:
        assert args.estimator is estimator and args.estimator.step_partition == "hidden"
        assert trainer.plan.one_step and trainer.plan.estimator == one_step_settings(estimator)
        assert trainer.plan.hidden.source == "none" and trainer.estimator.settings == trainer.plan.estimator
    finally:
        trainer.close_envs()


def test_the_plan_reads_the_config_and_the_model_only(tiny_policy, tmp_path):
    model, _ = tiny_policy
    args = tiny_args(tmp_path, preset="gigpo", capture_hidden_states=True, cluster_layer=-8)
    plan = derive_plan(args, one_step=False, model=model, use_vllm=True)
    assert (plan.hidden.source, plan.cluster_layer, args.cluster_layer) == ("old_logprobs", -2, -8)
    assert derive_plan(args, one_step=False, model=model, use_vllm=False).hidden.source == "prefill"
    assert derive_plan(tiny_args(tmp_path, preset="gigpo"), one_step=False, model=model, use_vllm=False).hidden.source == "none"


# RolloutSettings / EnvSpec field -> the config field it is read from (`run.plan.rollout_settings`, `env_spec`)
ROLLOUT_FIELDS = {
    "max_turns": "max_turns", "history_length": "history_length", "rollout_batch_size": "rollout_batch_size",
    "require_think": "require_think", "action_key_tokens": "action_key_tokens", "mode": "rollout_mode",
    "eval_tasks": "eval_tasks", "eval_rollouts_per_task": "eval_rollouts_per_task", "tool_errors": "tool_errors",
    "rollout_dump_steps": "rollout_dump_steps",
}  # fmt: skip
ENV_FIELDS = {"train_split": "train_split", "eval_split": "eval_split", "backend": "env_backend", "workers": "env_workers",
              "step_timeout": "env_step_timeout"}  # fmt: skip


def _values(value, fields) -> dict:
    return {ours: getattr(value, ours) for ours in fields}


def test_the_rollout_values_are_read_from_the_config_and_default_as_it_does(tmp_path):
    # bipace-eval leaves what it has no flag for at these defaults: they must be the config's
    config_defaults = {f.name: f.default for f in dataclasses.fields(BiPACEConfig)}
    for value, fields in ((RolloutSettings(), ROLLOUT_FIELDS), (EnvSpec(), ENV_FIELDS)):
        assert _values(value, fields) == {ours: config_defaults[theirs] for ours, theirs in fields.items()}
    estimator, settings = EstimatorSettings(), RolloutSettings()
    assert (settings.step_gamma, settings.invalid_action_penalty) == (estimator.step_gamma, estimator.invalid_action_penalty)
    args = tiny_args(tmp_path, preset="gigpo", max_turns=4, history_length=3, rollout_mode="continuous", eval_tasks=5,
                     rollout_dump_steps=2, env_step_timeout=9.0, env_kwargs={"size": 4})  # fmt: skip
    settings, env = rollout_settings(args), env_spec(args)
    assert _values(settings, ROLLOUT_FIELDS) == {ours: getattr(args, theirs) for ours, theirs in ROLLOUT_FIELDS.items()}
    assert _values(env, ENV_FIELDS) == {ours: getattr(args, theirs) for ours, theirs in ENV_FIELDS.items()}
    assert (env.name, env.kwargs, settings.output_dir) == (args.env_name, args.env_kwargs, args.output_dir)
    assert (settings.step_gamma, settings.rollout_needs) == (args.estimator.step_gamma, args.estimator.rollout_needs)
