"""`BiPACETrainer`: TRL's GRPOTrainer trained on multi-turn env rollouts, one sample per env step.

    collect (`collector.RolloutCollector`) → estimate (`advantages.StepAdvantageEstimator`) → TRL's loss

The rows of a generation batch are *tasks*, each repeated `num_generations` times. The
collector plays all of them in lockstep, generating through TRL's own `_generate_single_turn`
(HF generate or vLLM) and capturing the actor's hidden state when the estimator needs it;
every env step becomes one row of TRL's batch (`batching`), with the advantage the
estimator gives it. The envs are ours (`env_name`, a `TextEnv`) or TRL's own
(`environment_factory`, `tools`, `reward_funcs`, with TRL 1.16's meaning; `tool_envs`); a plain
prompt dataset with `reward_funcs` is a set of one-step episodes, trained with GRPOTrainer's own
advantage (`trl_advantages`). What the trainer does with each GRPOConfig field is
`config.GRPO_FIELDS`; docs/tutorials/coming-from-trl.md says it for users.

Overridden, everything else is TRL's (loss, clipping, KL, optimizer, logging, vLLM and
DeepSpeed plumbing):

- `__init__`: GRPOTrainer's signature, keyword for keyword; `rollout_func` is refused (the
  rollout is ours), a dict `environment_factory` must route every row, `cluster_layer` clamps
  to the model's depth, TRL's reward settings without a step-level form are refused on
  multi-turn episodes, and `max_turn_length` caps each generate call.
- `_generate_and_score_completions`: the seam above; in TRL's `evaluate` (`eval_dataset` with
  `eval_strategy`) the eval rows are played and scored the same way, for `eval_loss` and the
  `eval_*` metrics (`_eval_batch`). Env-failed episodes leave the batch unless
  `penalize_env_failures`; GRPOTrainer's own metrics are logged per episode (`trl_metrics`) next
  to ours. It calls `on_rollout(rollout, advantages, diagnostics)`, the hook through which a
  subclass sees every generation.
- `_tokenize_prompts`: each prompt bounded by the model's context.
- `compute_loss`: a generation in which no sample on any rank has a non-zero advantage
  skips its update (TRL's loss runs without gradients, for its metrics); a micro-batch runs in pieces of at
  most `per_device_train_batch_size` rows (`micro_batches`; with `shared_prefix`, cut in token order by
  `shared_prefix.py`).
- `_get_per_token_logps_and_entropies`: TRL's values, with each shared token prefix forwarded
  once (`shared_prefix.py`; the update and the old and reference log-prob passes).
- `training_step`: a non-finite loss stops the run before the optimizer applies it.
- `train`: SIGTERM saves and stops (`callbacks`), a run in which every episode failed
  raises, and every run leaves the project's model card (`model_card`).
- `_get_train_sampler`, `_get_output_dir`, `_save_checkpoint`, `_load_optimizer_and_scheduler`:
  atomic checkpoints that hold the run's own state, and exact resumes (`checkpointing`).
- `create_model_card`, `save_model`: the project's card in place of TRL's and PEFT's.

Added: `evaluate_policy(tag, split)` on held-out tasks (`evaluation`; its callbacks run it
before, during and after training), `on_rollout`, and `close_envs`. What the agent did
is written to TRL's completions table and to rollout dumps (`collector.record`). The guards
are listed in docs/RELIABILITY.md.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import ProgressCallback
from trl import GRPOTrainer

from . import memory
from .advantages import StepAdvantageEstimator, StepEstimate
from .config import BiPACEConfig
from .micro_batches import piece_weights, split_rows, take_rows
from .models import load_tokenizer, resolve_model_name
from .reports.model_card import model_card
from .rollout.batching import training_batch
from .rollout.collector import RolloutCollector, TextEnvSource, ToolEnvSource, _sharded_forward, env_reward, task_dataset
from .rollout.hidden import clamp_layer
from .rollout.loop import Rollout, TaskRef
from .rollout.overlap import Prefetched, RolloutOverlap
from .rollout.prompting import fit_prompt_ids
from .rollout.tool_envs import check_environment_factory
from .run import checkpointing, evaluation, resampling, run_dir
from .run.callbacks import GracefulStopCallback, NumericProgressCallback, TrainingInterrupted
from .run.evaluation import EvaluationCallback, FinalEvaluationCallback
from .shared_prefix import SharedPrefixForward
from .trl_advantages import AGGREGATIONS, grpo_advantages
from .trl_metrics import episode_token_count, summarise_episodes, trl_metrics

__all__ = ["BiPACETrainer", "TrainingInterrupted"]

logger = logging.getLogger(__name__)


def _plain_prompts(args: BiPACEConfig, reward_funcs, trl_envs: bool, train_dataset) -> bool:
    """Whether the trainer gets GRPOTrainer's plain case, `reward_funcs` on a prompt dataset with no
    env, no tools and `env_name` unset (each prompt a one-step episode), after the checks of what
    the arguments ask for; a run on `env_name` has its env checked here."""
    plain = not trl_envs and reward_funcs is not None and not args.env_name_set
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
    _check_multi_turn_reward_settings(args, one_step=plain)
    return plain


def _check_multi_turn_reward_settings(args: BiPACEConfig, one_step: bool) -> None:
    """TRL's reward settings that have no step-level form: honoured on one-step episodes (plain prompts,
    `trl_advantages`), refused on multi-turn ones (`config.GRPO_FIELDS`)."""
    if args.multi_objective_aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={args.multi_objective_aggregation!r} must be one of {AGGREGATIONS}.")
    if one_step:
        return
    if args.scale_rewards == "batch":
        raise ValueError(
            "scale_rewards='batch' divides by one std over the whole batch, which the step-level estimators have no "
            "form of (they normalise within task groups and state cells); set scale_rewards='group' or 'none'."
        )
    if args.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            f"multi_objective_aggregation={args.multi_objective_aggregation!r} normalises each reward function within "
            "its group before summing, but the step-level estimators credit one reward per episode (the weighted "
            "sum) to its steps; set multi_objective_aggregation='sum_then_normalize'."
        )


class ScoredRollout(NamedTuple):
    """One training rollout made into TRL's batch, with the estimator's advantages in place."""

    rollout: Rollout
    batch: dict[str, Any]
    batch_metrics: dict[str, float]
    estimate: StepEstimate
    estimator_seconds: float
    signal: bool  # some sample on some rank has a non-zero advantage
    masked_episodes: int = 0  # env-failed episodes whose steps were left out (`penalize_env_failures=False`)
    masked_steps: int = 0
    behaviour_step: int | None = None  # the optimizer step whose weights played it, if an earlier one's (`overlap`)


class BiPACETrainer(GRPOTrainer):
    """Multi-turn, step-level RL on text environments; see the module docstring.

    Args (GRPOTrainer's, in its order and with its defaults):
        model: what train.py's `--model_name_or_path` takes: a Hub id, a local path, or
            "embedded" (or None) for the embedded SmolLM2-135M-Instruct (`models.resolve_model_name`,
            converted once from its wheel, no download); or a loaded causal LM (a `PeftModel` works).
        args: a `BiPACEConfig` (None: its defaults, named after the model, as GRPOTrainer does).
        reward_processing_classes, optimizers, quantization_config: passed to GRPOTrainer unchanged.
        rollout_func: refused: it replaces the generation this trainer plays turn by turn.
        train_dataset: rows with a "task_id" column; defaults to the env's `train_split`. With
            TRL's envs, TRL's rows (each passed to `reset(**row)`; optional, as in TRL).
        processing_class: the tokenizer (needs a chat template; one that renders tools for
            TRL's envs); None loads the model's own (`models.load_tokenizer`).
        peft_config: a `peft.LoraConfig` to train an adapter.
        callbacks: extra `TrainerCallback`s.
        reward_funcs, tools, environment_factory: TRL 1.16's, with its meaning; given
            `environment_factory` or `tools`, the trainer plays TRL's envs (`tool_envs`) and
            `env_name` is not used; `reward_funcs` alone (no env, `env_name` unset) train on
            `train_dataset`'s prompts as GRPOTrainer does, each a one-step episode.
        eval_dataset: with `eval_strategy`, TRL's evaluation plays its rows (`eval_loss`, `eval_*`);
            with TRL's envs or plain prompts, they are also the rows `evaluate_policy` plays.

    `train()` leaves the project's model card (`model_card.py`) in `output_dir`, and
    `save_model()` keeps it there in place of PEFT's. Call `close_envs()` when done with the
    trainer: it stops the envs' worker threads or processes (`env_backend`) and frees the engines.

    A subclass changes what it needs through `on_rollout` (each training generation),
    `evaluate_policy` (what the evaluation callbacks call) and `skip_update_without_signal`.
    """

    _tag_names = ["trl", "bipace", "multi-turn-agent"]
    _name = "BiPACE"
    # Skip the update of a generation in which no sample on any rank has a non-zero
    # advantage (`compute_loss`); a subclass that must always update (a timing bench) sets False.
    skip_update_without_signal = True

    def __init__(
        self,
        model,
        reward_funcs: Callable | list | None = None,
        args: BiPACEConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Callable | dict[str, Callable] | None = None,
    ):
        # GRPOTrainer's signature, keyword for keyword and in its order, with its defaults.
        if rollout_func is not None:
            raise ValueError(
                "rollout_func replaces TRL's generation with one sample per prompt; BiPACETrainer plays the multi-turn "
                "rollout itself (one sample per env step): pass environment_factory/tools, or env_name, instead."
            )
        if args is None:  # as GRPOTrainer: a default config named after the model
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
            args = BiPACEConfig(f"{str(name).rstrip('/').split('/')[-1]}-BiPACE")
        if not isinstance(args, BiPACEConfig):
            raise TypeError(
                f"args must be a BiPACEConfig, got {type(args).__name__}: BiPACEConfig takes every GRPOConfig "
                "argument, so build it with the same arguments."
            )
        plain_prompts = _plain_prompts(args, reward_funcs, environment_factory is not None or bool(tools), train_dataset)
        trl_envs = environment_factory is not None or bool(tools) or plain_prompts  # scored by TRL's reward_funcs
        check_environment_factory(environment_factory, {"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        if model is None or isinstance(model, str):
            model = resolve_model_name(model)  # "embedded" → the converted SmolLM2, as in train.py
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        if processing_class is None and name:
            processing_class = load_tokenizer(
                name, truncation_side="left", padding_side="left", trust_remote_code=args.trust_remote_code
            )
        if train_dataset is None and not trl_envs:
            train_dataset = task_dataset(args.env_name, args.train_split, args.env_kwargs, limit=args.train_tasks)
        user_rewards = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        super().__init__(
            model=model,
            reward_funcs=list(user_rewards) if trl_envs else [env_reward],  # TRL appends get_reward to it
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )
        self.one_step = plain_prompts
        if plain_prompts:  # the prompt is the only state, shared by the group: GRPOTrainer's advantage (`trl_advantages`)
            args.estimator = dataclasses.replace(
                args.estimator, partition="none", baseline=None, w_ep=1.0, w_step=0.0, context_levels=0
            )
            logger.info(f"Plain prompts: each a one-step episode with GRPOTrainer's advantage (preset={args.preset!r} "
                        "has no step term to add where the prompt is the only state).")
        self.estimator = StepAdvantageEstimator(args.estimator)
        self._cap_turns(args)
        needs_hidden = "hidden" in args.estimator.rollout_needs
        if needs_hidden:
            args.cluster_layer = clamp_layer(self.accelerator.unwrap_model(self.model), args.cluster_layer)
        if trl_envs:
            eval_rows = list(eval_dataset) if eval_dataset is not None else []
            source = ToolEnvSource(self, num_user_reward_funcs=len(user_rewards), eval_rows=eval_rows)
        else:
            source = TextEnvSource(args)
        self.collector = RolloutCollector(self, source, needs_hidden=needs_hidden)
        self._sync = self.collector.sync
        self._shared_prefix = SharedPrefixForward.for_trainer(self)  # None where off (`shared_prefix`)
        self._overlap = self._rollout_overlap(trl_envs) if args.max_staleness else None
        self.eval_history: list[dict[str, Any]] = []
        self.interrupted = False
        self._checkpoint_staging: str | None = None
        self._saving = False
        self._skip_update = False  # the current generation's, for each micro-batch TRL cuts from it
        self._graceful_stop = GracefulStopCallback(self)
        self.add_callback(self._graceful_stop)
        self.add_callback(EvaluationCallback(self))
        self.callback_handler.callbacks.insert(0, FinalEvaluationCallback(self))
        if self.callback_handler.pop_callback(ProgressCallback) is not None:
            self.add_callback(NumericProgressCallback)

    def _cap_turns(self, args: BiPACEConfig) -> None:
        """Each generate call's cap is `max_turn_length` (None: `max_completion_length`, TRL's
        setting of both backends); TRL's envs also cap the episode (`tool_envs`)."""
        if args.max_turn_length is None or args.max_turn_length == self.max_completion_length:
            return
        if self.use_vllm:
            self.vllm_generation.max_completion_length = args.max_turn_length
        else:
            self.generation_config.max_new_tokens = args.max_turn_length
            self.generation_kwargs["max_new_tokens"] = args.max_turn_length

    def _rollout_overlap(self, trl_envs: bool) -> RolloutOverlap:
        """`max_staleness=1`'s background rollouts (`rollout.overlap`), where nothing on the
        background thread would have to run with the other ranks."""
        if _sharded_forward(self):
            raise ValueError(
                "max_staleness=1 cannot run under ZeRO-3 or FSDP: every forward there gathers parameters across "
                "ranks, and the background rollout's forwards run apart from the other ranks'. Set max_staleness=0."
            )
        if trl_envs:
            raise ValueError(
                "max_staleness=1 plays the project's TextEnvs (env_name) only: TRL's environment_factory/tools score "
                "episodes through the trainer's reward functions, which cannot run beside training. Set max_staleness=0."
            )
        return RolloutOverlap(self)

    @property
    def needs_hidden(self) -> bool:
        """The estimator's partition reads hidden states, so the rollout captures them."""
        return self.collector.needs_hidden

    @needs_hidden.setter
    def needs_hidden(self, value: bool) -> None:
        self.collector.needs_hidden = value

    # ------------------------------------------------------------------ generation (the collector calls these)

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then each prompt bounded by the model's context minus one reply's
        cap (`max_turn_length`, else `max_completion_length`; `prompting.fit_prompt_ids`): past it a
        learned-position model crashes and a RoPE model silently degrades."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        context = getattr(self.accelerator.unwrap_model(self.model).config.get_text_config(), "max_position_embeddings", None)
        if not context:
            return (prompt_ids, *rest)
        limit = max(context - (self.args.max_turn_length or self.args.max_completion_length), 16)
        if all(len(ids) <= limit for ids in prompt_ids):
            return (prompt_ids, *rest)
        marker = self._tokenizer.encode("\n[... cut to fit the context ...]\n", add_special_tokens=False)
        return ([fit_prompt_ids(ids, limit, marker) for ids in prompt_ids], *rest)

    # ------------------------------------------------------------------ the run

    def train(self, *args, **kwargs):
        """TRL's `train`; a run stopped by SIGTERM returns None with `interrupted` set, and a
        run in which every episode failed raises instead of reporting success."""
        if self.is_world_process_zero():
            run_dir.clean_stale_files(self.args.output_dir)  # a killed dump's .partial, the user's README.md
        # TRL's fused LM head in small tiles on a CPU, for this run only (undone on exit: `trl_compat`)
        with memory.bound_cpu_memory(self.accelerator.device):
            try:
                output = super().train(*args, **kwargs)
            except TrainingInterrupted as stop:
                logger.warning(f"Stopped by {stop}; {run_dir.stop_message(self.args.output_dir)}")
                return None
            finally:
                self._graceful_stop.restore_handler()
                if self._overlap is not None:
                    self._overlap.close()  # a prefetched generation past the run's last step is not trained on
        collector = self.collector
        if collector.train_generations and not collector.healthy_generations and not self.interrupted:
            raise RuntimeError(collector.every_env_failed(f"all {collector.train_generations} generations of the run"))
        try:  # every run leaves the project's card, pushed or not
            self.create_model_card()
        except Exception as err:  # noqa: BLE001 - a report: it must not cost the run its unsaved weights
            logger.warning(f"The model card could not be written ({type(err).__name__}: {err}); training is complete.")
        return output

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Transformers' own; with `max_staleness=1` the epoch iterator is read through a
        `Lookahead`, so the next generation's rows are known while the current update runs."""
        if self._overlap is not None:  # the training loop's only (evaluation reads its dataloader itself)
            epoch_iterator = self._overlap.lookahead(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, reseeded per epoch so that a resumed run draws the same task order."""
        return checkpointing.EpochSeededRepeatSampler.like(super()._get_train_sampler(dataset))

    # ------------------------------------------------------------------ the seam

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        if not self.model.training:  # TRL's evaluate (eval_dataset, eval_strategy)
            return self._eval_batch(inputs)
        mode = "train"
        tasks = self.collector.task_refs(inputs, group_size=self.num_generations)
        # max_staleness=1: this generation may have been played during the previous update (`rollout.overlap`)
        prefetched = None
        if self._overlap is not None and mode == "train":
            prefetched = self._overlap.take(inputs)
        elif self._overlap is not None:  # TRL's evaluate plays on the same envs: the rollout in flight ends first
            self._overlap.join()
        # a subclass's `_scored_rollout(self, tasks)` (a timing bench's, a recorder's) keeps working without overlap
        scored = self._scored_rollout(tasks, prefetched) if prefetched is not None else self._scored_rollout(tasks)
        # Dynamic sampling (DAPO's, per generation): a batch with no signal on any rank is
        # played again on freshly drawn tasks, up to `resample_without_signal` times. Every
        # rank draws and decides alike (`signal` is any over ranks), so all stay in lockstep.
        # Bounded, logged as it happens, and ended by SIGTERM (`resampling`).
        outcome = resampling.resample_until_signal(
            scored, lambda attempt: self._scored_rollout(self._redraw_tasks(tasks, attempt)),
            max_attempts=self.args.resample_without_signal, max_seconds=self.args.resample_max_seconds,
            stop_requested=lambda: self._graceful_stop.stop_requested, agree=self._sync.any,
            step=self.state.global_step + 1, log=self.accelerator.is_main_process,
        )
        scored, resamples = outcome.scored, outcome.attempts
        played = [episode for batch in outcome.played for episode in batch.rollout.episodes]
        rollout, output, estimate, signal = scored.rollout, scored.batch, scored.estimate, scored.signal
        advantages, diagnostics = estimate.advantage, estimate.diagnostics
        self.on_rollout(rollout, advantages, diagnostics)
        # No sample with a non-zero advantage on any rank (all rewards equal, every env
        # failed, no steps at all): there is nothing to learn from; skip the update. TRL
        # shuffles this batch, cuts it into micro-batches and buffers them until the next
        # generation, so the flag stays on the trainer, set once per generation.
        self._skip_update = not signal and self.skip_update_without_signal

        metrics = {**rollout.metrics(), **diagnostics, **self.collector.env_metrics("train"), **scored.batch_metrics}
        metrics.update(self._trl_metrics(rollout, mode))
        metrics["train/masked_failed_episodes"] = float(scored.masked_episodes)
        metrics["train/masked_failed_steps"] = float(scored.masked_steps)
        metrics["train/skipped_batches"] = float(not signal)
        if self.args.resample_without_signal:
            metrics["train/resamples"] = float(resamples)
            # the trained batch was selected for signal; this rate counts every episode the step played
            metrics["episode/success_rate_all_played"] = sum(e.won for e in played) / max(len(played), 1)
        metrics["time/estimator_s"] = scored.estimator_seconds
        if self.use_vllm:
            metrics["vllm/weight_syncs"] = float(self.collector.weight_syncs.count)
        if self._overlap is not None:
            # optimizer steps between the weights that played the trained batch and the current ones
            behind = scored.behaviour_step  # None: played now (the first generation, an epoch's, a resampled one)
            metrics["rollout/staleness"] = float(self.state.global_step - behind) if behind is not None else 0.0
            metrics["rollout/prefetched"] = float(behind is not None)
        self._record_metrics(mode, metrics)
        self.collector.record(rollout, estimate)
        if self._overlap is not None and mode == "train":
            self._overlap.start_next(inputs)  # the next generation plays while this one trains
        return output

    def _scored_rollout(self, tasks: list[TaskRef], prefetched: Prefetched | None = None) -> ScoredRollout:
        """Play `tasks`, build TRL's batch with the estimator's advantages in place, and say
        whether any rank has a non-zero advantage.

        `prefetched`: the rollout of `tasks` already played by an earlier policy (`max_staleness=1`):
        the batch then carries TRL's importance ratio ρ of the current policy against the one that
        played it (`batching.training_batch`), and each row's advantage becomes ρ·A, (B, T) for a
        per-token ratio. TRL's vLLM correction multiplies the per-token loss by ρ; for every loss
        but VESPO (refused) that loss is ρ ≥ 0 times a term linear in A or a function of A's sign
        only through ρ·A, so scaling the advantage is the same correction: GRPO/BNPO/DR-GRPO/DAPO/
        LUSPO's −min(r·A, clip(r)·A), CISPO's −sg(clip(r))·A·log π and SAPO's −s(r)·A (ρ = 0 zeroes
        the term either way)."""
        rank = self.accelerator.process_index
        if prefetched is not None:
            played = prefetched.rollout
            self.collector.check_failures(played)  # the guard the foreground collect runs itself
        else:
            played = self.collector.collect("train", tasks, traj_offset=rank * len(tasks))
        # An env fault is not the policy's failure: unless told to penalise them, failed episodes'
        # steps leave the batch (no loss, no place in their group's statistics).
        rollout = played if self.args.penalize_env_failures else played.without_failed_episodes()
        masked_steps = len(played.steps) - len(rollout.steps)
        masked_episodes = sum(e.failed and e.length > 0 for e in played.episodes) if masked_steps else 0
        # The batch first: under vLLM its old-logprob pass also captures the hidden states.
        capture_hidden = self.use_vllm and self.needs_hidden and self.args.hidden_capture == "hook"
        batch, batch_metrics = training_batch(self, rollout, self._sync, capture_hidden, behaviour_policy=prefetched is not None)
        self._mask_cut_episodes(rollout, batch)
        start = time.perf_counter()
        estimate = self._estimate(rollout, self.estimator, self.num_generations)
        estimator_seconds = time.perf_counter() - start
        advantages = estimate.advantage
        if not torch.isfinite(advantages).all():
            raise FloatingPointError(
                "Non-finite advantages from the estimator; inspect the step rewards (env) and the estimator settings."
            )
        padded_rows = batch["advantages"].numel() - advantages.numel()
        batch["advantages"] = torch.cat([advantages, torch.zeros(padded_rows)]).to(batch["advantages"].device)
        if prefetched is not None:  # TRL's importance-sampling correction, see the docstring
            batch["advantages"] = batch["advantages"].unsqueeze(1) * batch["importance_sampling_ratio"]
        signal = self._sync.any(bool((advantages != 0).any()))
        return ScoredRollout(
            rollout, batch, batch_metrics, estimate, estimator_seconds, signal, masked_episodes, masked_steps,
            behaviour_step=prefetched.snapshot_step if prefetched is not None else None,
        )

    def _estimate(self, rollout: Rollout, estimator: StepAdvantageEstimator, group_size: int) -> StepEstimate:
        """The estimator's advantages of `rollout`; on one-step episodes (plain prompts) GRPOTrainer's own
        (`trl_advantages.grpo_advantages`, over every rank's rows as TRL gathers them)."""
        estimate = estimator.estimate(rollout.step_batch(), reduce=self._sync.mean)
        if not self.one_step:
            return estimate
        nan = float("nan")
        rows = [[nan if e.failed else e.reward_terms.get(name, nan) for name in self.reward_func_names] for e in rollout.episodes]
        local = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(self.reward_func_names))
        every = self.accelerator.gather(local.to(self.accelerator.device)).cpu() if self.accelerator.num_processes > 1 else local
        advantages = grpo_advantages(
            every, self.reward_weights.cpu(), group_size, self.args.scale_rewards, self.args.multi_objective_aggregation
        )
        start = self.accelerator.process_index * len(rows)
        by_traj = {e.traj: advantages[start + j] for j, e in enumerate(rollout.episodes)}
        estimate.advantage = torch.stack([by_traj[s.traj] for s in rollout.steps]) if rollout.steps else torch.zeros(0)
        adv = estimate.advantage.double()
        q25, q75 = (torch.quantile(adv, torch.tensor([0.25, 0.75], dtype=adv.dtype)).tolist() if adv.numel() else (0.0, 0.0))
        estimate.diagnostics.update({
            "advantage/mean": float(adv.mean()) if adv.numel() else 0.0,
            "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "advantage/iqr": q75 - q25,
            "advantage/episode_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
        })
        return estimate

    def _mask_cut_episodes(self, rollout: Rollout, batch: dict[str, Any]) -> None:
        """`mask_truncated_completions` with TRL's meaning on TRL's envs: an episode is TRL's one
        completion, so every step of an episode whose last reply was cut (no EOS) leaves the loss, not
        only that reply (which `batching` masks on every env)."""
        if not (self.mask_truncated_completions and isinstance(self.collector.source, ToolEnvSource)) or self.one_step:
            return
        eos, last = set(self.eos_token_ids), {}
        for step in rollout.steps:
            last[step.traj] = step
        cut = {traj for traj, step in last.items() if not step.completion_ids or step.completion_ids[-1] not in eos}
        rows = [j for j, step in enumerate(rollout.steps) if step.traj in cut]
        if rows:
            batch["completion_mask"][rows] = 0
        batch["num_items_in_batch"] = self.accelerator.gather(batch["completion_mask"].sum()).sum()

    def _eval_batch(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's `evaluate` (`eval_dataset` with `eval_strategy`): its rows played on the eval envs at the
        training temperature, `num_generations_eval` episodes each, scored as a training batch (no
        resampling, overlap, hooks or dumps) so that TRL's `prediction_step` gives `eval_loss`, and this
        generation's metrics are logged with TRL's `eval_` prefix. The success-rate evaluation of
        held-out tasks is `evaluate_policy`'s (`eval_interval`), apart from this."""
        if self._overlap is not None:
            self._overlap.join()
        tasks = self.collector.task_refs(inputs, group_size=self.num_generations_eval)
        played = self.collector.collect("eval", tasks, traj_offset=self.accelerator.process_index * len(tasks))
        rollout = played if self.args.penalize_env_failures else played.without_failed_episodes()
        if self.needs_hidden and rollout.steps:  # evaluation rollouts capture none: one pass over the prompts
            for step, state in zip(rollout.steps, self.collector._forward_hidden([s.prompt_ids for s in rollout.steps])):
                step.hidden = state
        batch, batch_metrics = training_batch(self, rollout, self._sync)
        self._mask_cut_episodes(rollout, batch)
        # a copy: evaluation must not move the training estimator's ε calibration or call count
        estimate = self._estimate(rollout, copy.deepcopy(self.estimator), self.num_generations_eval)
        padded_rows = batch["advantages"].numel() - estimate.advantage.numel()
        batch["advantages"] = torch.cat([estimate.advantage, torch.zeros(padded_rows)]).to(batch["advantages"].device)
        metrics = {**rollout.metrics(), **estimate.diagnostics, **batch_metrics, **self._trl_metrics(rollout, "eval")}
        self._record_metrics("eval", metrics)
        return batch

    def _redraw_tasks(self, tasks: list[TaskRef], attempt: int) -> list[TaskRef]:
        """`tasks` with each group's task replaced by a row drawn from the training set, seeded
        by (seed, step, attempt, rank): a resumed run redraws the same tasks."""
        rows = range(len(self.train_dataset))
        generator = random.Random(f"{self.args.seed}/{self.state.global_step}/{attempt}/{self.accelerator.process_index}")
        drawn = {group: self.train_dataset[generator.choice(rows)] for group in sorted({ref.group for ref in tasks})}
        return [self.collector.source.task_ref(drawn[ref.group], group=ref.group) for ref in tasks]

    def on_rollout(self, rollout: Rollout, advantages: torch.Tensor, diagnostics: dict[str, float]) -> None:
        """Called once per training generation with its rollout (one `StepRecord` per
        sample, in batch order), the estimator's (N,) advantages and its diagnostics,
        before they enter TRL's loss. Override to inspect or record them; the default does nothing."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        skip = self._skip_update and self.model.training  # the generation's (`_generate_and_score_completions`)
        if skip and not self.is_deepspeed_enabled:
            # No backward: gradients stay None, so the optimizer leaves every parameter (and its
            # moments) untouched. TRL's loss still runs, without gradients, so that its metrics
            # (entropy, kl, clip_ratio/*: 0 with zero advantages) are numbers, as GRPOTrainer logs
            # them. DeepSpeed counts micro-steps inside its backward, so under DeepSpeed the
            # zero-advantage loss runs as usual.
            with torch.no_grad():
                self._loss_in_pieces(model, inputs)
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        return self._loss_in_pieces(model, inputs, return_outputs, num_items_in_batch)

    def _loss_in_pieces(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss over a micro-batch, in pieces of at most `per_device_train_batch_size` rows
        (with `shared_prefix`, cut in token order)."""
        size = self.args.per_device_train_batch_size
        runs = self._shared_prefix.pieces(inputs, size) if self._shared_prefix is not None else None
        pieces = split_rows(inputs, size) if runs is None else take_rows(inputs, runs)
        if len(pieces) == 1:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # A micro-batch holds one row per env step, up to max_turns times the rows TRL planned
        # for: run the loss piece by piece so activation memory is bounded by
        # per_device_train_batch_size rows (micro_batches.py). Every piece but the last is
        # back-propagated here without syncing gradients; Trainer.training_step back-propagates
        # the last, which syncs them. Every rank has as many pieces (rows are padded to the
        # largest count over ranks), so collective calls inside forward passes stay aligned.
        weights = piece_weights(pieces, self.loss_type)
        done = torch.zeros((), device=self.accelerator.device)
        if not torch.is_grad_enabled():  # TRL's prediction_step, or a skipped update's metrics: the loss only
            for piece, weight in zip(pieces, weights):  # a loop: zero-argument super() fails inside a generator
                done = done + super().compute_loss(model, piece) * weight
            return done
        for piece, weight in zip(pieces[:-1], weights[:-1]):
            with self.accelerator.no_sync(model):
                loss = super().compute_loss(model, piece) * weight
                if self.is_deepspeed_enabled:  # accumulate without DeepSpeed's optimizer step
                    self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
                else:
                    self.accelerator.backward(loss)
            done = done + loss.detach()
        return super().compute_loss(model, pieces[-1]) * weights[-1] + done

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's, or the same values with each shared prefix forwarded once (`shared_prefix.py`)."""
        trl = super()._get_per_token_logps_and_entropies

        def plain(m=model, ids=input_ids, mask=attention_mask):
            return trl(m, ids, mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra)

        shared = getattr(self, "_shared_prefix", None)
        if shared is None or not shared.applies(compute_aux_loss, extra):
            return plain()
        return shared.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                          compute_entropy, plain)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._sync.any(not bool(torch.isfinite(loss).all())):
            return loss
        raise FloatingPointError(
            f"Non-finite loss ({float(loss)}) at step {self.state.global_step}: stopping before the optimizer "
            "applies it. Lower learning_rate, check the env's rewards, or resume from the last checkpoint "
            f"in {self.args.output_dir}."
        )

    # ------------------------------------------------------------------ metrics

    def _trl_metrics(self, rollout: Rollout, mode: str = "train") -> dict[str, float]:
        """GRPOTrainer's own metrics of this generation, by episode (`trl_metrics`), and its token counts:
        TRL's `num_tokens` (the running total of tokens the model processed, each once:
        `trl_metrics.episode_token_count`) and ours, `rollout/tokens_all_turns` (this generation's
        prompt and completion tokens, every turn's whole prompt counted)."""
        trl_rewards = getattr(self.collector.source, "uses_reward_funcs", False)  # else the env's own, TRL's `env_reward`
        names = self.reward_func_names if trl_rewards else ["env_reward"]
        summaries = summarise_episodes(
            rollout, [*self.eos_token_ids, self._tokenizer.pad_token_id], rank=self.accelerator.process_index,
            single_source=None if trl_rewards else names[0],
            failed_scored=self.args.penalize_env_failures,
        )
        all_turns = sum(len(s.prompt_ids) + len(s.completion_ids) for s in rollout.steps)
        tokens = torch.tensor([[episode_token_count(rollout.steps), all_turns]], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            summaries = gather_object(summaries)
        processed_once, every_turn = (int(n) for n in self.accelerator.gather(tokens).sum(dim=0))
        if mode == "train":  # as TRL: evaluation tokens are not "seen"
            self.state.num_input_tokens_seen += processed_once
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]  # TRL's: the running total
        return {**trl_metrics(summaries, names, tools=bool(self.tools)), "rollout/tokens_all_turns": float(every_turn)}

    def _record_metrics(self, mode: str, metrics: dict[str, float]) -> None:
        """Each metric combined over ranks (`CrossRankSync.combine`), appended to TRL's metric buffers."""
        for key, value in self._sync.combine(metrics).items():
            self._metrics[mode][key].append(value)

    # ------------------------------------------------------------------ evaluation (`evaluation`)

    def eval_task_refs(self, split: str | None = None) -> list[TaskRef]:
        """The rollouts one evaluation of `split` (default `eval_split`) plays."""
        return self.collector.eval_task_refs(split or self.args.eval_split)

    def evaluate_policy(self, tag: str = "manual", split: str | None = None) -> dict[str, Any]:
        """Success rate on the held-out tasks of `split` (default `eval_split`) at `eval_temperature`,
        overall and per task type: logged, appended to `eval_history` and `<output_dir>/eval_results.json`,
        and returned (`evaluation.evaluate_policy`). Every rank must call it. The evaluation
        callbacks call it with tag "before", "interval" and "final"; a subclass may override it."""
        if self._overlap is not None:
            self._overlap.join()  # the tokenizer and the envs' workers serve one rollout at a time
        return evaluation.evaluate_policy(self, tag=tag, split=split or self.args.eval_split)

    # ------------------------------------------------------------------ checkpoints and card (`checkpointing`, `model_card`)

    def _get_output_dir(self, trial):
        return self._checkpoint_staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, written atomically with the run's own state (`checkpointing.save_atomically`)."""
        if self._overlap is not None:
            self._overlap.join()  # the prefetched generation is saved with the checkpoint
        trl_save = super()._save_checkpoint
        self._saving = True  # a SIGTERM now waits for the save to end (`callbacks.GracefulStopCallback`)
        try:
            checkpointing.save_atomically(self, Path(super()._get_output_dir(trial)), lambda: trl_save(model, trial))
        finally:
            self._saving = False

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        checkpointing.load_run_state(self, checkpoint)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, output_dir=None):
        """The project's card (`model_card.model_card`) as `<output_dir>/README.md`."""
        if not self.is_world_process_zero():
            return
        directory = Path(output_dir or self.args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        source = self.collector.source
        card = model_card(
            self.args, self.model, model_name or directory.name, steps=self.state.global_step, env=source.name,
            report_key=source.report_key, eps=self.estimator.eps_in_use, eval_history=self.eval_history,
            recipe=getattr(self, "recipe", None),
        )
        (directory / "README.md").write_text(card)

    def save_model(self, output_dir=None, _internal_call=False):
        """TRL's, then the project's card over the blank one PEFT writes next to an adapter
        (checkpoints, saved with `_internal_call`, keep PEFT's)."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call:
            self.create_model_card(output_dir=output_dir)

    def close_envs(self) -> None:
        """Stop every env this trainer built (worker threads or processes, engines); call it when done."""
        self.collector.close()

