"""The continuous rollout through vLLM's own continuous batching (colocate, one engine per rank).

    stream = StreamTurns(policy, name="train")                            # the collector builds it
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
- `StreamTurns`: the loop's `StreamingGenerator` over the trainer's `update.policy.TRLPolicy`: prompts
  tokenized per episode through it (TRL's `_tokenize_prompts`, tool schemas of each episode's
  environment included), TRL's weight push before the first request of a new step
  (`TRLPolicy.push_weights`, as `_generate_single_turn` does), the sampled token's logprob
  per completion token (`extract_logprobs`, top-1, as `_generate_single_turn` keeps), the
  prefix-cache tallies (`PrefixCacheCounter.add`), and hidden states by one extra pass when
  `hidden_capture="forward"` asks for them (the "hook" capture comes from the old-logprob
  pass, `batching.py`, as on every vLLM path).

Server mode (`ServerStream`): the engine is another process, vLLM's own OpenAI-compatible
server (what `trl vllm-serve` runs in TRL 1.16), whose async engine batches concurrent
requests continuously. Each episode's prompt goes out as its own `/v1/completions` request
(token ids in, TRL's server payload: `server_sampling_params`, plus the per-request seed) on
a worker thread the moment the episode is ready, and `step()` collects the requests that
finished, waiting at most `poll_seconds` for one, so env steps that finish meanwhile still
land. Every rank sends its own requests (no gather over ranks, unlike TRL's call, which
slices one main-process call): ranks play on their own as on colocate. The weights move once
per step before the rollout's first request (TRL's `sync_weights`: the main process pushes,
the others take part in the parameter walk), then every rank waits at a barrier, so no rank
samples from the previous step's weights on the server. The server reports prompt tokens
from its prefix cache only when started with `--enable-prompt-tokens-details`; without it
nothing is counted. `rollout/engine_steps` counts collection rounds in server mode.

Where it is not used (`RolloutCollector.streams`): colocate with tensor parallelism (TRL
gathers every call's prompts across the TP group, whose ranks must then make the same
calls: the call-by-call path stays).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Hashable

from .. import trl_compat
from .loop import Generation

__all__ = [
    "Finished",
    "EngineStream",
    "ServerStream",
    "colocate_sampling_params",
    "server_sampling_params",
    "request_seed",
    "StreamTurns",
]

_streams = itertools.count()


@dataclass
class Finished:
    """One finished request: its key, prompt and completion ids, the sampled token's logprob
    per completion token (None where vLLM gave NaN; the list is None without logprobs), and
    how many prompt tokens the engine took from its prefix cache (`PrefixCacheCounter.add`
    reads `prompt_token_ids` and `num_cached_tokens`, as on a `RequestOutput`; None where a
    server does not report it)."""

    key: Hashable
    prompt_token_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None] | None
    num_cached_tokens: int | None


def request_seed(*parts: Any) -> int:
    """A 63-bit seed from `parts` (stable across processes and runs, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _one_completion(g) -> dict:
    """The sampling fields TRL's generate sets in both modes (TRL 1.16), for one completion."""
    return {
        "n": 1,
        "repetition_penalty": g.repetition_penalty,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "min_p": 0.0 if g.min_p is None else g.min_p,
        "max_tokens": g.max_completion_length,
        "logprobs": g.logprobs,
    }


def colocate_sampling_params(vllm_generation, seed: int | None):
    """TRL's colocate `SamplingParams` (`VLLMGeneration.generate`, TRL 1.16) with `seed`, and
    the output kind `LLM.generate` sets on its requests (the final output only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    g = vllm_generation
    kwargs = _one_completion(g)
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


def server_sampling_params(vllm_generation, seed: int | None) -> dict:
    """The sampling part of the `/v1/completions` payload TRL's server mode sends
    (`VLLMGeneration.generate` → `VLLMClient.generate`, TRL 1.16) for one completion, with
    `seed`: the same fields, the regex as `structured_outputs`, the user's `generation_kwargs`
    over them, the seed last."""
    g = vllm_generation
    params = _one_completion(g)
    if g.structured_outputs_regex is not None:
        params["structured_outputs"] = {"regex": g.structured_outputs_regex}
    params.update(g.generation_kwargs or {})
    if seed is not None:
        params["seed"] = seed
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
        render = trl_compat.vllm_request_renderer(self.llm)  # what LLM.generate hands the engine
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


class ServerStream:
    """Requests sent to a vLLM server one by one, each its own HTTP request, and collected as
    they finish (module doc). The server's engine batches whatever is in flight continuously.

    Args:
        client: TRL's `VLLMClient` (its `base_url`, `model` and retrying `_post`, which TRL
            itself calls from several threads).
        max_in_flight: requests in flight at most (worker threads); more wait in the pool's queue.
        poll_seconds: how long `step()` waits for a reply before returning none.
    """

    def __init__(self, client, max_in_flight: int = 256, poll_seconds: float = 0.02):
        self.client = client
        self.url = f"{client.base_url}/v1/completions"
        self.poll_seconds = poll_seconds
        self.pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="bipace-server-stream")
        self.order = itertools.count()
        self.pending: dict[Future, tuple[int, Hashable, list[int]]] = {}  # request -> (order, key, prompt ids)

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, key: Hashable, prompt_ids: list[int], params: dict) -> None:
        payload = {
            "model": self.client.model,
            "prompt": [list(prompt_ids)],
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **params,
        }
        future = self.pool.submit(trl_compat.vllm_client_post(self.client), self.url, json=payload)
        self.pending[future] = (next(self.order), key, list(prompt_ids))

    def step(self) -> list[Finished]:
        """The requests that finished since the last step (waiting up to `poll_seconds` for
        one), in the order they were sent. A failed request raises its error here."""
        from trl.generation.vllm_client import parse_logprobs

        if not self.pending:
            return []
        done, _ = wait(self.pending, timeout=self.poll_seconds, return_when=FIRST_COMPLETED)
        finished = []
        for future in sorted(done, key=lambda f: self.pending[f][0]):
            _, key, prompt_ids = self.pending.pop(future)
            try:
                response = future.result()
            except Exception as error:  # TRL's `_post` raises a bare Exception with the server's answer
                raise RuntimeError(f"the vLLM server at {self.url} failed the request of {key!r}: {error}") from error
            choice = response["choices"][0]
            logprobs, _ = parse_logprobs([choice.get("logprobs")])
            details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            finished.append(
                Finished(
                    key=key,
                    prompt_token_ids=list(choice.get("prompt_token_ids") or prompt_ids),
                    completion_ids=list(choice["token_ids"]),
                    logprobs=[lp[0] for lp in logprobs[0]] if logprobs is not None else None,
                    num_cached_tokens=None if cached is None else int(cached),
                )
            )
        return finished

    def abort(self) -> None:
        """Drops every request: those not sent yet are cancelled; replies of those in flight are
        discarded when they come (the server finishes them: HTTP gives no way to stop one)."""
        for future in self.pending:
            future.cancel()
        self.pending.clear()
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class StreamTurns:
    """The continuous rollout's `StreamingGenerator` over TRL's vLLM generation (module doc):
    colocate's engine (`EngineStream`) or the server (`ServerStream`).

    Args:
        policy: a `policy.Policy` that `can_stream` (the trainer's `update.policy.TRLPolicy`): its
            `vllm_generation`, tokenizer, decoding, weight version and push, prefix-cache counter, `seed`.
        name: the rollout's name ("train", "eval"), part of every request's seed.
        hidden: the run's `HiddenPlan` when its states come from one extra pass ("forward"), or None.
        max_in_flight: server mode's cap on requests in flight (its worker threads).
    """

    def __init__(self, policy, name: str = "", hidden=None, max_in_flight: int = 256):
        generation = policy.vllm_generation
        self.policy, self.generation = policy, generation
        self.prefix_cache, self.name, self.hidden = policy.prefix_cache, name, hidden
        if generation.mode == "server":
            self.engine = ServerStream(generation.vllm_client, max_in_flight=max_in_flight)
            self.params = server_sampling_params
            # Every rank builds its stream at the start of each rollout: the weights move now and
            # every rank waits for them (module doc), rather than at some rank's first request.
            self._weights_current(barrier=True)
        elif getattr(generation, "tensor_parallel_size", 1) == 1:
            self.engine = EngineStream(generation.llm)
            self.params = colocate_sampling_params
        else:
            raise ValueError("StreamTurns needs vLLM server mode, or colocate with tensor_parallel_size=1.")

    def _weights_current(self, barrier: bool = False) -> None:
        """TRL's `_generate_single_turn`: push the weights when the training step changed (with
        `barrier`, every rank then waits until the push is done)."""
        generation = self.generation
        if generation.mode == "colocate" and generation.enable_sleep_mode:
            raise RuntimeError(
                "The engine stream runs inside `WeightSyncs.awake()` (the collector's rollout scope) when "
                "vllm_enable_sleep_mode is on: outside it the engine may be asleep."
            )
        self.policy.push_weights(barrier=barrier)

    def submit(self, keys, messages, environments=None) -> list[list[int]]:
        if not keys:
            return []
        self._weights_current()
        prompt_ids = self.policy.tokenize(messages, environments)
        base = self.generation.generation_kwargs.get("seed", self.policy.seed)
        step = self.policy.weight_version
        for key, ids in zip(keys, prompt_ids):
            traj, turn = key
            params = self.params(self.generation, request_seed(base, step, self.name, traj, turn))
            self.engine.submit(key, ids, params)
        return prompt_ids

    def step(self) -> tuple[list, Generation]:
        finished = self.engine.step()
        if self.prefix_cache is not None:
            self.prefix_cache.add([f for f in finished if f.num_cached_tokens is not None])
        prompt_ids = [f.prompt_token_ids for f in finished]
        completion_ids = [f.completion_ids for f in finished]
        texts = self.policy.decode(completion_ids) if finished else []
        logprobs = [f.logprobs for f in finished] if all(f.logprobs is not None for f in finished) else None
        hidden, hidden_seconds = None, 0.0
        if self.hidden is not None and finished:
            start = time.perf_counter()
            hidden = self.policy.forward_hidden(prompt_ids, self.hidden.layer)
            hidden_seconds = time.perf_counter() - start
        return [f.key for f in finished], Generation(prompt_ids, completion_ids, texts, hidden, logprobs, hidden_seconds)

    def abort(self) -> None:
        self.engine.abort()

    def close(self) -> None:
        """The rollout ended: the server stream's worker threads go."""
        if isinstance(self.engine, ServerStream):
            self.engine.close()
