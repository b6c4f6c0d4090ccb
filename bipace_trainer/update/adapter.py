"""`GRPOAdapter`: the one class that reads and writes `GRPOTrainer`'s private state.

`BiPACETrainer` (`trainer.py`) subclasses it and reads as collect → estimate → TRL's loss. This class is
what the trainer takes of TRL and hands back to it, as values and bound methods:

- what the rollout gets of TRL's generation, batch settings and tool-env setup (`trl_generation`,
  `trl_batch_spec`, `tool_env_setup`: `update.policy.TRLGeneration` and the others name each field);
- TRL's tokenization, each prompt bounded by the model's context (`_tokenize_prompts`);
- GRPOTrainer's own advantage for one-step episodes (`one_step_advantages`);
- TRL's loss over a micro-batch in pieces, each shared prefix forwarded once (`loss_in_pieces`,
  `_get_per_token_logps_and_entropies`, `shared_prefix.py`);
- TRL's token count and metric buffers (`metrics`, `record_metrics`, `metric_buffer`);
- TRL's checkpoint written atomically with the run's own state, and TRL's mid-generation buffer
  (`_save_checkpoint`, `_load_optimizer_and_scheduler`: the subclass gives `run_state` and takes
  `restore_run_state`).

When a TRL release renames one of GRPOTrainer's internals, this module and `trl_compat.py` (the
patches) are where it shows: tests/test_seam.py keeps every other module, `trainer.py` included, off them.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from .. import trl_compat
from .micro_batches import combine_metrics, length_order, loss_in_pieces, piece_weights, take_rows
from ..rollout.collector import sharded_forward
from ..rollout.loop import Rollout
from ..rollout.policy import fit_to_context
from ..rollout.tool_envs import ToolEnvSetup
from ..run import checkpointing
from .batching import TRLBatchSpec
from .metrics import generation_trl_metrics
from .one_step import one_step_estimate
from .policy import TRLGeneration

__all__ = ["GRPOAdapter"]


class GRPOAdapter(GRPOTrainer):
    """GRPOTrainer with its internals handed out as values (module docstring). Not used alone."""

    # with `shared_prefix` on, the subclass's `SharedPrefixForward`
    shared_prefix = None
    # plain prompts: one-step episodes, given GRPOTrainer's own advantage (the subclass decides)
    one_step = False
    # True while a checkpoint is written: a SIGTERM then waits for it (`callbacks.GracefulStopCallback`)
    saving_checkpoint = False
    final_rng: dict[str, Any] | None = None  # the generators as the final evaluation began (`save_stopped_end`)
    _checkpoint_staging: str | None = None

    # ------------------------------------------------------------------ TRL's seam for a custom rollout

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's one seam for a custom rollout: the subclass's public `generate_and_score`."""
        return self.generate_and_score(inputs)

    def generate_and_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError("a GRPOAdapter subclass plays and scores a generation batch here")

    # ------------------------------------------------------------------ what the rollout gets

    @property
    def sharded_forward(self) -> bool:
        """ZeRO-3 or FSDP: every forward joins all ranks."""
        return sharded_forward(self.accelerator, getattr(self, "is_fsdp_enabled", False))

    def cap_turns(self, max_turn_length: int | None) -> None:
        """Each generate call's cap is `max_turn_length` (None: `max_completion_length`, TRL's
        setting of both backends); TRL's envs also cap the episode (`tool_envs`)."""
        if max_turn_length is None or max_turn_length == self.max_completion_length:
            return
        if self.use_vllm:
            self.vllm_generation.max_completion_length = max_turn_length
        else:
            self.generation_config.max_new_tokens = max_turn_length
            self.generation_kwargs["max_new_tokens"] = max_turn_length

    def trl_generation(self) -> TRLGeneration:
        """TRL's generation as `TRLPolicy` uses it: this trainer's methods bound, its settings as values."""

        def loaded_step(step: int | None) -> int:
            if step is not None:
                self._last_loaded_step = step
            return self._last_loaded_step

        return TRLGeneration(
            generate_single_turn=self._generate_single_turn, tokenize_prompts=self._tokenize_for,
            tokenizer=self._tokenizer, processing_class=self.processing_class, model=lambda: self.model,
            model_wrapped=lambda: self.model_wrapped, accelerator=self.accelerator,
            args=self.args,  # TRL builds the two generation settings only without vLLM
            generation_config=None if self.use_vllm else self.generation_config,
            generation_kwargs=None if self.use_vllm else self.generation_kwargs,
            eos_token_ids=self.eos_token_ids, step=lambda: self.state.global_step, loaded_step=loaded_step,
            summon_full_params=lambda: self._dist.summon_full_params(self.model_wrapped, recurse=False),
            profile=lambda name: profiling_context(self, name), vllm_generation=self.vllm_generation if self.use_vllm else None,
            pad_to_multiple_of=self.pad_to_multiple_of, sharded=self.sharded_forward,
            continuous_batching=bool(self.use_transformers_continuous_batching), multimodal=bool(getattr(self, "_is_vlm", False)),
        )

    def trl_batch_spec(self, mask_cut_episodes: bool) -> TRLBatchSpec:
        """What TRL's batch takes of this trainer (`batching.training_batch`); `mask_cut_episodes`: TRL's
        `mask_truncated_completions` applies to whole episodes (TRL's envs, whose episode is one completion)."""
        spec = TRLBatchSpec(
            args=self.args, accelerator=self.accelerator, pad_token_id=self._tokenizer.pad_token_id,
            eos_token_ids=self.eos_token_ids, mask_truncated_completions=self.mask_truncated_completions,
            num_iterations=self.num_iterations, use_vllm=self.use_vllm,
            vllm_importance_sampling_correction=getattr(self, "vllm_importance_sampling_correction", False),
            vllm_importance_sampling_mode=getattr(self, "vllm_importance_sampling_mode", "sequence_mask"),
            vllm_importance_sampling_clip_min=getattr(self, "vllm_importance_sampling_clip_min", None),
            vllm_importance_sampling_clip_max=getattr(self, "vllm_importance_sampling_clip_max", None),
            beta=self.beta, per_token_logps=self._get_per_token_logps_and_entropies, model=lambda: self.model,
            ref_model=self.ref_model,
        )
        spec.mask_cut_episodes = bool(self.mask_truncated_completions and mask_cut_episodes)
        return spec

    def tool_env_setup(self, num_user_rewards: int) -> ToolEnvSetup:
        """What playing TRL's envs takes of what `GRPOTrainer.__init__` set up (`tool_envs.ToolEnvSetup`)."""

        def take_reward_logs() -> tuple[dict, dict]:
            pending, extra = getattr(self, "_pending_metrics", {}), getattr(self, "_pending_extra_logs", {})
            taken = dict(pending), dict(extra)
            pending.clear()
            extra.clear()
            return taken

        return ToolEnvSetup(  # plain prompts: GRPOTrainer sets no tool attributes
            environment_factories=self.environment_factories,
            multi_environment=bool(getattr(self, "_multi_environment", False)),
            standalone_tools=list(getattr(self, "_standalone_tools", [])), env_tools=getattr(self, "_env_tools", {}),
            tools=self.tools,
            tokenizer=self._tokenizer, max_tool_calling_iterations=self.max_tool_calling_iterations,
            num_reward_funcs=len(self.reward_funcs), reward_func_names=list(self.reward_func_names),
            reward_weights=self.reward_weights, take_reward_logs=take_reward_logs,
            user_rewards=functools.partial(self._rank_local_rewards, num_user_rewards),
            max_completion_length=self.max_completion_length, tool_suffix_ids=self._get_tool_suffix_ids,
        )

    def _rank_local_rewards(self, k: int, rows, prompts, completions, completion_ids, environments) -> torch.Tensor:
        """The first `k` reward functions (the user's), unweighted, (n, k), by TRL's `_calculate_rewards` on
        this rank's rows alone: TRL's method ends by gathering over ranks, which assumes every rank scores
        as many rows at once; an evaluation's shards differ or are empty, so that gather is left out."""
        saved = self.reward_funcs, self.reward_func_names, self.reward_processing_classes, self.environments
        self.reward_funcs, self.reward_func_names, self.reward_processing_classes = saved[0][:k], saved[1][:k], saved[2][:k]
        if self.environment_factories is not None:  # as TRL: reward functions see `environments` only then
            self.environments = environments
        try:
            with trl_compat.rank_local_gather():
                return self._calculate_rewards(rows, prompts, completions, completion_ids)
        finally:
            self.reward_funcs, self.reward_func_names, self.reward_processing_classes, self.environments = saved

    def _tokenize_for(self, messages: list, environments: list | None) -> list[list[int]]:
        """TRL's tokenization of chat prompts, each rendered with its environment's tool schema."""
        if environments is not None:  # TRL renders each prompt with its env's tool schema
            self._batch_environments = environments
        return self._tokenize_prompts(messages)[0]

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then each prompt bounded by the model's context minus one reply's cap
        (`max_turn_length`, else `max_completion_length`; `policy.fit_to_context`)."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        module = self.accelerator.unwrap_model(self.model)
        reply = self.args.max_turn_length or self.args.max_completion_length
        return (fit_to_context(prompt_ids, module, reply, self._tokenizer), *rest)

    def one_step_advantages(self, group_size: int) -> Callable | None:
        """GRPOTrainer's own advantage of one-step episodes (plain prompts), over every rank's rows as
        TRL gathers them (`one_step.one_step_estimate`); None unless `one_step`."""
        if not self.one_step:
            return None
        accelerator = self.accelerator
        gather = (lambda rows: accelerator.gather(rows.to(accelerator.device)).cpu()) if accelerator.num_processes > 1 else None
        return functools.partial(
            one_step_estimate, reward_func_names=self.reward_func_names, reward_weights=self.reward_weights,
            group_size=group_size, scale_rewards=self.args.scale_rewards, aggregation=self.args.multi_objective_aggregation,
            gather=gather, rank=accelerator.process_index,
        )

    # ------------------------------------------------------------------ TRL's loss

    def loss_in_pieces(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss over a micro-batch, in pieces of at most `per_device_train_batch_size` rows
        (with `shared_prefix`, cut in token order where that pays), logging what TRL's loss logs over
        the whole micro-batch (`micro_batches.combine_metrics`)."""
        size = self.args.per_device_train_batch_size
        plain = length_order(inputs, size)
        runs = self.shared_prefix.pieces(inputs, plain) if self.shared_prefix is not None else None
        pieces = take_rows(inputs, plain if runs is None else runs)
        if len(pieces) == 1:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # A micro-batch holds one row per env step, up to max_turns times the rows TRL planned for: the
        # loss runs piece by piece, so activation memory is bounded by per_device_train_batch_size rows.
        loss = functools.partial(super().compute_loss, model)
        weights = piece_weights(pieces, self.loss_type)
        metrics = self._metrics["train" if self.model.training else "eval"]
        logged = {key: len(values) for key, values in metrics.items()}
        result = loss_in_pieces(
            pieces, weights, loss, self._backward_piece, functools.partial(self.accelerator.no_sync, model),
            torch.is_grad_enabled(), self.accelerator.device,
        )
        self._combine_piece_metrics(metrics, logged, pieces, weights)
        return result

    def _combine_piece_metrics(self, metrics: dict[str, list], logged: dict[str, int], pieces, weights) -> None:
        """Replace what TRL's loss logged once per piece by one value over the micro-batch (`combine_metrics`:
        token means weighted by every rank's completion tokens of each piece)."""
        new = {key: values[logged.get(key, 0):] for key, values in metrics.items()}
        new = {key: values for key, values in new.items() if len(values) == len(pieces)}
        masks = [p["completion_mask"] * p["tool_mask"] if "tool_mask" in p else p["completion_mask"] for p in pieces]
        counts = torch.tensor([[float(m.sum()) for m in masks], [float(m.size(0)) for m in masks]],
                              device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # every rank has as many pieces (`loss_in_pieces`)
            counts = self.accelerator.reduce(counts, reduction="sum")
        tokens, rows = counts.tolist()
        combined = combine_metrics(new, tokens, rows, weights, self.importance_sampling_level == "sequence")
        for key, value in combined.items():
            del metrics[key][logged.get(key, 0):]
            metrics[key].append(value)

    def _backward_piece(self, loss: torch.Tensor) -> None:
        if self.is_deepspeed_enabled:  # accumulate without DeepSpeed's optimizer step
            self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's, or the same values with each shared prefix forwarded once (`shared_prefix.py`)."""
        trl = super()._get_per_token_logps_and_entropies

        def plain(m=model, ids=input_ids, mask=attention_mask):
            return trl(m, ids, mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra)

        shared = self.shared_prefix
        if shared is None or not shared.applies(compute_aux_loss, extra, compute_entropy):
            return plain()
        return shared.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                          compute_entropy, plain)

    def train(self, *args, **kwargs):
        """TRL's `train`, inside what the shared-prefix forward needs (SDPA models: `packed_attention.routed`)."""
        with self.shared_prefix.scope() if self.shared_prefix is not None else contextlib.nullcontext():
            return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ TRL's metrics

    def trl_metrics(self, rollout: Rollout, mode: str, trl_rewards: bool) -> dict[str, float]:
        """GRPOTrainer's own metrics of this generation, by episode (`update.metrics`), and its token counts:
        TRL's `num_tokens` (the running total of prompt and model-generated tokens, as TRL counts them:
        `metrics.trl_token_count`) and ours, `rollout/tokens_processed` (every token the model read
        or wrote, once: tool results too) and `rollout/tokens_all_turns` (every turn's prompt whole).
        `trl_rewards`: scored by TRL's `reward_funcs` (else by the env, TRL's `env_reward`)."""
        names = self.reward_func_names if trl_rewards else ["env_reward"]
        metrics, tokens = generation_trl_metrics(
            rollout, names, [*self.eos_token_ids, self._tokenizer.pad_token_id], self.accelerator,
            single_source=None if trl_rewards else names[0], failed_scored=self.args.penalize_env_failures,
            tools=bool(self.tools),
        )
        if mode == "train":  # as TRL: evaluation tokens are not "seen"
            self.state.num_input_tokens_seen += tokens["trl"]
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]  # TRL's: the running total
        return {**metrics, "rollout/tokens_processed": float(tokens["processed"]),
                "rollout/tokens_all_turns": float(tokens["all_turns"])}

    def metric_buffer(self, mode: str) -> dict[str, list]:
        """TRL's buffer of `mode`'s metrics, averaged into its next log."""
        return self._metrics[mode]

    def record_metrics(self, mode: str, metrics: dict[str, float]) -> None:
        """Append each metric (combined over ranks already) to TRL's buffer of `mode`."""
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    @property
    def completions_log(self) -> dict | None:
        """TRL's log of sampled completions (`log_completions`), or None when off."""
        return self._logs if self.log_completions else None

    # ------------------------------------------------------------------ TRL's checkpoint

    def run_state(self, buffer: dict[str, Any] | None) -> checkpointing.RunState:
        """What a checkpoint saves besides TRL's files, with TRL's mid-generation `buffer` (subclass)."""
        raise NotImplementedError

    def restore_run_state(self, state: checkpointing.RunState) -> None:
        """Take back what `run_state` gave (subclass); TRL's buffer is restored already."""
        raise NotImplementedError

    def _get_output_dir(self, trial):
        return self._checkpoint_staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, written atomically with the run's own state (`checkpointing.save_atomically`)."""

        def trl_save(staging: Path) -> None:  # TRL's save, its output folder pointed at the staging folder
            self._checkpoint_staging = str(staging)
            try:
                super(GRPOAdapter, self)._save_checkpoint(model, trial)
            finally:
                self._checkpoint_staging = None

        generate_every = self.args.steps_per_generation * self.num_iterations
        buffer = None
        if self._step % generate_every and self._buffered_inputs is not None:  # saved mid-generation
            buffer = {"step": self._step, "buffered_inputs": self._buffered_inputs}
        state = self.run_state(buffer)
        self.saving_checkpoint = True
        try:
            checkpointing.save_atomically(
                Path(super()._get_output_dir(trial)), state, trl_save, accelerator=self.accelerator,
                args=self.args, step=self.state.global_step, best_model_checkpoint=self.state.best_model_checkpoint,
                model_name=getattr(self.model.config, "name_or_path", "") or "",
            )
        finally:
            self.saving_checkpoint = False

    def save_model(self, output_dir=None, _internal_call=False):
        """Transformers' save, then the subclass's card (`create_model_card`) over the blank one PEFT writes next to
        an adapter (a checkpoint keeps PEFT's); into output_dir written atomically (`checkpointing.save_final_model`)."""
        target = Path(output_dir or self.args.output_dir)
        if _internal_call and target != Path(self.args.output_dir):  # a checkpoint's staging folder
            return super().save_model(output_dir, _internal_call)

        def write(folder: Path) -> None:
            super(GRPOAdapter, self).save_model(str(folder), _internal_call)
            self.create_model_card(output_dir=folder)

        checkpointing.save_final_model(target, write, accelerator=self.accelerator)

    def save_stopped_end(self) -> None:
        """A SIGTERM stopped the final evaluation (`final_rng` taken as it began): without a checkpoint of this
        step the trained weights would be lost, so one is saved, with the generators as they were when that
        evaluation began; resumed, the run trains nothing and plays the final evaluation the uninterrupted
        run played."""
        step = self.state.global_step
        if self.final_rng is None or (Path(self.args.output_dir) / f"checkpoint-{step}").is_dir():
            return
        checkpointing.set_rng_state(self.final_rng)
        self._save_checkpoint(self.model, trial=None)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.state.global_step >= self.state.max_steps > 0:
            # resumed at its end (`get_batch_samples` trains nothing): transformers restores the generators only
            # when its epoch loop runs; the final evaluation must start where the uninterrupted run's did
            self._load_rng_state(checkpoint)
        state = checkpointing.load_run_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
        if state is None:
            return
        if state.buffer is not None:
            self._step, self._buffered_inputs = state.buffer["step"], state.buffer["buffered_inputs"]
        self.restore_run_state(state)

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, reseeded per epoch so that a resumed run draws the same task order."""
        return checkpointing.EpochSeededRepeatSampler.like(super()._get_train_sampler(dataset))
