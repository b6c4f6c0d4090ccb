"""The continuous rollout through vLLM's own continuous batching (colocate, one engine per rank).

    stream = StreamTurns(trainer, tokenize, prefix_cache, name="train")    # the collector builds it
    rollout = run_rollouts(envs, tasks, stream, settings)                  # continuous, engine level

TRL's colocate generation is one blocking `LLM.generate` per call: the engine batches the
call's requests continuously inside it, but the call ends with its longest reply, and no
episode's next prompt can enter until then. Here the rollout drives the engine itself, as
`LLM._run_engine` does: `LLMEngine.add_request` adds an episode's prompt the moment the
episode is ready, `LLMEngine.step` runs one engine step, and the requests finished in that
step go to their envs while the others keep decoding (`loop._continuous_stream`).

- `EngineStream`: the engine-level part (`submit(key, prompt_ids, params)`, `step()` → the
  requests finished in it as `Finished`, `abort()`), nothing of TRL's.
- `colocate_sampling_params`: the `SamplingParams` TRL's colocate `VLLMGeneration.generate`
  builds (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens =
  max_completion_length, logprobs, the user's `generation_kwargs`, structured outputs), plus
  a per-request seed. TRL samples from the engine's one generator, so a reply depends on
  which requests share a step; a seed per request (`request_seed`: the trainer's seed, the
  step, the rollout's name, the episode's trajectory id and turn) makes each reply depend on
  its own request only. The engine's `logprobs_mode` ("processed_logprobs") is TRL's, set
  when TRL built the engine.
- `StreamTurns`: the loop's `StreamingGenerator` over a `GRPOTrainer`: prompts tokenized per
  episode through the collector's `_tokenize` (TRL's `_tokenize_prompts`, tool schemas of
  each episode's environment included), TRL's weight push before the first request of a new
  step (`_last_loaded_step`, as `_generate_single_turn` does), the sampled token's logprob
  per completion token (`extract_logprobs`, top-1, as `_generate_single_turn` keeps), the
  prefix-cache tallies (`PrefixCacheCounter.add`), and hidden states by one extra pass when
  `hidden_capture="forward"` asks for them (the "hook" capture comes from the old-logprob
  pass, `batching.py`, as on every vLLM path).

Where it is not used (`RolloutCollector.streams`): vLLM server mode (the engine is another
process; TRL's client sends a whole call), and colocate with tensor parallelism (TRL gathers
every call's prompts across the TP group, whose ranks must then make the same calls:
the call-by-call path stays).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from .loop import Generation

__all__ = ["Finished", "EngineStream", "colocate_sampling_params", "request_seed", "StreamTurns"]

_streams = itertools.count()


@dataclass
class Finished:
    """One finished request: its key, prompt and completion ids, the sampled token's logprob
    per completion token (None where vLLM gave NaN; the list is None without logprobs), and
    how many prompt tokens the engine took from its prefix cache (`PrefixCacheCounter.add`
    reads `prompt_token_ids` and `num_cached_tokens`, as on a `RequestOutput`)."""

    key: Hashable
    prompt_token_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None] | None
    num_cached_tokens: int


def request_seed(*parts: Any) -> int:
    """A 63-bit seed from `parts` (stable across processes and runs, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def colocate_sampling_params(vllm_generation, seed: int | None):
    """TRL's colocate `SamplingParams` (`VLLMGeneration.generate`, TRL 1.16) with `seed`, and
    the output kind `LLM.generate` sets on its requests (the final output only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    g = vllm_generation
    kwargs = {
        "n": 1,
        "repetition_penalty": g.repetition_penalty,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "min_p": 0.0 if g.min_p is None else g.min_p,
        "max_tokens": g.max_completion_length,
        "logprobs": g.logprobs,
    }
    kwargs.update(g.generation_kwargs)
    if g.structured_outputs_regex is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(regex=g.structured_outputs_regex)
    elif isinstance(structured := kwargs.get("structured_outputs"), dict):
        kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
    if seed is not None:
        kwargs["seed"] = seed
    params = SamplingParams(**kwargs)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


class EngineStream:
    """Requests added to a vLLM `LLM`'s engine one by one and collected step by step.

    The stream must be the engine's only client while it has requests: an `LLM.generate`
    meanwhile would run them to the end and take their outputs. Request ids carry a
    per-stream prefix, so outputs of anything else are never taken for this stream's.
    """

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        self.prefix = f"bipace-stream-{next(_streams)}-"
        self.ids = itertools.count()
        self.keys: dict[str, Hashable] = {}  # request id -> key, while in the engine

    def __len__(self) -> int:
        return len(self.keys)

    def submit(self, key: Hashable, prompt_ids: list[int], params) -> None:
        request_id = f"{self.prefix}{next(self.ids)}"
        prompt = {"prompt_token_ids": list(prompt_ids)}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)  # what LLM.generate hands the engine
        self.engine.add_request(request_id, render(prompt) if render is not None else prompt, params)
        self.keys[request_id] = key

    def step(self) -> list[Finished]:
        """One engine step; the requests that finished in it, in the engine's order."""
        from trl.generation.vllm_generation import extract_logprobs

        finished = []
        for output in self.engine.step():
            if not output.finished or output.request_id not in self.keys:
                continue
            logprobs, _ = extract_logprobs([output])
            finished.append(
                Finished(
                    key=self.keys.pop(output.request_id),
                    prompt_token_ids=list(output.prompt_token_ids or ()),
                    completion_ids=list(output.outputs[0].token_ids),
                    logprobs=[lp[0] for lp in logprobs[0]] if logprobs is not None else None,
                    num_cached_tokens=int(getattr(output, "num_cached_tokens", None) or 0),
                )
            )
        return finished

    def abort(self) -> None:
        if self.keys:
            self.engine.abort_request(list(self.keys))
            self.keys.clear()


class StreamTurns:
    """The continuous rollout's `StreamingGenerator` over TRL's colocated engine (module doc).

    Args:
        trainer: the `GRPOTrainer` (its `vllm_generation`, `processing_class`, `state`, seed).
        tokenize: (messages, environments) → prompt ids, the collector's `_tokenize`.
        prefix_cache: the collector's `PrefixCacheCounter` (or None), fed every finished request.
        name: the rollout's name ("train", "eval"), part of every request's seed.
        hidden: prompt ids → hidden states (the collector's `_forward_hidden`), or None.
    """

    def __init__(self, trainer, tokenize: Callable, prefix_cache=None, name: str = "", hidden: Callable | None = None):
        generation = trainer.vllm_generation
        if generation.mode != "colocate" or getattr(generation, "tensor_parallel_size", 1) != 1:
            raise ValueError("StreamTurns needs vLLM colocate with tensor_parallel_size=1 (one engine per rank).")
        self.trainer, self.generation = trainer, generation
        self.tokenize, self.prefix_cache, self.name, self.hidden = tokenize, prefix_cache, name, hidden
        self.engine = EngineStream(generation.llm)

    def _weights_current(self) -> None:
        """TRL's `_generate_single_turn`: push the weights when the training step changed."""
        trainer, generation = self.trainer, self.generation
        if generation.enable_sleep_mode:
            raise RuntimeError(
                "The engine stream runs inside `WeightSyncs.awake()` (the collector's rollout scope) when "
                "vllm_enable_sleep_mode is on: outside it the engine may be asleep."
            )
        if trainer.state.global_step != trainer._last_loaded_step:
            from trl.extras.profiling import profiling_context

            with profiling_context(trainer, "sync_weights"):
                generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step

    def submit(self, keys, messages, environments=None) -> list[list[int]]:
        if not keys:
            return []
        self._weights_current()
        prompt_ids = self.tokenize(messages, environments)
        base = self.generation.generation_kwargs.get("seed", self.trainer.args.seed)
        step = self.trainer.state.global_step
        for key, ids in zip(keys, prompt_ids):
            traj, turn = key
            params = colocate_sampling_params(self.generation, request_seed(base, step, self.name, traj, turn))
            self.engine.submit(key, ids, params)
        return prompt_ids

    def step(self) -> tuple[list, Generation]:
        finished = self.engine.step()
        if self.prefix_cache is not None:
            self.prefix_cache.add(finished)
        prompt_ids = [f.prompt_token_ids for f in finished]
        completion_ids = [f.completion_ids for f in finished]
        texts = self.trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True) if finished else []
        logprobs = [f.logprobs for f in finished] if all(f.logprobs is not None for f in finished) else None
        hidden, hidden_seconds = None, 0.0
        if self.hidden is not None and finished:
            start = time.perf_counter()
            hidden = self.hidden(prompt_ids)
            hidden_seconds = time.perf_counter() - start
        return [f.key for f in finished], Generation(prompt_ids, completion_ids, texts, hidden, logprobs, hidden_seconds)

    def abort(self) -> None:
        self.engine.abort()
