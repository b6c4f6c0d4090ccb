"""The policy the rollout generates with: the one object between the rollout and the weights.

    policy = trainer.policy                                          # TRL's generation (`TRLPolicy`)
    policy = ModelPolicy(model, tokenizer, generation_config)        # a plain model, no trainer (bipace-eval)
    prompt_ids = policy.tokenize(messages)                           # chat prompts → ids, each fitted to the context
    out = policy.generate(prompt_ids, hidden=HiddenPlan("prefill", -8))  # Completions(ids, logprobs, hidden)
    with policy.sampling(temperature=0.4): ...                       # evaluation's sampling settings

The rollout (`collector`, `loop`, `vllm_stream`, `overlap`) sees this interface and never the
trainer, as verl-agent's `multi_turn_loop` is handed a worker group that generates:

- `tokenize(messages, environments)`: chat prompts to token ids (TRL's chat template, each
  environment's tool schema), every prompt cut to fit the context (`fit_to_context`).
- `generate(prompt_ids, hidden)`: completion ids (cut after the first EOS), the sampler's
  log-prob of each completion token where the backend reports it (vLLM), and the hidden
  states at the last prompt token when `hidden` asks for them in the generation itself
  (`HiddenPlan.source == "prefill"`: a hook in generate's prefill; "forward": one extra pass).
- `eos_token_ids`, `pad_token_id`, `decode`, `weight_version` (the optimizer step whose weights
  generate), `training` (a training rollout: hidden states are captured for those only).
- `rollout_scope()`: what a rollout needs held around all its turns (a vLLM engine kept awake,
  weights pushed once), and `prompt_reuse(rollout)`: what the engine encoded vs reused.

`TRLPolicy` is built by `BiPACETrainer` from TRL's own generation (`_generate_single_turn`: HF
generate, vLLM colocate or server) with `TRLGeneration`, a value holding the trainer's methods and
settings the generation needs; `ModelPolicy` generates with a plain causal LM and its tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessorList
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .hidden import HiddenPlan, PrefillCapture, forward_hidden_states
from .prefix_cache import PrefixReuse, supports_prefix_reuse
from .prompting import fit_prompt_ids
from .. import trl_compat
from .vllm_backend import PrefixCacheCounter, WeightSyncs

__all__ = [
    "Completions", "Policy", "ModelPolicy", "VLLMPolicy", "TRLPolicy", "TRLGeneration", "fit_to_context",
    "generation_config_for", "cut_after_eos", "eos_token_ids_of",
]

_CUT_MARKER = "\n[... cut to fit the context ...]\n"


class Completions(NamedTuple):
    """What `Policy.generate` returns for n prompts: n completion id lists, the sampler's log-prob of
    each completion token (None where the backend reports none), and (n, d) hidden states or None."""

    completion_ids: list[list[int]]
    logprobs: list[list[float | None]] | None = None
    hidden: torch.Tensor | None = None
    hidden_seconds: float = 0.0  # the part of the call spent on a pass only for `hidden`


def fit_to_context(prompt_ids: list[list[int]], module: torch.nn.Module, max_completion_length: int, tokenizer) -> list[list[int]]:
    """Each prompt bounded by the model's context minus `max_completion_length` (`prompting.fit_prompt_ids`):
    past it a learned-position model crashes and a RoPE model silently degrades."""
    config = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
    context = getattr(config, "max_position_embeddings", None)
    if not context:
        return prompt_ids
    limit = max(context - max_completion_length, 16)
    if all(len(ids) <= limit for ids in prompt_ids):
        return prompt_ids
    marker = tokenizer.encode(_CUT_MARKER, add_special_tokens=False)
    return [fit_prompt_ids(ids, limit, marker) for ids in prompt_ids]


def generation_config_for(args, tokenizer, eos_token_ids: list[int]) -> GenerationConfig:
    """The `GenerationConfig` TRL's `GRPOTrainer` generates with under HF (its `__init__`'s rule)."""
    kwargs = {
        "max_new_tokens": args.max_completion_length, "do_sample": True, "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_token_ids, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
        "cache_implementation": args.cache_implementation,
    }
    kwargs.update(args.generation_kwargs or {})
    return GenerationConfig(**kwargs, disable_compile=True)


def cut_after_eos(completions: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row of (B, T) `completions` up to and including its first EOS, as TRL cuts them."""
    is_eos = torch.isin(completions, torch.tensor(eos_token_ids, device=completions.device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completions.device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    keep = torch.arange(is_eos.size(1), device=completions.device).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
    return [c[m].tolist() for c, m in zip(completions.cpu(), keep.cpu())]


def _all_encoded(rollout) -> dict[str, int]:
    """The prefix counts of an HF `generate` that prefilled every prompt token (nothing reused)."""
    return {"prompt_tokens_encoded": rollout.prompt_counts.get("prompt_tokens", 0), "prompt_tokens_reused": 0}


class Policy:
    """The interface the rollout generates through; see the module docstring. Subclasses set
    `eos_token_ids`, `pad_token_id`, `device` and implement `module`, `tokenize`, `decode`, `_sample`."""

    use_vllm = False
    eos_token_ids: list[int]
    pad_token_id: int
    per_forward_rows = 8  # rows per extra hidden-state pass ("forward")

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped model whose layers hidden states are read from."""
        raise NotImplementedError

    @property
    def training(self) -> bool:
        """A training rollout (hidden states are captured for these only)."""
        return self.module.training

    @property
    def weight_version(self) -> int:
        """The optimizer step whose weights generate (0 for a plain model)."""
        return 0

    def tokenize(self, messages: list, environments: list[Hashable] | None = None) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, completion_ids: list[list[int]]) -> list[str]:
        raise NotImplementedError

    def sampling(self, temperature: float) -> ContextManager:
        """Sample at `temperature` (0 = greedy) inside the block."""
        raise NotImplementedError

    def rollout_scope(self) -> ContextManager:
        """Held around a whole rollout; nothing for a plain model."""
        return contextlib.nullcontext()

    def prompt_reuse(self, rollout) -> dict[str, int]:
        """Prompt tokens encoded vs reused in the rollout just played: HF generate prefills every one."""
        return _all_encoded(rollout)

    def _sample(self, prompt_ids: list[list[int]], capture: ContextManager, real: bool) -> tuple[list[list[int]], Any]:
        """(completion ids, logprobs or None) of one generate call, run with `capture` entered around it."""
        raise NotImplementedError

    def generate(self, prompt_ids: list[list[int]], hidden: HiddenPlan | None = None, real: bool = True) -> Completions:
        """One generate call; hidden states when `hidden` says the generation captures them.
        `real=False`: a dummy call that only keeps ranks in step (not counted, not remembered)."""
        hook = hidden is not None and hidden.source == "prefill"
        capture = PrefillCapture(self.module, hidden.layer) if hook else contextlib.nullcontext()
        completion_ids, logprobs = self._sample(prompt_ids, capture, real)
        states, seconds = (capture.states if hook else None), 0.0
        if hidden is not None and hidden.source == "forward":
            start = time.perf_counter()
            states = self.forward_hidden(prompt_ids, hidden.layer)
            seconds = time.perf_counter() - start  # the rollout reports it apart from generation
        return Completions(completion_ids, logprobs, states, seconds)

    def forward_hidden(self, prompt_ids: list[list[int]], layer: int) -> torch.Tensor:
        """hidden_states[layer] at the last prompt token by one no-grad pass (`hidden_capture="forward"`)."""
        module = self.module
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=self.pad_token_id, padding_side="left").to(self.device)
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(self.device)
        was_training = module.training
        module.eval()
        try:
            return forward_hidden_states(module, input_ids, mask, layer, self.per_forward_rows)
        finally:
            module.train(was_training)


class ModelPolicy(Policy):
    """A plain causal LM and its tokenizer, generating one turn as TRL's HF `_generate_single_turn` does
    (left-padded prompts, `generation_config`, completions cut after the first EOS). No trainer, no
    optimizer: what `bipace-eval` plays a checkpoint with. `logits_processor` is passed to `generate`.

    Args:
        model: a causal LM (a `PeftModel` works); its device is the policy's.
        tokenizer: with a chat template; `pad_token_id` is its own.
        generation_config: what `generate` samples with (`generation_config_for` builds TRL's).
        max_completion_length: the context left for the reply when prompts are fitted (0: the config's).
    """

    def __init__(self, model, tokenizer, generation_config: GenerationConfig, max_completion_length: int = 0,
                 pad_to_multiple_of: int | None = None, per_forward_rows: int = 8, eos_token_ids: list[int] | None = None):
        self._module = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        eos = generation_config.eos_token_id if generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids or (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        self.pad_token_id = tokenizer.pad_token_id
        self.max_completion_length = max_completion_length or generation_config.max_new_tokens or 0
        self.pad_to_multiple_of = pad_to_multiple_of
        self.per_forward_rows = per_forward_rows
        self.logits_processor: LogitsProcessorList | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def device(self) -> torch.device:
        return next(self._module.parameters()).device

    def tokenize(self, messages, environments=None):
        tokenized = self.tokenizer.apply_chat_template(
            conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = [list(ids) for ids in tokenized["input_ids"]]
        return fit_to_context(ids, self._module, self.max_completion_length, self.tokenizer)

    def decode(self, completion_ids):
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    @contextlib.contextmanager
    def sampling(self, temperature: float):
        saved = self.generation_config
        self.generation_config = copy.deepcopy(saved)
        self.generation_config.update(temperature=temperature or 1.0, do_sample=temperature > 0)
        try:
            yield
        finally:
            self.generation_config = saved

    def _sample(self, prompt_ids, capture, real):
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=self.pad_token_id, padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
                   pad_to_multiple_of=self.pad_to_multiple_of)
        processors = self.logits_processor or LogitsProcessorList()
        was_training = self._module.training
        self._module.eval()
        try:
            with torch.no_grad(), capture:
                output = self._module.generate(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                    generation_config=self.generation_config, logits_processor=processors,
                )
        finally:
            self._module.train(was_training)
        return cut_after_eos(output[:, input_ids.size(1):], self.eos_token_ids), None


class VLLMPolicy(ModelPolicy):
    """A plain model served by TRL's `VLLMGeneration` (colocate or server), with no trainer: what
    `bipace-eval --use_vllm` plays with. The model's weights are pushed to the engine before the first
    generation (an adapter is merged by TRL's `sync_weights`); each completion token keeps the
    sampler's log-prob (top-1, as TRL's `_generate_single_turn`)."""

    use_vllm = True

    def __init__(self, generation, model, tokenizer, max_completion_length: int, eos_token_ids: list[int]):
        config = GenerationConfig(max_new_tokens=max_completion_length, eos_token_id=eos_token_ids)
        super().__init__(model, tokenizer, config, max_completion_length, eos_token_ids=eos_token_ids)
        trl_compat.install_cpu_weight_loading(generation)
        self.vllm_generation = generation
        self.pushed = False

    @contextlib.contextmanager
    def sampling(self, temperature: float):
        saved = self.vllm_generation.temperature
        self.vllm_generation.temperature = max(temperature, 1e-5)  # vLLM has no do_sample switch
        try:
            yield
        finally:
            self.vllm_generation.temperature = saved

    def prompt_reuse(self, rollout) -> dict[str, int]:
        return {}  # the engine's prefix cache is its own business here

    def _sample(self, prompt_ids, capture, real):
        if not self.pushed:
            self.vllm_generation.sync_weights()
            self.pushed = True
        with capture:
            _, completion_ids, logprobs, _ = self.vllm_generation.generate(prompts=prompt_ids, images=None, num_generations=1)
        return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]


def eos_token_ids_of(model, tokenizer) -> list[int]:
    """Every eos id the model declares (an end-of-turn token too), the tokenizer's first: TRL's rule."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return declared if tokenizer.eos_token_id in declared else [tokenizer.eos_token_id, *declared]


@dataclass
class TRLGeneration:
    """What `TRLPolicy` needs of TRL's `GRPOTrainer`, handed over by the trainer (its own methods
    bound, its settings as values): the seam's one crossing, so nothing in the rollout holds the trainer."""

    generate_single_turn: Callable  # TRL's `_generate_single_turn(prompt_ids, images, fields, num_generations)`
    tokenize_prompts: Callable  # (chat prompts, environments or None) → TRL's `_tokenize_prompts`, context-fitted
    tokenizer: Any  # the text tokenizer (pad id)
    processing_class: Any  # decodes completions
    model: Callable[[], torch.nn.Module]  # the live model (`trainer.model`)
    model_wrapped: Callable[[], torch.nn.Module]  # what TRL generates through (`trainer.model_wrapped`)
    unwrap: Callable[[torch.nn.Module], torch.nn.Module]  # accelerator.unwrap_model
    accelerator: Any
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


class TRLPolicy(Policy):
    """TRL's generation: `_generate_single_turn` (HF generate or vLLM colocate/server), through
    `PrefixReuse` when `hf_prefix_cache` is on and nothing it would skip is in use, with the sampling
    temperature switchable on either backend; the vLLM engine kept awake across a rollout
    (`WeightSyncs`) and its prefix cache read back (`PrefixCacheCounter`)."""

    def __init__(self, trl: TRLGeneration):
        self.trl = trl
        self.args = trl.args
        self.accelerator = trl.accelerator
        self.eos_token_ids = trl.eos_token_ids
        self.pad_token_id = trl.tokenizer.pad_token_id
        self.per_forward_rows = trl.args.per_device_train_batch_size
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
        return self.trl.unwrap(self.trl.model())

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

    def profile(self, name: str) -> ContextManager:
        return self.trl.profile(name)

    def tokenize(self, messages, environments=None):
        return [list(ids) for ids in self.trl.tokenize_prompts(messages, environments)]

    def decode(self, completion_ids):
        return self.trl.processing_class.batch_decode(completion_ids, skip_special_tokens=True)

    # -- the weights
    def push_weights(self, barrier: bool = False) -> None:
        """TRL's `_generate_single_turn` rule: push the weights to vLLM when the training step changed
        (with `barrier`, every rank then waits until the push is done)."""
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
        return _all_encoded(rollout)

    # -- sampling
    @contextlib.contextmanager
    def sampling(self, temperature: float):
        trl = self.trl
        if self.use_vllm:
            saved = trl.vllm_generation.temperature
            trl.vllm_generation.temperature = max(temperature, 1e-5)  # vLLM has no do_sample switch
            try:
                yield
            finally:
                trl.vllm_generation.temperature = saved
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
