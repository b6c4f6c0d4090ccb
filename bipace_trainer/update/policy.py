"""`TRLPolicy`: the rollout's `Policy` over TRL's own generation (`GRPOTrainer._generate_single_turn`).

    policy = TRLPolicy(trainer.trl_generation())     # built by the trainer (`update.adapter.GRPOAdapter`)

`TRLGeneration` is the value `GRPOAdapter` hands over: the trainer's methods bound and its settings, what
TRL's generation needs; the rollout sees the `rollout.policy.Policy` interface only.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from transformers import GenerationConfig
from trl.models import unwrap_model_for_generation

from .. import trl_compat
from ..rollout.prefix_cache import PrefixReuse, supports_prefix_reuse
from ..rollout.policy import PolicyBase, all_encoded, vllm_temperature
from ..rollout.vllm_backend import PrefixCacheCounter, WeightSyncs

__all__ = ["TRLGeneration", "TRLPolicy"]


@dataclass
class TRLGeneration:
    """What `TRLPolicy` needs of TRL's `GRPOTrainer`, handed over by the trainer (its own methods
    bound, its settings as values): the seam's one crossing, so nothing in the rollout holds the trainer.
    It stays in `update/`: the rollout sees the `rollout.policy.Policy` members only. The callables are
    what a value cannot carry: TRL's generation and tokenization (its methods), the live model and its
    wrapper (transformers re-wraps them when training starts), the global step and TRL's last pushed
    step (TRL's own vLLM path reads and writes it too), the ZeRO-3/FSDP parameter gathering and TRL's
    profiler (both take the live trainer)."""

    generate_single_turn: Callable  # TRL's `_generate_single_turn(prompt_ids, images, fields, num_generations)`
    tokenize_prompts: Callable  # (chat prompts, environments or None) → TRL's `_tokenize_prompts`, context-fitted
    tokenizer: Any  # the text tokenizer (pad id)
    processing_class: Any  # decodes completions
    model: Callable[[], torch.nn.Module]  # the live model (`trainer.model`)
    model_wrapped: Callable[[], torch.nn.Module]  # what TRL generates through (`trainer.model_wrapped`)
    accelerator: Any  # ranks, the device, `unwrap_model`
    args: Any
    generation_config: GenerationConfig | None  # None under vLLM (TRL builds none)
    generation_kwargs: dict[str, Any] | None
    eos_token_ids: list[int]
    step: Callable[[], int]  # the trainer's global step: the weights' version
    loaded_step: Callable[[int | None], int]  # TRL's `_last_loaded_step`: read (None) or set
    summon_full_params: Callable[[], ContextManager]  # TRL's `_dist.summon_full_params(model_wrapped)`
    profile: Callable[[str], ContextManager]  # TRL's `profiling_context(trainer, name)`
    vllm_generation: Any = None  # TRL's `VLLMGeneration` under use_vllm
    pad_to_multiple_of: int | None = None
    sharded: bool = False  # ZeRO-3 / FSDP: every forward joins all ranks
    continuous_batching: bool = False  # transformers' continuous batching (TRL's use_transformers_continuous_batching)
    multimodal: bool = False


class TRLPolicy(PolicyBase):
    """TRL's generation: `_generate_single_turn` (HF generate or vLLM colocate/server), through
    `PrefixReuse` when `hf_prefix_cache` is on and nothing it would skip is in use, with the sampling
    temperature switchable on either backend; the vLLM engine kept awake across a rollout
    (`WeightSyncs`) and its prefix cache read back (`PrefixCacheCounter`). A whole `rollout.policy.Policy`:
    what the rollout and the overlap's snapshot read are its members, never `trl` (this class's own)."""

    def __init__(self, trl: TRLGeneration):
        self.trl = trl
        self.args = trl.args
        self.accelerator = trl.accelerator
        self.eos_token_ids = trl.eos_token_ids
        self.pad_token_id = trl.tokenizer.pad_token_id
        self.per_forward_rows = trl.args.per_device_train_batch_size
        self.seed = trl.args.seed
        self.tokenizer, self.pad_to_multiple_of = trl.tokenizer, trl.pad_to_multiple_of
        self.use_vllm = trl.vllm_generation is not None
        vllm_mode = getattr(trl.args, "vllm_mode", None)
        # the engine's own continuous batching: colocate without tensor parallelism, or the server's
        self.can_stream = bool(self.use_vllm and (
            vllm_mode == "server" or (vllm_mode == "colocate" and getattr(trl.args, "vllm_tensor_parallel_size", 1) == 1)
        ))
        self.weight_syncs = self.prefix_cache = None
        if self.use_vllm:
            trl_compat.install_cpu_weight_loading(trl.vllm_generation)
            self.weight_syncs = WeightSyncs(trl.vllm_generation)
            self.prefix_cache = PrefixCacheCounter.for_generation(trl.vllm_generation)
            if self.prefix_cache is None and self.can_stream:  # a server: its streamed replies may say
                self.prefix_cache = PrefixCacheCounter()
        self.hf_prefix = self._hf_prefix_reuse()

    # -- what the rollout reads
    @property
    def module(self):
        return self.accelerator.unwrap_model(self.trl.model())

    @property
    def training(self) -> bool:
        return self.trl.model().training

    @property
    def device(self):
        return self.accelerator.device

    @property
    def weight_version(self) -> int:
        return self.trl.step()

    @property
    def vllm_generation(self):
        return self.trl.vllm_generation

    @property
    def generation_config(self) -> GenerationConfig | None:
        """TRL's HF generation config as it is now (the evaluation's temperature inside `sampling`); None under vLLM."""
        return self.trl.generation_config

    def tokenize(self, messages, environments=None):
        return [list(ids) for ids in self.trl.tokenize_prompts(messages, environments)]

    def decode(self, completion_ids):
        return self.trl.processing_class.batch_decode(completion_ids, skip_special_tokens=True)

    # -- the weights
    def push_weights(self, barrier: bool = False) -> None:
        """TRL's `_generate_single_turn` rule: push the weights to vLLM when the training step changed
        (with `barrier`, every rank then waits until the push is done). Nothing to push without vLLM."""
        if not self.use_vllm:
            return
        step = self.trl.step()
        if step == self.trl.loaded_step(None):
            return
        with self.trl.profile("sync_weights"):
            self.trl.vllm_generation.sync_weights()
        self.trl.loaded_step(step)
        if barrier and self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def rollout_scope(self):
        """The engine awake and the weights current for the whole rollout; prefix tallies started afresh."""
        with self.weight_syncs.awake() if self.use_vllm else contextlib.nullcontext(False) as pushed:
            if pushed:  # sleep mode discarded the weights; they are the current step's again
                self.trl.loaded_step(self.trl.step())
            if self.prefix_cache is not None:
                self.prefix_cache.take()  # what calls outside rollouts (scoring probes) left
            if self.hf_prefix is not None:
                self.hf_prefix.take_counts()
            try:
                yield
            finally:
                if self.hf_prefix is not None:
                    self.hf_prefix.clear()  # the stored KV belongs to this rollout's weights

    def prompt_reuse(self, rollout) -> dict[str, int]:
        """vLLM colocate reads its prefix cache back (`PrefixCacheCounter`, dummy calls included); HF `generate`
        with `hf_prefix_cache` counts what `PrefixReuse` prefilled and reused (dummy calls left out), and
        without it prefills every prompt token; vLLM server mode reports what the server stream's replies
        say (nothing call by call, or from a server started without `--enable-prompt-tokens-details`)."""
        if self.prefix_cache is not None:
            engine_side = self.args.vllm_mode == "colocate"
            return self.prefix_cache.take() if engine_side or self.prefix_cache.requests else {}
        if self.hf_prefix is not None:
            return self.hf_prefix.take_counts()
        if self.use_vllm:
            return {}
        return all_encoded(rollout)

    # -- sampling
    @contextlib.contextmanager
    def sampling(self, temperature: float):
        trl = self.trl
        if self.use_vllm:
            with vllm_temperature(trl.vllm_generation, temperature):
                yield
            return
        sampling = {"temperature": temperature or 1.0, "do_sample": temperature > 0}
        saved = {key: getattr(trl.generation_config, key) for key in sampling}
        saved_kwargs = {key: trl.generation_kwargs.get(key) for key in sampling}
        trl.generation_config.update(**sampling)
        trl.generation_kwargs.update(sampling)  # TRL re-applies these inside unwrap_model_for_generation
        try:
            yield
        finally:
            trl.generation_config.update(**saved)
            trl.generation_kwargs.update(saved_kwargs)

    def _sample(self, prompt_ids, capture, real):
        if self.hf_prefix is not None:
            return self._generate_reusing_prefixes(prompt_ids, capture, real), None
        with capture:
            return self.trl.generate_single_turn(prompt_ids, None, {}, num_generations=1)

    def _hf_prefix_reuse(self) -> PrefixReuse | None:
        """`PrefixReuse` when `hf_prefix_cache` is on and nothing in TRL's HF path it would skip is in
        use; otherwise None, with one warning saying why TRL's path is kept."""
        trl, args = self.trl, self.args
        if not getattr(args, "hf_prefix_cache", False) or self.use_vllm:  # vLLM has its own prefix cache
            return None
        config = trl.generation_config
        reasons = [
            (trl.continuous_batching, "use_transformers_continuous_batching is on"),
            (config.cache_implementation is not None, f"cache_implementation={config.cache_implementation!r} is set"),
            (trl.pad_to_multiple_of is not None, "pad_to_multiple_of is set (the stitched batch has its own width)"),
            (trl.sharded, "ZeRO-3/FSDP runs every forward on all ranks together (the shared-prefix "
             "pass runs only where prompts share a prefix)"),
            (trl.multimodal, "the model is multimodal"),
            ((config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1, "beam search / several sequences per prompt"),
            (getattr(config, "prompt_lookup_num_tokens", None) is not None, "prompt lookup decoding is set"),
        ]
        reason = next((why for bad, why in reasons if bad), "") or supports_prefix_reuse(self.module)
        if reason:
            warnings.warn(f"hf_prefix_cache=True is ignored: {reason}; generation goes through TRL's path.", stacklevel=4)
            return None
        return PrefixReuse(store_bytes=args.hf_prefix_cache_store_mb * 2**20)

    def _generate_reusing_prefixes(self, prompt_ids: list[list[int]], capture, real: bool) -> list[list[int]]:
        """TRL's HF branch of `_generate_single_turn` (same unwrapping, generation config and
        kwargs, EOS cut) through `PrefixReuse`. The shared-prefix pass runs before `capture` is
        entered, so the hook sees generate's prefill, whose last column is still every row's last
        prompt token. A dummy call (`real=False`) is neither counted nor remembered."""
        trl, args = self.trl, self.args
        with (
            trl.profile("transformers.generate"),
            unwrap_model_for_generation(
                trl.model_wrapped(), self.accelerator, gather_deepspeed3_params=args.ds3_gather_for_generation,
                generation_kwargs=trl.generation_kwargs, gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            trl.summon_full_params(),
        ):
            prepared = self.hf_prefix.prepare(model, prompt_ids, self.pad_token_id)
            with capture:
                return self.hf_prefix.generate(
                    model, prepared, trl.generation_config, self.eos_token_ids, remember=real, counted=real
                )
