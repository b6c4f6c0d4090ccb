"""What the multi-turn rollout adds to TRL's vLLM generation (`use_vllm=True`).

TRL's vLLM path is written for single-turn GRPO: one generate call per training step.
A multi-turn rollout calls generate once per turn, from every rank in lockstep, so three
of TRL's assumptions need help, and the training batch needs what TRL builds inline:

- `importance_sampling_ratio`: the truncated/masked importance-sampling correction of
  vLLM's sampling distribution against the trainer's (TRL computes it inline in
  `GRPOTrainer._generate_and_score_completions`; this is the same formula as a function).
- `equal_prompt_counts`: TRL's server mode (and colocate with tensor parallelism) gathers
  every rank's prompts and hands back `slice(rank * n, (rank + 1) * n)`, assuming every
  rank sent n. The lockstep rollout has different numbers of active envs per rank, so
  every call is padded to the largest count and the padding's completions dropped.
- `WeightSyncs`: TRL pushes weights when the step changes, and with colocate sleep mode
  again on every generate call (sleep level 2 discards the weights). A rollout keeps the
  engine awake across its turns, so weights move once per training step, and counts them.
- On vLLM's CPU build TRL's per-parameter weight loading fails; the collector installs
  `trl_compat.install_cpu_weight_loading` there.
- `PrefixCacheCounter`: vLLM's prefix cache (on by default in the V1 engine) encodes a shared
  prefix once; each request's output says how many of its prompt tokens came from the cache
  (`RequestOutput.num_cached_tokens`), and TRL drops that number. The counter reads it back
  from every colocate generate call, so a rollout logs prompt tokens encoded vs reused.

What these touch inside TRL and vLLM (a method of this trainer's own generation object or
engine, its sleep state) lives in `bipace_trainer.trl_compat`, with the versions it was
written for.
"""

from __future__ import annotations

import math

import torch

from .. import trl_compat

__all__ = [
    "IS_MODES",
    "importance_sampling_ratio",
    "importance_sampling_metrics",
    "equal_prompt_counts",
    "WeightSyncs",
    "PrefixCacheCounter",
]

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """ρ = π_train(y) / π_vLLM(y), per token or per sequence, truncated or masked.

        d_t = (log π_train(y_t) − log π_vLLM(y_t)) · m_t          (NaN sampling logprob → d_t = 0)
        token_*:    ρ_t = exp(d_t)                                  shape (B, T)
        sequence_*: ρ   = exp(Σ_t d_t)                              shape (B, 1)
        *_truncate: ρ ← clamp(ρ, clip_min, clip_max)
        *_mask:     ρ ← 0 where ρ ∉ [clip_min, clip_max]  (a missing bound is ±∞)

    Args:
        old_logps: (B, T) the trainer's per-token logprobs of the sampled completions.
        sampling_logps: (B, T) vLLM's logprobs of the same tokens (NaN where unavailable).
        mask: (B, T) 1 on completion tokens.
    """
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}; use one of {', '.join(IS_MODES)}.")
    if old_logps.shape != sampling_logps.shape or old_logps.shape != mask.shape:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in (("old", old_logps), ("sampling", sampling_logps), ("mask", mask)))
        raise ValueError(f"shapes differ: {shapes}")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_metrics(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor
) -> dict[str, torch.Tensor]:
    """This rank's share of TRL's `sampling/*` metrics (TRL reduces them over ranks:
    difference mean by mean, max by max; ratio min by nanmin, mean by nanmean, max by nanmax)."""
    zero = torch.zeros((), device=old_logps.device)
    mask = mask.bool()
    delta = torch.abs(old_logps - sampling_logps)
    delta = delta[mask & ~torch.isnan(delta)]
    flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[mask]
    return {
        "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": flat.min() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/mean": flat.mean() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/max": flat.max() if flat.numel() else zero,
    }


def equal_prompt_counts(prompt_ids: list[list[int]], target: int, dummy: list[int]) -> list[list[int]]:
    """`prompt_ids` padded with `dummy` to `target` prompts (the largest count over ranks)."""
    if len(prompt_ids) > target:
        raise ValueError(f"{len(prompt_ids)} prompts exceed the cross-rank target {target}.")
    return list(prompt_ids) + [list(dummy)] * (target - len(prompt_ids))


class WeightSyncs:
    """Counts TRL's weight pushes to vLLM and holds them to one per training step.

    Counts every `sync_weights` call of the trainer's `vllm_generation` (`trl_compat.wrap_sync_weights`:
    TRL calls it from `_generate_single_turn` when the step changed, and from `generate` whenever
    sleep mode discarded the weights). `awake()` is the scope of one multi-turn rollout: with
    colocate sleep mode the engine is woken (weights pushed, since sleep discarded them) before
    the first turn and put back to sleep after the last one, instead of around every turn.
    """

    def __init__(self, vllm_generation):
        self.generation = vllm_generation
        self.count = 0
        self.undo = trl_compat.wrap_sync_weights(vllm_generation, self._counted)

    def _counted(self) -> None:
        self.count += 1

    def awake(self):
        """Scope of one rollout. With colocate sleep mode: push the weights if sleep
        discarded them, keep the engine awake across every turn, sleep again at the end
        (`trl_compat.engine_awake`). Yields whether it pushed (the weights are then the
        trainer's current ones)."""
        return trl_compat.engine_awake(self.generation)


class PrefixCacheCounter:
    """Prompt tokens vLLM encoded and reused from its prefix cache, over colocate generate calls.

    Wraps this engine's `LLM.generate` (TRL's colocate path calls it once per turn) and adds
    up, per request, `len(prompt_token_ids) - num_cached_tokens` (encoded) and
    `num_cached_tokens` (reused: their KV came from the cache). `take()` returns the tallies
    since the last `take()` as `prompt_tokens_encoded` / `prompt_tokens_reused` and starts
    again. Server mode has no engine in this process: TRL's call-by-call client keeps only
    token ids, so there is nothing to read (`for_generation` returns None); the server stream
    (`vllm_stream.ServerStream`) feeds a counter built without an engine (`llm=None`) from the
    replies of a server started with `--enable-prompt-tokens-details`. With tensor parallelism
    every rank of a group generates the whole group's prompts, so its tallies are the group's.
    """

    def __init__(self, llm=None):
        self.encoded = 0
        self.reused = 0
        self.requests = 0  # requests counted since the last take()
        if llm is None:  # fed by hand (`add`): the server stream's replies that report their cache hits
            return
        trl_compat.wrap_llm_generate(llm, self.add)

    @classmethod
    def for_generation(cls, vllm_generation) -> "PrefixCacheCounter | None":
        """A counter on the colocate engine of TRL's `vllm_generation`; None in server mode."""
        llm = getattr(vllm_generation, "llm", None)
        return cls(llm) if vllm_generation.mode == "colocate" and llm is not None else None

    def add(self, outputs) -> None:
        for output in outputs:
            prompt = len(output.prompt_token_ids or ())
            cached = min(int(getattr(output, "num_cached_tokens", None) or 0), prompt)
            self.encoded += prompt - cached
            self.reused += cached
            self.requests += 1

    def take(self) -> dict[str, int]:
        counts = {"prompt_tokens_encoded": self.encoded, "prompt_tokens_reused": self.reused}
        self.encoded = self.reused = self.requests = 0
        return counts


def engine_logprobs(vllm_generation, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
    """The engine's logprob of each given completion token (prompt-logprob scoring), for tests
    and checks that the engine really runs the trainer's current weights."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    prompts = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_ids, completion_ids)]
    outputs = vllm_generation.llm.generate(prompts, sampling_params=params, use_tqdm=False)
    result: list[list[float]] = []
    for output, p, c in zip(outputs, prompt_ids, completion_ids):
        scored = output.prompt_logprobs[len(p) :]
        result.append([entry[token].logprob for entry, token in zip(scored, c)])
    return result
