"""`BiPACEConfig`: TRL's `GRPOConfig` plus the step-level estimator and the multi-turn rollout."""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from envs.base import MILESTONE_KINDS, EnvUnavailableError, resolve_env_class
from envs.surface import split_surface_kwargs
from envs.vector import BACKENDS

from .advantages import (
    ESTIMATOR_FIELDS,
    PARTITIONS,
    PRESETS,
    EstimatorOverrides,
    EstimatorSettings,
    SettingsError,
    resolve_settings,
)
from .rollout.loop import ROLLOUT_MODES
from .update.one_step import AGGREGATIONS

__all__ = ["BiPACEConfig", "FIELD_GROUPS", "SCALE_REWARDS_NORM", "batch_shape_fix"]

_BIPACE = "https://arxiv.org/abs/2606.25556"
DEFAULT_ENV = "textcraft"

# What each built-in preset is, for `--help` (the README's "Estimators" table has the rest).
_PRESET_HELP = ", ".join(
    f"{name} ({values['step_partition'] if PARTITIONS[values['step_partition']].has_cells else 'no'} partition"
    + (f", {values['step_baseline']} baseline)" if values.get("step_baseline") else ")")
    for name, values in PRESETS.items()
)

# The fields BiPACEConfig adds to GRPOConfig, by topic: train.py's --help lists them first, under these headings.
FIELD_GROUPS = {
    # the preset, its knobs in `EstimatorSettings`' order, then the hidden-state capture the partition reads
    "step-level advantage estimator": ("preset", *ESTIMATOR_FIELDS, "cluster_layer", "hidden_capture", "capture_hidden_states"),
    "multi-turn rollout and evaluation": (
        "env_name", "env_kwargs", "max_turns", "max_turn_length", "history_length", "tasks_per_iteration", "train_split", "eval_split",
        "train_tasks", "eval_tasks", "eval_rollouts_per_task", "eval_interval", "evaluate_before_training",
        "eval_temperature", "env_backend", "env_workers", "env_step_timeout", "rollout_batch_size", "rollout_mode",
        "max_staleness", "hf_prefix_cache", "hf_prefix_cache_store_mb", "shared_prefix", "require_think", "action_key_tokens",
        "resample_without_signal", "resample_max_seconds", "penalize_env_failures",
        "tool_errors",
    ),
    "what a run records": ("rollout_dump_steps",),
}

# TRL's `scale_rewards` as the estimator's `advantage_norm` (the episode term and the `mean` baseline,
# GRPO's and GiGPO's normalisation). "batch" (one std over the whole batch) has no step-level form:
# it is honoured on one-step episodes (plain prompts), refused on multi-turn ones (`trainer`).
SCALE_REWARDS_NORM = {"group": "mean_std", "none": "mean"}


# Float settings that NaN or infinity would turn into a crash at step 1, blamed on the env (the
# estimator's own: `EstimatorSettings` checks each it declares `float`).
_FINITE_FIELDS = ("eval_temperature", "env_step_timeout", "resample_max_seconds")


# Sizes (tokens, rows, passes) that must be >= 1 when set; None leaves TRL's default.
_SIZE_FIELDS = (
    "max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
    "generation_batch_size", "steps_per_generation",
)


def _is_size(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _is_finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def batch_shape_fix(tasks: int, generations: int, per_device: int, world: int) -> str:
    """The one flag that makes `tasks` × `generations` rows fill whole batches of `per_device` × `world`
    rows with whole task groups on every process: more tasks (a multiple of the processes) when the task
    groups do not split evenly across them (only that fixes both), else a smaller per-process batch, with
    more tasks as the alternative."""
    more = next((t for t in range(tasks, tasks + 64 * world) if t % world == 0 and t * generations % (per_device * world) == 0), None)
    fewer = next((b for b in range(per_device, 0, -1) if tasks * generations % (b * world) == 0), None)
    options = [f"--tasks_per_iteration {more}" if more else None]
    if tasks % world == 0:  # the groups split evenly already: keep the run's size, cut its batches
        options.insert(0, f"--per_device_train_batch_size {fewer}" if fewer else None)
    options = [option for option in options if option]
    if not options:
        return f"pick per_device_train_batch_size ({per_device}) × processes ({world}) so that it divides that product."
    return f"pass {options[0]}" + (f" (or {options[1]})" if len(options) > 1 else "") + "."


@dataclass
class BiPACEConfig(EstimatorOverrides, GRPOConfig):
    r"""
    Configuration for [`BiPACETrainer`]: every field of TRL's `GRPOConfig`, plus:

    > Parameters that control the step-level advantage estimator (docs/concepts/math.md)

    preset (`str`, defaults to `"bipace_q"`): named estimator, one of `grpo`, `gigpo`,
        `bigpo`, `bipace_q`, `bipace_diff`, `gagpo`, `bigagpo`, `hgpo`, `bihgpo`, `bihpace_q`, `graphgpo`,
        `bigraphgpo`, `beacon` (or one added with `bipace_trainer.advantages.register_preset`).
    step_partition … pace_variance_gate (`ESTIMATOR_FIELDS`): the estimator's own knobs, inherited from
        `EstimatorOverrides`: each is the `EstimatorSettings` field of the same name, documented there
        (`bipace_trainer/advantages/settings.py`, with its help), and defaults to `None` here, which
        takes the preset's value, so a preset, built in or registered, holds unless a recipe or a flag
        sets the field. `importance_sampling_level` is also GRPOConfig's: None takes the preset's.
    cluster_layer (`int`, -8): hidden-state layer of the `hidden` partition, indexed like
        `output_hidden_states` (0 = embeddings, -1 = last layer after the final norm).
    hidden_capture (`str`, `"hook"`): `hook` records the hidden state during a forward pass
        that runs anyway (generation's prefill; under vLLM, the old-logprob pass over the
        batch); `forward` runs one extra no-grad forward pass over the prompts.
    capture_hidden_states (`bool`, False): capture each step's hidden state even when the estimator's
        partition does not read it (a study that records both partitions on every preset); the run's
        `HiddenPlan` is chosen once, from this and the partition.

    > Parameters that control the multi-turn rollout

    env_name (`str`, `"textcraft"`; flag `--env`): registered env name or `package.module:Class`.
        Left unset it is `"textcraft"`, checked only when a trainer plays it: a `BiPACETrainer`
        given TRL's `environment_factory` or `tools` plays those instead (`tool_envs`).
    env_kwargs (`dict` or JSON `str`): keyword arguments of the env constructor; two keys are the
        wrapper's instead: `surface_variation` (0-1) renders the text with controlled variation
        that leaves the state alone, seeded by `surface_seed` (`envs.surface.SurfaceVariation`).
    max_turns (`int`, 15): turn budget per episode; a trajectory that hits it is truncated.
    max_turn_length (`int` or `None`): the most tokens one reply (one turn) may have; None:
        `max_completion_length`. TRL's `max_completion_length` keeps TRL's meaning for TRL's envs
        (`environment_factory`/`tools`): the whole completion of an episode, every reply and tool
        result after the first prompt, as GRPOTrainer caps it. Our envs (`env_name`) rebuild the
        prompt every turn, so no completion grows across turns: there `max_completion_length`
        caps each reply, as it always has (the recipes' 512), unless `max_turn_length` is lower.
    history_length (`int`, 2): observation/action pairs of history in each prompt.
    tasks_per_iteration (`int` or `None`): task groups per generation, over all processes; each is
        rolled out `num_generations` times (G). Set, it sets `generation_batch_size` = tasks × G;
        left at None, the schedule is TRL's own (`generation_batch_size`, `steps_per_generation`,
        `per_device_train_batch_size` as `GRPOConfig` reads them) and this field is derived from it:
        `generation_batch_size / num_generations`. So a `GRPOConfig`'s arguments give the same
        generations, episodes per generation and optimizer steps under `BiPACEConfig`.
    train_split, eval_split (`str`): the env's task splits for training and evaluation.
    train_tasks (`int`, 0): train on this many tasks of `train_split`, dealt in turn over the
        env's task types (`envs.base.stratified_subset`; 0: all); fewer tasks are each drawn
        more often in the same number of steps.
    eval_tasks (`int`, 32): evaluate on this many tasks of `eval_split`, stratified the same way (0: all).
    eval_rollouts_per_task (`int`, 1): evaluation rollouts of each task (more: less noise).
    eval_interval (`int`, 0): evaluate every this-many optimizer steps (0: only before and after).
    evaluate_before_training (`bool`, True): evaluate once before the first step.
    eval_temperature (`float`, 0.4): sampling temperature of evaluation rollouts.
    env_backend (`str`, `"serial"`): `serial`, `thread` or `process` stepping of the env batch, or the
        name of a backend registered with `envs.vector.register_backend`.
    env_workers (`int` or `None`), env_step_timeout (`float`, 60): pool size and per-step timeout.
    rollout_batch_size (`int`, 0): most prompts per generate call (0: all active envs at once).
    rollout_mode (`str`, `"lockstep"`): how episodes advance. `lockstep`: every turn generates for
        all active envs, then steps them all. `continuous`: each episode advances on its own; a
        call takes the first `rollout_batch_size` ready episodes (0: all ready) in (turn, env)
        order, and their envs step on a worker thread while the next call generates. Same
        records, advantages, dumps and resume as lockstep, deterministic under a seed; it
        overlaps envs with generation only when `rollout_batch_size` is below the episodes
        playing. Per rank under DDP with HF `generate`; under vLLM every rank makes the same
        number of calls (TRL gathers prompts across ranks), and a call still waits for its
        longest reply (TRL's `_generate_single_turn` is synchronous: vLLM batches continuously
        inside a call, not across calls). ZeRO-3 and FSDP refuse it (every rank must run each
        forward together): use `lockstep` there. See docs/rollout_modes.md.
    max_staleness (`int`, 0): 1 plays the next generation's episodes on a background thread while
        the current update runs, with a frozen copy of the weights (a LoRA run copies its adapter
        only; a full fine-tune holds a second copy of the model), so those episodes come from the
        policy one generation old; TRL's importance-sampling ratio (`vllm_importance_sampling_mode`
        and its clip bounds) corrects them, by scaling their advantages, and is logged as
        `sampling/importance_sampling_ratio/*` with `rollout/staleness`. 0 (the default) plays every
        generation with the current weights. HF generation only (not vLLM), one process or DDP;
        refused under ZeRO-3/FSDP, with TRL's tool envs and with `loss_type='vespo'`. An epoch's
        first generation plays in the foreground (its rows are not known earlier). See
        docs/rollout_modes.md.
    hf_prefix_cache (`bool`, False): on the HF `generate` path, prefill only the prompt tokens whose KV
        is not known yet (`rollout.prefix_cache`): prefixes a call's prompts share (a task's G
        rollouts: the system text and task, at turn 0 the whole prompt) get one forward pass, and a
        prompt that extends a sequence generated earlier in the rollout (a tool env's growing chat)
        starts from its KV. Greedy completions equal TRL's path's; `rollout/prompt_tokens_encoded`
        and `..._reused` count what it saved. TRL's path is kept (with a warning) under vLLM,
        `use_transformers_continuous_batching`, a `cache_implementation`, `pad_to_multiple_of`,
        ZeRO-3/FSDP, multimodal models, and models whose cache is not a plain `DynamicCache`.
    hf_prefix_cache_store_mb (`int`, 256): bound in MB of the KV `hf_prefix_cache` keeps across the
        calls of one rollout (least recently used first; cleared when the rollout ends); 0 keeps
        none (sharing within a call only).
    shared_prefix (`bool`, True): the update's forward passes (and the old and reference log-prob
        passes) compute a token prefix that rows share once (`update/shared_prefix.py`): a task group's
        common prompt, and an episode whose turns each extend the one before as one sequence. The
        same log-probs, entropies, loss, gradients and logged metrics as TRL's row-by-row forward under
        every loss setting, checked against it on the first packed forward; rows are packed only where
        a cost model says that forwards fewer FLOPs within the plain path's peak memory. Off (logged
        once) under flash attention, sliding-window layers, ZeRO-3 and FSDP, for a model that trains
        with dropout (LoRA's `lora_dropout` included: one mask per shared prefix is not one per row;
        `disable_dropout=True` keeps it on), and for the update's forward under
        `top_entropy_quantile` < 1 (its threshold ties break on float rounding). See
        docs/performance.md.
    resample_without_signal (`int`, 0): dynamic sampling (DAPO's, per generation): a generation in
        which every advantage is 0 on every rank (all rollouts of every group won, or all lost)
        is played again on tasks drawn afresh from the training set, up to this many times,
        before its update is skipped. Each retry costs a rollout; `train/resamples` counts them
        and `episode/success_rate_all_played` counts every episode played (the kept batch is
        selected for signal, so its own success rate is biased). Each attempt is logged as it
        happens, and a SIGTERM ends the resampling after the attempt in flight.
    resample_max_seconds (`float`, 0): stop resampling one generation once this many seconds
        have passed since its first redraw (0: bounded by `resample_without_signal` alone;
        a time bound makes runs depend on the machine's speed).
    penalize_env_failures (`bool`, False): an episode the env failed (it raised, hung past
        `env_step_timeout`, returned garbage, its server was lost) is not the policy's failure, so by
        default its steps leave the batch: out of the loss and out of their group's statistics (a
        sibling's win does not push them down); `train/masked_failed_episodes` counts them. True
        trains them as played, with reward 0 (the behaviour before this option).
    tool_errors (`str`, `"observe"`): with TRL's envs, a tool that raises, a call to a tool the env
        lacks, or arguments the tool does not take: `observe` returns `{'error': ...}` to the model
        as the tool's result and lets the episode go on (TRL's behaviour; counted in
        `tools/failure_frequency`); `fail` ends the episode as an env failure instead.
    require_think (`bool`, False): a reply without `<think>…</think>` counts as invalid.
    action_key_tokens (`int`, 0): key actions on their first k completion tokens instead of
        the normalised action text (0).

    > Parameters that control what a run records (docs/RECIPES.md, "Reading a run")

    rollout_dump_steps (`int`, 0): every this-many optimizer steps, write that step's
        episodes to `<output_dir>/rollouts/step-000010.jsonl` (one line per episode, turns in
        order), and every evaluation's to `rollouts/eval-<tag>-step-….jsonl`; 0: never.
        Read them with `python -m bipace_trainer.reports.show`. TRL's `log_completions` fills its
        completions table with one row per env step.
    """

    # Estimator: `preset` and the settings of the hidden capture; the estimator's knobs are
    # `EstimatorOverrides`' (advantages/settings.py), inherited.
    preset: str = field(
        default="bipace_q",
        metadata={"help": f"Named estimator preset: {_PRESET_HELP}; or one added with register_preset. BiPACE: {_BIPACE}"},
    )
    cluster_layer: int = field(
        default=-8,
        metadata={"help": f"Hidden layer for BiGPO clustering, output_hidden_states index (paper: -8 of 28 for 7B). {_BIPACE}"},
    )
    hidden_capture: str = field(
        default="hook",
        metadata={
            "help": "hook (during a pass that runs anyway: prefill, or the old-logprob pass under vLLM) "
            "| forward (one extra no-grad pass)."
        },
    )
    capture_hidden_states: bool = field(
        default=False,
        metadata={"help": "Capture hidden states even if the partition ignores them (studies)."},
    )

    # Rollout
    env_name: str | None = field(
        default=None,
        metadata={
            "help": f"Registered env name or 'package.module:Class' (flag: --env); None: {DEFAULT_ENV!r}, "
            "checked only when used (a trainer given TRL's environment_factory or tools does not use it).",
            "aliases": ["--env"],
        },
    )
    env_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Env constructor kwargs: a dict, or a JSON string such as '{\"size\": 4}'; "
            "'surface_variation' (0-1) and 'surface_seed' wrap the env in envs.surface.SurfaceVariation."
        },
    )
    max_turns: int = field(default=15, metadata={"help": "Turn budget per episode (ALFWorld papers: 50)."})
    max_turn_length: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per reply (None: max_completion_length, which caps a TRL env's whole episode)."
        },
    )
    history_length: int = field(default=2, metadata={"help": "Observation/action pairs of history in each prompt."})
    tasks_per_iteration: int | None = field(
        default=None,
        metadata={
            "help": "Task groups per generation over all processes (papers: 16); sets generation_batch_size = "
            "tasks × num_generations. None: TRL's schedule, generation_batch_size / num_generations."
        },
    )
    train_split: str = field(default="train", metadata={"help": "Env task split used for training."})
    eval_split: str = field(default="valid", metadata={"help": "Env task split used for evaluation."})
    train_tasks: int = field(
        default=0, metadata={"help": "Train on k tasks of train_split, stratified over task types (0: all)."}
    )
    eval_tasks: int = field(
        default=32, metadata={"help": "Number of evaluation tasks, stratified over task types (0: the whole split)."}
    )
    eval_rollouts_per_task: int = field(default=1, metadata={"help": "Evaluation rollouts of each task."})
    eval_interval: int = field(default=0, metadata={"help": "Evaluate every k optimizer steps (0: before/after only)."})
    evaluate_before_training: bool = field(default=True, metadata={"help": "Evaluate once before training."})
    eval_temperature: float = field(default=0.4, metadata={"help": "Sampling temperature of evaluation (papers: 0.4)."})
    env_backend: str = field(default="serial", metadata={"help": "serial | thread | process env stepping."})
    env_workers: int | None = field(default=None, metadata={"help": "Worker threads/processes for the env batch."})
    env_step_timeout: float = field(default=60.0, metadata={"help": "Seconds before a hanging env step fails."})
    rollout_batch_size: int = field(default=0, metadata={"help": "Most prompts per generate call (0: all)."})
    penalize_env_failures: bool = field(
        default=False,
        metadata={"help": "Train env-failed episodes with reward 0 (false: mask them out of the loss and group stats)."},
    )
    tool_errors: str = field(
        default="observe",
        metadata={"help": "observe (the tool's error is its result, as TRL) | fail (the episode ends as an env failure)."},
    )
    rollout_mode: str = field(
        default="lockstep", metadata={"help": "lockstep | continuous: episodes advance turn by turn together, or each on its own."}
    )
    max_staleness: int = field(
        default=0,
        metadata={"help": "1: play the next generation while the current update runs (a weight copy, IS-corrected); 0: off."},
    )
    hf_prefix_cache: bool = field(
        default=False,
        metadata={"help": "HF generate: prefill only prompt tokens whose KV is not known (shared prefixes, earlier turns)."},
    )
    hf_prefix_cache_store_mb: int = field(
        default=256, metadata={"help": "MB of KV hf_prefix_cache keeps across a rollout's calls (0: within a call only)."}
    )
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "Update: a prefix rows share forwarded once, exact (docs/performance.md); false: TRL's forward."
        },
    )
    require_think: bool = field(default=False, metadata={"help": "Require <think>…</think> for a valid reply."})
    action_key_tokens: int = field(default=0, metadata={"help": "Key actions on their first k tokens (0: text)."})
    resample_without_signal: int = field(
        default=0,
        metadata={"help": "Play a generation whose advantages are all 0 again on fresh tasks, up to k times (0: skip it)."},
    )
    resample_max_seconds: float = field(
        default=0.0,
        metadata={"help": "Stop resampling one generation after this many seconds (0: no time bound)."},
    )

    # What a run records
    rollout_dump_steps: int = field(
        default=0,
        metadata={"help": "Every k optimizer steps write the episodes to <output_dir>/rollouts/step-<k>.jsonl (0: never)."},
    )

    @classmethod
    def for_trainer(cls, model, args, rollout_func, reward_funcs, trl_envs: bool, train_dataset=None) -> "BiPACEConfig":
        """`BiPACETrainer`'s `args` (a default config named after the model when None, as GRPOTrainer does),
        with what the trainer cannot take refused: `rollout_func`, a config of another type, our envs
        (`env_name`) when unavailable, `reward_funcs` or `reward_weights` with our envs (which give their
        own rewards), plain prompts (`plain_prompts`) without a 'prompt' column, and TRL's reward settings
        that have no step-level form on multi-turn episodes."""
        if rollout_func is not None:
            raise ValueError(
                "rollout_func replaces TRL's generation with one sample per prompt; BiPACETrainer plays the multi-turn "
                "rollout itself (one sample per env step): pass environment_factory/tools, or env_name, instead."
            )
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "name_or_path", "") or "model"
            args = cls(f"{str(name).rstrip('/').split('/')[-1]}-BiPACE")
        if not isinstance(args, BiPACEConfig):
            raise TypeError(
                f"args must be a BiPACEConfig, got {type(args).__name__}: BiPACEConfig takes every GRPOConfig "
                "argument, so build it with the same arguments."
            )
        plain = args.plain_prompts(reward_funcs, trl_envs)
        if not trl_envs and not plain:
            args.require_env()
            if reward_funcs is not None:
                raise ValueError(
                    f"reward_funcs score TRL's environments or a prompt dataset; env_name={args.env_name!r} gives its "
                    "own rewards. Drop reward_funcs (or env_name, to train on the dataset's prompts)."
                )
            if args.reward_weights is not None:
                raise ValueError(
                    f"reward_weights weigh reward_funcs, and env_name={args.env_name!r} gives one reward of its own, "
                    "trained as it is; drop reward_weights (scale the reward inside the env if you must)."
                )
        if plain and (train_dataset is None or "prompt" not in getattr(train_dataset, "column_names", ["prompt"])):
            raise ValueError(
                "reward_funcs without environment_factory, tools or env_name train on train_dataset's prompts, as "
                "GRPOTrainer does: pass a train_dataset with a 'prompt' column."
            )
        args._check_multi_turn_reward_settings(one_step=plain)
        return args

    def plain_prompts(self, reward_funcs, trl_envs: bool) -> bool:
        """Whether a trainer gets GRPOTrainer's plain case: `reward_funcs` on a prompt dataset with no env,
        no tools and `env_name` unset, each prompt a one-step episode (`tool_envs.PromptAdapter`)."""
        return not trl_envs and reward_funcs is not None and not self.env_name_set

    def _check_multi_turn_reward_settings(self, one_step: bool) -> None:
        """TRL's reward settings that have no step-level form: honoured on one-step episodes (plain prompts,
        `update.one_step`), refused on multi-turn ones (`trl_compat.GRPO_FIELDS`)."""
        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise ValueError(f"multi_objective_aggregation={self.multi_objective_aggregation!r} must be one of {AGGREGATIONS}.")
        if one_step:
            return
        if self.scale_rewards == "batch":
            raise ValueError(
                "scale_rewards='batch' divides by one std over the whole batch, which the step-level estimators have no "
                "form of (they normalise within task groups and state cells); set scale_rewards='group' or 'none'."
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} normalises each reward function "
                "within its group before summing, but the step-level estimators credit one reward per episode (the "
                "weighted sum) to its steps; set multi_objective_aggregation='sum_then_normalize'."
            )

    def __post_init__(self):
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            # TRL's convention: `--resume_from_checkpoint true` resumes from the latest checkpoint in output_dir.
            self.resume_from_checkpoint = True if self.resume_from_checkpoint.lower() == "true" else None
        self._check_rollout_fields()
        self._env_error: Exception | None = None
        self.env_name_set = self.env_name is not None  # else the default, which TRL's envs and plain prompts do not use
        if self.env_name is not None:
            self._check_env()
        else:  # the default env: its errors wait until a trainer needs it (TRL's envs do not, `require_env`)
            self.env_name = DEFAULT_ENV
            try:
                self._check_env()
            except (ValueError, EnvUnavailableError) as err:
                self._env_error = err
        self._apply_scale_rewards()
        self.estimator = self._resolve_estimator()
        if self.env_name_set:  # TRL's envs are checked by the trainer, which gets them (`tool_envs.check_milestones`)
            self._check_milestones()
        if self.estimator.has_step_term and self.estimator.context_levels > self.history_length:
            # HGPO's levels exist to compare steps whose prompts agree; past the history the prompt
            # shows they split steps whose prompts are the same
            warnings.warn(
                f"context_levels={self.estimator.context_levels} exceeds history_length={self.history_length}: "
                "levels beyond the prompt's history split steps with identical prompts; HGPO sets them equal.",
                stacklevel=2,
            )
        if self.importance_sampling_level is None:
            self.importance_sampling_level = self.estimator.importance_sampling_level
        ours = self.tasks_per_iteration is not None  # else TRL's schedule, tasks derived from it below
        if ours and self.generation_batch_size is None and self.steps_per_generation is None:
            self.generation_batch_size = self.tasks_per_iteration * self.num_generations
        # bf16 resolves as GRPOConfig resolves it (True unless fp16, also with use_cpu): a TRL script
        # switched to this class keeps its precision. A CPU without use_cpu refuses it, as transformers
        # does (below, in words that name the fix); `train.py` chooses float32 on a CPU itself.
        try:
            super().__post_init__()
        except ValueError as err:
            if "bf16/gpu" in str(err):  # transformers' message names neither the field nor the fix
                raise ValueError(
                    "bf16=True (the recipes train in bf16) needs a CUDA GPU and none is visible (bf16 is GRPOConfig's "
                    "default unless fp16): run on a GPU, or on this CPU set bf16=False (--bf16 false: float32) or "
                    "use_cpu=True (--use_cpu true: bf16 on the CPU)."
                ) from None
            if "divisible" not in str(err) or not ours:
                raise
            raise ValueError(
                f"{err} Here generation_batch_size = tasks_per_iteration × num_generations = "
                f"{self.tasks_per_iteration} × {self.num_generations}: "
                + batch_shape_fix(self.tasks_per_iteration, self.num_generations, self.per_device_train_batch_size,
                                  self.world_size)
            ) from None
        self._check_task_groups(ours)

    def _check_task_groups(self, ours: bool) -> None:
        """`tasks_per_iteration` agrees with TRL's batch (derived from it when unset), and no task group
        is split across ranks."""
        if not ours:
            self.tasks_per_iteration = self.generation_batch_size // self.num_generations
        elif self.generation_batch_size != self.tasks_per_iteration * self.num_generations:
            raise ValueError(
                f"tasks_per_iteration={self.tasks_per_iteration} asks for generation_batch_size = tasks_per_iteration × "
                f"num_generations = {self.tasks_per_iteration * self.num_generations}, but generation_batch_size / "
                f"steps_per_generation give {self.generation_batch_size}; set tasks_per_iteration or TRL's batch "
                "arguments, not both."
            )
        world = self.world_size
        if self.tasks_per_iteration % world:
            what = "tasks_per_iteration" if ours else "generation_batch_size / num_generations (task groups per generation)"
            raise ValueError(
                f"{what} = {self.tasks_per_iteration} must be divisible by the number of processes ({world}) "
                "so that no task group is split across ranks; raise it to a multiple of the world size."
            )

    def _check_rollout_fields(self):
        if isinstance(self.env_kwargs, str):
            try:
                self.env_kwargs = json.loads(self.env_kwargs) if self.env_kwargs.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"env_kwargs={self.env_kwargs!r} is not valid JSON ({err}); e.g. '{{\"size\": 4}}'.") from None
        if self.env_kwargs is not None and not isinstance(self.env_kwargs, dict):
            raise ValueError(
                f"env_kwargs={self.env_kwargs!r} must be a JSON object of the env's keyword arguments, "
                "e.g. '{\"size\": 4}'."
            )
        self.env_kwargs = dict(self.env_kwargs or {})
        for name in _FINITE_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not _is_finite_number(value)):
                raise ValueError(f"{name}={value!r} must be a finite number.")
        checks = [
            (self.num_generations >= 2, "num_generations", "must be >= 2: group-relative estimators compare rollouts"),
            (self.max_turns >= 1, "max_turns", "must be >= 1"),
            # sizes TRL and transformers take as given: 0 fails after the weights load (max_completion_length)
            # or as a ZeroDivisionError inside GRPOConfig (per_device_train_batch_size)
            *((_is_size(getattr(self, name)), name, "must be >= 1") for name in _SIZE_FIELDS),
            (self.max_turn_length is None or 1 <= self.max_turn_length <= self.max_completion_length, "max_turn_length",
             f"must be >= 1 and at most max_completion_length ({self.max_completion_length}), which bounds every "
             "completion (or None: max_completion_length)"),
            (self.history_length >= 0, "history_length", "must be >= 0 (0 = no history)"),
            (self.tasks_per_iteration is None or self.tasks_per_iteration >= 1, "tasks_per_iteration",
             "must be >= 1 (or unset: TRL's schedule)"),
            (self.train_tasks >= 0, "train_tasks", "must be >= 0 (0 = the whole split)"),
            (self.eval_tasks >= 0, "eval_tasks", "must be >= 0 (0 = the whole split)"),
            (self.eval_rollouts_per_task >= 1, "eval_rollouts_per_task", "must be >= 1"),
            (self.eval_interval >= 0, "eval_interval", "must be >= 0 (0 = before/after training only)"),
            (self.eval_temperature >= 0, "eval_temperature", "must be >= 0"),
            (self.env_step_timeout > 0, "env_step_timeout", "must be > 0 seconds"),
            (self.env_step_timeout < self.ddp_timeout, "env_step_timeout",
             f"must be below ddp_timeout ({self.ddp_timeout} s): the other ranks wait that long for a hung env's rank"),
            (self.rollout_batch_size >= 0, "rollout_batch_size", "must be >= 0 (0 = all active envs)"),
            (self.rollout_mode in ROLLOUT_MODES, "rollout_mode", f"must be one of {ROLLOUT_MODES}"),
            (self.hf_prefix_cache_store_mb >= 0, "hf_prefix_cache_store_mb", "must be >= 0 (0 = reuse within a call only)"),
            (self.resample_without_signal >= 0, "resample_without_signal", "must be >= 0 (0 = skip a batch without signal)"),
            (self.resample_max_seconds >= 0, "resample_max_seconds", "must be >= 0 (0 = no time bound)"),
            (self.action_key_tokens >= 0, "action_key_tokens", "must be >= 0 (0 = key on the action text)"),
            (self.rollout_dump_steps >= 0, "rollout_dump_steps", "must be >= 0 (0 = no rollout dumps)"),
            (self.env_backend in BACKENDS, "env_backend",
             f"must be one of {tuple(BACKENDS)} (a backend registered with envs.vector.register_backend)"),
            (self.hidden_capture in ("hook", "forward"), "hidden_capture", "must be hook or forward"),
            (self.tool_errors in ("observe", "fail"), "tool_errors", "must be observe (as TRL) or fail"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {message}.")
        self._check_staleness()

    def _apply_scale_rewards(self) -> None:
        """TRL's `scale_rewards` as `advantage_norm` (`SCALE_REWARDS_NORM`), unless that is set itself;
        set to the other value, the two contradict each other and the run stops."""
        norm = SCALE_REWARDS_NORM.get(self.scale_rewards)
        if self.scale_rewards not in (*SCALE_REWARDS_NORM, "batch"):
            raise ValueError(f"scale_rewards={self.scale_rewards!r} must be one of 'group', 'batch', 'none' (TRL's).")
        if self.scale_rewards == "none" and self.advantage_norm not in (None, norm):
            raise ValueError(
                f"scale_rewards='none' asks for advantage_norm='mean' but advantage_norm={self.advantage_norm!r} is set; "
                "set one of them."
            )
        if self.advantage_norm is None and self.scale_rewards == "none":
            self.advantage_norm = norm

    def _check_staleness(self) -> None:
        if self.max_staleness == 0:
            return
        if self.max_staleness < 0 or self.max_staleness > 1 or isinstance(self.max_staleness, bool):
            raise ValueError(
                f"max_staleness={self.max_staleness!r} must be 0 (off) or 1 (the next generation plays during the "
                "current update): a rollout two or more updates old is not implemented."
            )
        if self.use_vllm:
            raise ValueError(
                "max_staleness=1 plays a rollout on a background thread beside training, which vLLM's engine does not "
                "support (its generate is not thread-safe beside the trainer's weight syncs); set use_vllm=False or "
                "max_staleness=0."
            )
        if self.loss_type == "vespo":
            raise ValueError(
                "max_staleness=1 applies the importance-sampling ratio by scaling the advantages, which is TRL's "
                "correction for every loss but loss_type='vespo' (whose weights read the ratio themselves); pick "
                "another loss_type or set max_staleness=0."
            )

    def require_env(self) -> None:
        """Raise what checking the default `env_name` found, for a trainer that plays it."""
        if self._env_error is not None:
            raise self._env_error

    def _check_env(self) -> None:
        """The env exists, its optional dependencies are installed and the splits are real:
        checked here, cheaply, so a bad setting fails before any model is loaded."""
        try:
            env_class = resolve_env_class(self.env_name)
        except ValueError as err:
            raise ValueError(str(err).replace("env=", "env_name=", 1)) from None
        try:
            env_class.check_available(**self.env_kwargs)
        except EnvUnavailableError as err:
            raise EnvUnavailableError(f"env_name={self.env_name!r}: {err}") from None
        splits = env_class.splits()
        for name in ("train_split", "eval_split"):
            if getattr(self, name) not in splits:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a split of {self.env_name!r}; use one of {splits}.")
        try:
            engine_kwargs, _ = split_surface_kwargs(self.env_kwargs)  # surface_variation wraps the env (envs.surface)
        except ValueError as err:
            raise ValueError(f"env_kwargs: {err}") from None
        try:
            inspect.signature(env_class).bind(**engine_kwargs)
        except TypeError as err:  # a typo in env_kwargs would fail every env build, silently skipping every batch
            raise ValueError(
                f"env_kwargs={self.env_kwargs!r} do not fit {env_class.__name__}{inspect.signature(env_class)} "
                f"({err}); fix the names."
            ) from None
        except ValueError:  # no introspectable signature (a builtin or C factory): the env build will tell
            pass
        # Listing the splits' tasks is env I/O (ALFWorld generates its games): the trainer and bipace-train's
        # pre-flight do it, before any model loads (`rollout.collector.check_env_tasks`), never a config's build.

    def _check_milestones(self) -> None:
        """An estimator that reads milestones (BEACON's) needs an env that gives them (`envs.base`, "Milestones")."""
        if not self.estimator.uses_milestones:
            return
        env_class = resolve_env_class(self.env_name)
        if env_class.milestone_kind not in MILESTONE_KINDS:
            raise ValueError(
                f"preset={self.preset!r} reads milestones (step_partition={self.estimator.step_partition!r}, "
                f"step_return={self.estimator.step_return!r}), which env_name={self.env_name!r} does not give "
                f"({env_class.__name__}.milestone_kind is None); pick an env that does (textcraft, alfworld, webshop, "
                "scienceworld, tiny), or give yours a plan or a flag (envs.base, 'Milestones')."
            )

    def _resolve_estimator(self) -> EstimatorSettings:
        """The preset's settings with every estimator field set here on top, by the shared names (`ESTIMATOR_FIELDS`)."""
        try:
            return resolve_settings(self.preset, **{name: getattr(self, name) for name in ESTIMATOR_FIELDS})
        except SettingsError as err:  # the message names the field as here, `step_partition=...`, or is prefixed with it
            raise ValueError(str(err) if str(err).startswith(f"{err.field}=") else f"{err.field}: {err}") from None
