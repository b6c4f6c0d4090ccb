"""`BiPACETrainer`: TRL's GRPOTrainer trained on multi-turn env rollouts, one sample per env step.

    collect (`RolloutCollector`, through `self.policy`) → estimate (`update.scoring`) → TRL's loss

Rows of a generation batch are tasks, each `num_generations` times; the collector plays them through
`self.policy` (`update.policy.TRLPolicy`: TRL's own generation), each env step one row of TRL's batch with
the estimator's advantage. What it takes of TRL's internals comes through its base `update.adapter.GRPOAdapter`
(the ledger, `trl_compat`, lists each name); this one touches none (tests/test_seam.py). Everything else
(loss, clipping, KL, optimizer, logging, vLLM, DeepSpeed) is TRL's; with `shared_prefix` each shared token
prefix is forwarded once in TRL's log-prob passes (`update/shared_prefix.py`). Guards: docs/RELIABILITY.md.

A plain prompt dataset with `reward_funcs` is a set of one-step episodes, trained with GRPOTrainer's
own advantage (`update.one_step`); TRL's `evaluate` (`eval_dataset`, `eval_strategy`) plays and scores
its rows as a training batch (`_eval_batch`). What the trainer does with each GRPOConfig field is
`trl_compat.GRPO_FIELDS`; docs/tutorials/coming-from-trl.md says it for users.
"""
from __future__ import annotations

import copy
import functools
import logging
import random
from pathlib import Path
from typing import Any, Callable

import torch
from datasets import Dataset
from transformers import ProgressCallback

from . import trl_compat
from .advantages import StepAdvantageEstimator
from .config import BiPACEConfig
from .models import load_tokenizer, resolve_model_name
from .reports.model_card import write_model_card
from .rollout.collector import (
    RolloutCollector, check_env_tasks, env_reward, env_source, sharded_forward, task_dataset,
)
from .rollout.hidden import HiddenPlan
from .rollout.loop import Rollout, TaskRef
from .rollout.tool_envs import check_environment_factory, check_milestones
from .run import checkpointing, evaluation, resampling, run_dir
from .run.callbacks import GracefulStopCallback, NumericProgressCallback, TrainingInterrupted
from .run.evaluation import EvaluationCallback, FinalEvaluationCallback
from .run.plan import derive_plan
from .update import memory
from .update.adapter import GRPOAdapter
from .update.overlap import Prefetched, RolloutOverlap, check_overlap
from .update.policy import TRLPolicy
from .update.scoring import ScoredRollout, generation_metrics, score_rollout
from .update.shared_prefix import SharedPrefixForward

__all__ = ["BiPACETrainer", "TrainingInterrupted"]

logger = logging.getLogger(__name__)


class BiPACETrainer(GRPOAdapter):
    """Multi-turn, step-level RL on text environments; see the module docstring.

    Args (GRPOTrainer's, in its order and with its defaults):
        model: a Hub id, a local path, or "embedded" (or None) for the embedded SmolLM2-135M-Instruct
            (`models.resolve_model_name`, no download); or a loaded causal LM (a `PeftModel` works).
        args: a `BiPACEConfig` (None: its defaults, named after the model, as GRPOTrainer does).
        train_dataset: rows with a "task_id" column; defaults to the env's `train_split`. With
            TRL's envs, TRL's rows (each passed to `reset(**row)`; optional, as in TRL).
        processing_class: the tokenizer (with a chat template); None loads the model's own.
        reward_funcs, tools, environment_factory: TRL 1.16's, with its meaning; given
            `environment_factory` or `tools`, the trainer plays TRL's envs (`tool_envs`) and
            `env_name` is not used; `reward_funcs` alone (no env, `env_name` unset) train on
            `train_dataset`'s prompts as GRPOTrainer does, each a one-step episode.
        eval_dataset: with `eval_strategy`, TRL's evaluation plays its rows (`eval_loss`, `eval_*`);
            with TRL's envs or plain prompts, they are also the rows `evaluate_policy` plays.
        peft_config, callbacks, reward_processing_classes, optimizers, quantization_config: TRL's;
        rollout_func: refused (it replaces the generation this trainer plays turn by turn).

    Call `close_envs()` when done. A subclass changes what it needs through the documented hooks
    (docs/architecture.md#hooks): `generate_and_score`, `collect`, `on_scored`, `on_rollout`,
    `evaluate_policy`, `compute_loss` and `skip_update_without_signal`; never a private method.
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
        trl_envs = environment_factory is not None or bool(tools)
        args = BiPACEConfig.for_trainer(model, args, rollout_func, reward_funcs, trl_envs, train_dataset)
        trl_compat.verify_ledger(args.use_vllm)  # every private name we borrow is there, before the model loads
        plain_prompts = args.plain_prompts(reward_funcs, trl_envs)
        if not (trl_envs or plain_prompts):  # our env's splits list tasks (env I/O: here, not in the config)
            check_env_tasks(args.env_name, args.env_kwargs, {"train_split": args.train_split, "eval_split": args.eval_split})
        trl_envs = trl_envs or plain_prompts  # scored by TRL's reward_funcs
        check_environment_factory(environment_factory, {"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        check_milestones(environment_factory, needed=trl_envs and not plain_prompts and args.estimator.uses_milestones)
        if model is None or isinstance(model, str):
            model = resolve_model_name(model)  # "embedded" → the converted SmolLM2, as in train.py
        name = model if isinstance(model, str) else getattr(model.config, "name_or_path", "")
        if processing_class is None and name:
            processing_class = load_tokenizer(
                name, truncation_side="left", padding_side="left", trust_remote_code=args.trust_remote_code
            )
        if train_dataset is None and not trl_envs:
            train_dataset = task_dataset(args.env_name, args.train_split, args.env_kwargs, limit=args.train_tasks)
        user_rewards = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        super().__init__(
            model=model, reward_funcs=list(user_rewards) if trl_envs else [env_reward],  # TRL appends get_reward to it
            args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
            reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
            quantization_config=quantization_config, peft_config=peft_config, tools=tools,
            environment_factory=environment_factory,
        )
        self.one_step = plain_prompts
        # derived once, never written into `args`: two trainers of one config are independent (`run.plan`)
        self.plan = derive_plan(args, plain_prompts, self.accelerator.unwrap_model(self.model), self.use_vllm)
        if plain_prompts:  # the prompt is the only state, shared by the group: GRPOTrainer's advantage (`update.one_step`)
            logger.info(f"Plain prompts: one-step episodes, GRPOTrainer's advantage (preset={args.preset!r} has no step term).")
        self.estimator = StepAdvantageEstimator(self.plan.estimator)
        self.cap_turns(args.max_turn_length)
        self._build_rollout(args, trl_envs, len(user_rewards), eval_dataset)
        self.eval_history: list[dict[str, Any]] = []
        self.interrupted = False
        self._skip_update = False  # the current generation's, for each micro-batch TRL cuts from it
        self._graceful_stop = GracefulStopCallback(self, self._sync)
        self.add_callback(self._graceful_stop)
        self.add_callback(EvaluationCallback(self))
        self.callback_handler.callbacks.insert(0, FinalEvaluationCallback(self))
        if self.callback_handler.pop_callback(ProgressCallback) is not None:
            self.add_callback(NumericProgressCallback)

    # ------------------------------------------------------------------ the seam's one crossing: what the rollout gets

    def _build_rollout(self, args: BiPACEConfig, trl_envs: bool, num_user_rewards: int, eval_dataset) -> None:
        """The policy (TRL's generation), the hidden-state plan, the env source and the collector."""
        self.hidden_plan = self.plan.hidden
        self.policy = TRLPolicy(self.trl_generation())
        self.batch_spec = self.trl_batch_spec(mask_cut_episodes=trl_envs and not self.one_step)
        setup = self.tool_env_setup(num_user_rewards) if trl_envs else None  # None: our TextEnvs
        # values, derived once (`run.plan`): the rollout never sees `args`
        source = env_source(self.plan.env, self.plan.rollout, setup, num_user_rewards, eval_dataset)
        self.collector = RolloutCollector(self.policy, source, self.plan.rollout, self.accelerator, self.hidden_plan,
                                          sharded=self.sharded_forward)
        self._sync = self.collector.sync
        self.shared_prefix = SharedPrefixForward.for_trainer(self)  # None where off (`shared_prefix`)
        self._overlap = self._rollout_overlap(trl_envs) if args.max_staleness else None

    def _rollout_overlap(self, trl_envs: bool) -> RolloutOverlap:
        """`max_staleness=1`'s background rollouts (`update.overlap`), where no forward waits for other ranks."""
        check_overlap(sharded_forward(self.accelerator, getattr(self, "is_fsdp_enabled", False)), trl_envs)
        return RolloutOverlap(self.collector, self.batch_spec, lambda: self.state.global_step, self.num_generations)

    @property
    def needs_hidden(self) -> bool:  # the rollout captures hidden states (the partition reads them, or asked)
        return self.hidden_plan.source != "none"

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
                self.save_stopped_end()  # stopped in the final evaluation: a checkpoint to resume it from
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
        if self.state.global_step >= self.state.max_steps > 0:  # resumed at its end: transformers would train one more
            self.control.should_training_stop = True
            return [], None
        if self._overlap is not None:  # the training loop's only (evaluation reads its dataloader itself)
            epoch_iterator = self._overlap.lookahead(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    # ------------------------------------------------------------------ the seam

    def generate_and_score(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        """Hook: one generation batch (TRL's `_generate_and_score_completions`, through `GRPOAdapter`), played
        as multi-turn episodes and scored: TRL's batch, one row per env step (training and evaluation)."""
        if not self.model.training:  # TRL's evaluate (eval_dataset, eval_strategy)
            return self._eval_batch(inputs)
        tasks = self.collector.task_refs(inputs, group_size=self.num_generations)
        # max_staleness=1: this generation may have been played during the previous update (`update.overlap`)
        prefetched = self._overlap.take(inputs) if self._overlap is not None else None
        scored = self.collect(tasks, prefetched)
        # Dynamic sampling (DAPO's, per generation): a batch with no signal on any rank is played again on
        # freshly drawn tasks, up to `resample_without_signal` times; every rank draws and decides alike.
        outcome = resampling.resample_until_signal(
            scored, lambda attempt: self.collect(self._redraw_tasks(tasks, attempt)),
            max_attempts=self.args.resample_without_signal, max_seconds=self.args.resample_max_seconds,
            stop_requested=lambda: self._graceful_stop.stop_requested, agree=self._sync.any,
            step=self.state.global_step + 1, log=self.accelerator.is_main_process,
        )
        scored = outcome.scored
        rollout, estimate = scored.rollout, scored.estimate
        self.on_rollout(rollout, estimate.advantage, estimate.diagnostics)
        # No sample with a non-zero advantage on any rank: nothing to learn from; skip the update. TRL
        # buffers this batch's micro-batches until the next generation, so the flag stays on the trainer.
        self._skip_update = not scored.signal and self.skip_update_without_signal
        trl_metrics = self.trl_metrics(rollout, "train", trl_rewards=self.collector.source.uses_reward_funcs)
        metrics = generation_metrics(
            scored, [e for batch in outcome.played for e in batch.rollout.episodes],
            env_metrics=self.collector.env_metrics("train"), trl_metrics=trl_metrics,
            resamples=outcome.attempts if self.args.resample_without_signal else None,
            weight_syncs=self.policy.weight_syncs.count if self.use_vllm else None,
            global_step=self.state.global_step if self._overlap is not None else None,
            skip_without_signal=self.skip_update_without_signal,
        )
        self.record_metrics("train", self._sync.combine(metrics))
        covered = self.args.steps_per_generation * self.num_iterations // self.args.gradient_accumulation_steps
        self.collector.record(rollout, estimate, step=self.state.global_step, covered=covered,
                              completions_log=self.completions_log)
        if self._overlap is not None:
            self._overlap.start_next(inputs)  # the next generation plays while this one trains
        return scored.batch

    def collect(self, tasks: list[TaskRef], prefetched: Prefetched | None = None) -> ScoredRollout:
        """Hook: play `tasks` (or take the `prefetched` rollout of them, `max_staleness=1`) and score it
        (`scoring.score_rollout`: TRL's batch, the estimator's advantages, whether any rank has signal).
        Called for every training generation and each resampling of it; ends with `on_scored`. A
        subclass may wrap it (a bench timing the rollout)."""
        if prefetched is not None:
            played = prefetched.rollout
            self.collector.check_failures(played)  # the guard the foreground collect runs itself
        else:
            played = self.collector.collect("train", tasks, traj_offset=self.accelerator.process_index * len(tasks))
        scored = score_rollout(
            played, self.batch_spec, self.estimator, self._sync, self.hidden_plan, self.args.penalize_env_failures,
            prefetched, advantages_of=self.one_step_advantages(self.num_generations),
        )
        return self.on_scored(scored)

    def on_scored(self, scored: ScoredRollout) -> ScoredRollout:
        """Hook: each scored training rollout (`collect`'s), before the resampling decision and the update;
        returns it or a replacement (`scored._replace(...)`)."""
        return scored

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
        forward = None  # evaluation rollouts capture no hidden states: one pass over the prompts
        if self.hidden_plan.source != "none":
            forward = functools.partial(self.policy.forward_hidden, layer=self.hidden_plan.layer)
        # a copy of the estimator: evaluation must not move the training estimator's ε calibration or call count
        scored = score_rollout(
            played, self.batch_spec, copy.deepcopy(self.estimator), self._sync, HiddenPlan(), self.args.penalize_env_failures,
            forward_hidden=forward, advantages_of=self.one_step_advantages(self.num_generations_eval),
        )
        rollout = scored.rollout
        metrics = {**rollout.metrics(), **scored.estimate.diagnostics, **scored.batch_metrics}
        metrics.update(self.trl_metrics(rollout, "eval", trl_rewards=self.collector.source.uses_reward_funcs))
        self.record_metrics("eval", self._sync.combine(metrics))
        return scored.batch

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
            # No backward: gradients stay None, so the optimizer leaves every parameter (and its moments)
            # untouched. TRL's loss still runs, without gradients, so that its metrics (entropy, kl,
            # clip_ratio/*: 0 with zero advantages) are numbers, as GRPOTrainer logs them. DeepSpeed
            # counts micro-steps inside its backward: there the zero-advantage loss runs as usual.
            with torch.no_grad():
                self.loss_in_pieces(model, inputs)
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        return self.loss_in_pieces(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._sync.any(not bool(torch.isfinite(loss).all())):
            return loss
        raise FloatingPointError(
            f"Non-finite loss ({float(loss)}) at step {self.state.global_step}: stopping before the optimizer "
            "applies it. Lower learning_rate, check the env's rewards, or resume from the last checkpoint "
            f"in {self.args.output_dir}."
        )

    # ------------------------------------------------------------------ evaluation (`evaluation`)

    def eval_task_refs(self, split: str | None = None) -> list[TaskRef]:
        """The rollouts one evaluation of `split` (default `eval_split`) plays."""
        return self.collector.eval_task_refs(split or self.args.eval_split)

    def evaluate_policy(self, tag: str = "manual", split: str | None = None) -> dict[str, Any]:
        """Success rate on the held-out tasks of `split` (default `eval_split`) at `eval_temperature`,
        overall and per task type (`evaluation.play_evaluation`, sampling from `seed`: every evaluation
        draws the same stream, which `bipace-eval OUTPUT_DIR` replays): logged, appended to `eval_history` and
        `<output_dir>/eval_results.json`, and returned. Every rank must call it. The evaluation
        callbacks call it with tag "before", "interval" and "final"; a subclass may override it.
        A "final" result is logged at once (the run is ending), the others with the next training log."""
        if self._overlap is not None:
            self._overlap.join()  # the tokenizer and the envs' workers serve one rollout at a time
        split = split or self.args.eval_split
        self.final_rng = checkpointing.rng_state() if tag == "final" else None  # where a stopped one resumes
        result = evaluation.play_evaluation(
            self.collector, self.eval_task_refs(split), temperature=self.args.eval_temperature,
            step=self.state.global_step, tag=tag, split=split, seed=self.args.seed, model=self.model,
            recorded=evaluation.evaluation_settings(self.args),  # so `bipace-eval OUTPUT_DIR` plays it again
        )
        if result:
            evaluation.keep_result(
                result, self.eval_history, log_now=self.log, log_later=self.metric_buffer("train"),
                output_dir=self.args.output_dir if self.accelerator.is_main_process else None,
            )
        return result

    # ------------------------------------------------------------------ checkpoints and card (`checkpointing`, `model_card`)

    def run_state(self, buffer: dict[str, Any] | None) -> checkpointing.RunState:
        """What a checkpoint saves besides TRL's files (`checkpointing.RunState`); `buffer`: TRL's
        generation when saved mid-generation, with whether its update is skipped."""
        if self._overlap is not None:
            self._overlap.join()  # the prefetched generation is saved with the checkpoint
        return checkpointing.RunState(
            estimator=self.estimator.state_dict(), eval_history=self.eval_history,
            env_counters=self.collector.env_counters("train"),
            buffer=None if buffer is None else {**buffer, "skip_update": self._skip_update},
            prefetched=self._overlap.state_dict() if self._overlap is not None else None,
        )

    def restore_run_state(self, state: checkpointing.RunState) -> None:
        if state.estimator is not None:
            self.estimator.load_state_dict(state.estimator)
            self.eval_history = state.eval_history
        self.collector.resumed_env_counters = state.env_counters or self.collector.resumed_env_counters
        if state.buffer is not None:
            self._skip_update = state.buffer["skip_update"]
        if state.prefetched is not None and self._overlap is not None:  # without max_staleness it plays again, now
            self._overlap.load_state_dict(state.prefetched)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, output_dir=None):
        """The project's card (`model_card.write_model_card`) as `<output_dir>/README.md`."""
        if self.is_world_process_zero():
            write_model_card(
                Path(output_dir or self.args.output_dir), self.args, self.model, model_name, steps=self.state.global_step,
                source=self.collector.source, eps=self.estimator.eps_in_use, eval_history=self.eval_history,
                recipe=getattr(self, "recipe", None), estimator=self.plan.estimator, cluster_layer=self.plan.cluster_layer,
            )

    def close_envs(self) -> None:
        """Stop every env this trainer built (worker threads or processes, engines); call it when done."""
        self.collector.close()
