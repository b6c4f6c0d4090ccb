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
- optional capabilities, typed members of every policy (None or False where absent): `can_stream`
  and `vllm_generation`, `push_weights`, `prefix_cache`, `seed` (a streamed rollout, `vllm_stream`),
  `weight_syncs` (vLLM's counted weight pushes), and `tokenizer`, `generation_config`,
  `pad_to_multiple_of` (what a snapshot of the weights generates with, `update.overlap`).

`Policy` is a `typing.Protocol` (runtime-checkable: tests/rollout/test_collector_values.py checks every
concrete policy against it); `PolicyBase` is the shared implementation.

`TRLPolicy` is built by `BiPACETrainer` from TRL's own generation (`_generate_single_turn`: HF
generate, vLLM colocate or server) with `TRLGeneration`, a value holding the trainer's methods and
settings the generation needs; `ModelPolicy` generates with a plain causal LM and its tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import TYPE_CHECKING, Any, ContextManager, Hashable, Mapping, NamedTuple, Protocol, runtime_checkable

import torch
from transformers import GenerationConfig, LogitsProcessorList
from trl.trainer.utils import pad

from .hidden import HiddenPlan, PrefillCapture, forward_hidden_states
from .prompting import fit_prompt_ids
from .. import trl_compat

if TYPE_CHECKING:
    from .vllm_backend import PrefixCacheCounter, WeightSyncs

__all__ = [
    "Completions", "Policy", "PolicyBase", "ModelPolicy", "VLLMPolicy", "fit_to_context", "generation_config_for",
    "SAMPLING_FIELDS", "cut_after_eos",
    "eos_token_ids_of", "all_encoded", "vllm_temperature",
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


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation", "generation_kwargs")


def generation_config_for(
    sampling: Mapping[str, Any], tokenizer, eos_token_ids: list[int], max_new_tokens: int
) -> GenerationConfig:
    """The `GenerationConfig` TRL's `GRPOTrainer` generates with under HF (its `__init__`'s rule), from
    `sampling`: the values of `SAMPLING_FIELDS` (GRPOConfig's fields of those names)."""
    kwargs = {name: sampling[name] for name in SAMPLING_FIELDS if name != "generation_kwargs"}
    kwargs.update(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_token_ids,
    )
    kwargs.update(sampling.get("generation_kwargs") or {})
    return GenerationConfig(**kwargs, disable_compile=True)


def cut_after_eos(completions: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row of (B, T) `completions` up to and including its first EOS, as TRL cuts them."""
    is_eos = torch.isin(completions, torch.tensor(eos_token_ids, device=completions.device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completions.device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    keep = torch.arange(is_eos.size(1), device=completions.device).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
    return [c[m].tolist() for c, m in zip(completions.cpu(), keep.cpu())]


@contextlib.contextmanager
def vllm_temperature(generation, temperature: float):
    """TRL's `VLLMGeneration` samples at `temperature` for the scope (vLLM has no do_sample switch: 0 is 1e-5)."""
    saved = generation.temperature
    generation.temperature = max(temperature, 1e-5)
    try:
        yield
    finally:
        generation.temperature = saved


def all_encoded(rollout) -> dict[str, int]:
    """The prefix counts of an HF `generate` that prefilled every prompt token (nothing reused)."""
    return {"prompt_tokens_encoded": rollout.prompt_counts.get("prompt_tokens", 0), "prompt_tokens_reused": 0}


@runtime_checkable
class Policy(Protocol):
    """The interface the rollout generates through; see the module docstring. Every policy has every
    member: an optional capability a policy lacks is None or False, never a missing attribute.
    `PolicyBase` implements the shared part (`generate`, `forward_hidden`) and the absent capabilities."""

    use_vllm: bool
    eos_token_ids: list[int]
    pad_token_id: int
    per_forward_rows: int  # rows per extra hidden-state pass ("forward")
    seed: int  # the run's seed: a streamed rollout's per-request seeds derive from it (`vllm_stream.request_seed`)
    # optional capabilities (None / False where absent)
    can_stream: bool  # rollouts may go through the engine's own continuous batching (`vllm_stream.StreamTurns`)
    vllm_generation: Any  # TRL's `VLLMGeneration` generating under vLLM (streams and `bipace-eval` read it), or None
    weight_syncs: WeightSyncs | None  # the engine's weight pushes, counted (vLLM)
    prefix_cache: PrefixCacheCounter | None  # the engine's prefix-cache tallies (vLLM)
    # what a snapshot of the weights generates with (`update.overlap.SnapshotPolicy`); None under vLLM
    tokenizer: Any
    generation_config: GenerationConfig | None
    pad_to_multiple_of: int | None

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped model whose layers hidden states are read from."""
        ...

    @property
    def training(self) -> bool:
        """A training rollout (hidden states are captured for these only)."""
        ...

    @property
    def weight_version(self) -> int:
        """The optimizer step whose weights generate (0 for a plain model)."""
        ...

    @property
    def device(self) -> torch.device: ...

    def tokenize(self, messages: list, environments: list[Hashable] | None = None) -> list[list[int]]: ...

    def decode(self, completion_ids: list[list[int]]) -> list[str]: ...

    def sampling(self, temperature: float) -> ContextManager:
        """Sample at `temperature` (0 = greedy) inside the block."""
        ...

    def rollout_scope(self) -> ContextManager:
        """Held around a whole rollout (a vLLM engine kept awake, weights pushed once)."""
        ...

    def prompt_reuse(self, rollout) -> dict[str, int]:
        """Prompt tokens encoded vs reused in the rollout just played."""
        ...

    def generate(self, prompt_ids: list[list[int]], hidden: HiddenPlan | None = None, real: bool = True) -> Completions:
        """One generate call; hidden states when `hidden` says the generation captures them."""
        ...

    def forward_hidden(self, prompt_ids: list[list[int]], layer: int) -> torch.Tensor: ...

    def push_weights(self, barrier: bool = False) -> None:
        """The engine's weights made the current step's (vLLM; nothing elsewhere)."""
        ...


class PolicyBase:
    """What every `Policy` shares: `generate` (one `_sample` call, hidden states as `HiddenPlan` asks),
    `forward_hidden`, and no optional capability. Subclasses set `eos_token_ids`, `pad_token_id`,
    `tokenizer`, `generation_config` and implement `module`, `device`, `tokenize`, `decode`, `sampling`, `_sample`."""

    use_vllm = False
    per_forward_rows = 8
    seed = 0
    can_stream = False
    vllm_generation = None
    weight_syncs: WeightSyncs | None = None
    prefix_cache: PrefixCacheCounter | None = None
    pad_to_multiple_of: int | None = None
    eos_token_ids: list[int]
    pad_token_id: int

    @property
    def training(self) -> bool:
        return self.module.training

    @property
    def weight_version(self) -> int:
        return 0

    def rollout_scope(self) -> ContextManager:
        """Nothing to hold for a plain model."""
        return contextlib.nullcontext()

    def prompt_reuse(self, rollout) -> dict[str, int]:
        """HF generate prefills every prompt token."""
        return all_encoded(rollout)

    def push_weights(self, barrier: bool = False) -> None:
        """No engine: the weights generate where they are."""

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


class ModelPolicy(PolicyBase):
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

    def sampling(self, temperature: float):
        return vllm_temperature(self.vllm_generation, temperature)

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
