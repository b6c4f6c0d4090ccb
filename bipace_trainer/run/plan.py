"""The run plan: what a trainer derives from its config once, and never writes back into it.

    plan = derive_plan(args, one_step=plain_prompts, model=unwrapped_model, use_vllm=trainer.use_vllm)
    plan.rollout, plan.env      # the values the rollout is built from (`rollout_settings`, `env_spec`)

A `BiPACEConfig` is the caller's value: two trainers built from one config are independent, and the
config is the same after them as before (tests/run/test_plan.py). What depends on the model or on the
kind of data (a plain prompt dataset's one-step episodes, the hidden-state layer the model has) is
decided here, frozen. So is what the rollout reads (`RolloutSettings`, `EnvSpec`): the collector is
built from those values, never from the config (`bipace-eval` builds them from its flags).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..advantages import EstimatorSettings
from ..rollout.hidden import HiddenPlan, clamp_layer
from ..rollout.loop import EnvSpec, RolloutSettings

__all__ = ["RunPlan", "derive_plan", "one_step_settings", "rollout_settings", "env_spec"]


@dataclass(frozen=True)
class RunPlan:
    """The estimator a run trains with, whether its episodes are one-step, and where its hidden states come from.

    Attributes:
        estimator: the config's estimator settings, or their episode term alone on one-step episodes.
        one_step: plain prompts with `reward_funcs`: GRPOTrainer's own advantage (`update.one_step`).
        hidden: the one `HiddenPlan`; its layer is `cluster_layer` resolved for the model where states are read.
        rollout: what the rollout reads (`rollout_settings`); env: which envs it plays (`env_spec`).
    """

    estimator: EstimatorSettings
    one_step: bool
    hidden: HiddenPlan
    rollout: RolloutSettings
    env: EnvSpec

    @property
    def cluster_layer(self) -> int:
        return self.hidden.layer


def one_step_settings(settings: EstimatorSettings) -> EstimatorSettings:
    """Plain prompts: the prompt is the only state, shared by the group, so the estimator is the episode
    term alone (GRPOTrainer's advantage, `update.one_step`, replaces it); a graph preset's step return,
    which needs cells, goes with the step term."""
    return dataclasses.replace(
        settings, step_partition="none", step_baseline=None, w_ep=1.0, w_step=0.0, context_levels=0,
        step_return="discounted", normalize_distance=False, similarity_merge=False,
    )


def derive_plan(args, one_step: bool, model: nn.Module, use_vllm: bool) -> RunPlan:
    """The plan of a run of `args` (a `BiPACEConfig`, read only) on `model` (unwrapped)."""
    estimator = one_step_settings(args.estimator) if one_step else args.estimator
    needs_hidden = "hidden" in estimator.rollout_needs or args.capture_hidden_states
    layer = clamp_layer(model, args.cluster_layer) if needs_hidden else args.cluster_layer
    hidden = HiddenPlan.choose(needs_hidden, args.hidden_capture, use_vllm, layer)
    return RunPlan(estimator, one_step, hidden, rollout_settings(args), env_spec(args))


def rollout_settings(args) -> RolloutSettings:
    """What the rollout reads of `args` (a `BiPACEConfig`), as values; the estimator's return terms are
    the config's (the dumps show the returns the preset defines, one-step episodes too)."""
    return RolloutSettings(
        max_turns=args.max_turns, history_length=args.history_length, rollout_batch_size=args.rollout_batch_size,
        require_think=args.require_think, action_key_tokens=args.action_key_tokens, mode=args.rollout_mode,
        eval_tasks=args.eval_tasks, eval_rollouts_per_task=args.eval_rollouts_per_task, tool_errors=args.tool_errors,
        disable_tqdm=bool(args.disable_tqdm), rollout_dump_steps=args.rollout_dump_steps, output_dir=str(args.output_dir),
        step_gamma=args.estimator.step_gamma, invalid_action_penalty=args.estimator.invalid_action_penalty,
        rollout_needs=args.estimator.rollout_needs,
    )


def env_spec(args) -> EnvSpec:
    """Which envs a run of `args` plays and how they are stepped."""
    return EnvSpec(
        name=args.env_name or "", kwargs=dict(args.env_kwargs or {}), train_split=args.train_split,
        eval_split=args.eval_split, backend=args.env_backend, workers=args.env_workers, step_timeout=args.env_step_timeout,
    )
