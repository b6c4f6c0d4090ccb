"""A played training rollout made into TRL's batch with the estimator's advantages in place, and its metrics.

    scored = score_rollout(played, spec, estimator, sync, hidden_plan, penalize_env_failures, prefetched)
    metrics = generation_metrics(scored, played_episodes, ...)

The trainer collects (`collector`), this scores, TRL's loss trains: `BiPACETrainer.collect`
and `_generate_and_score_completions` are these two calls around the collector's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch

from ..advantages import StepEstimate
from .batching import TRLBatchSpec, training_batch
from ..rollout.hidden import HiddenPlan
from ..rollout.types import Episode, Rollout

__all__ = ["ScoredRollout", "score_rollout", "generation_metrics"]


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


def score_rollout(
    played: Rollout, spec: TRLBatchSpec, estimator, sync, hidden: HiddenPlan, penalize_env_failures: bool,
    prefetched=None, *, forward_hidden: Callable[[list[list[int]]], torch.Tensor] | None = None,
    advantages_of: Callable[[Rollout, StepEstimate], StepEstimate] | None = None,
) -> ScoredRollout:
    """TRL's batch of `played` with the estimator's advantages in place, and whether any rank has a
    non-zero advantage.

    An env fault is not the policy's failure: unless `penalize_env_failures`, failed episodes' steps
    leave the batch (no loss, no place in their group's statistics). Under vLLM the batch's old-logprob
    pass captures the hidden states (`hidden.source == "old_logprobs"`), which go into the estimator's
    input explicitly (`Rollout.step_batch(hidden)`).

    `prefetched` (an `overlap.Prefetched`): `played` was sampled by an earlier policy (`max_staleness=1`):
    the batch then carries TRL's importance ratio ρ of the current policy against the one that played
    it (`batching.training_batch`), and each row's advantage becomes ρ·A, (B, T) for a per-token ratio.
    TRL's vLLM correction multiplies the per-token loss by ρ; for every loss but VESPO (refused) that
    loss is ρ ≥ 0 times a term linear in A or a function of A's sign only through ρ·A, so scaling the
    advantage is the same correction: GRPO/BNPO/DR-GRPO/DAPO/LUSPO's −min(r·A, clip(r)·A), CISPO's
    −sg(clip(r))·A·log π and SAPO's −s(r)·A (ρ = 0 zeroes the term either way).

    `forward_hidden(prompt_ids)`: the kept steps' hidden states by one pass over their prompts (a rollout
    that captured none: TRL's `evaluate`). `advantages_of(rollout, estimate)`: the estimate made over,
    after the estimator ran (plain prompts: GRPOTrainer's own advantage, `update.one_step`).
    """
    rollout = played if penalize_env_failures else played.without_failed_episodes()
    masked_steps = len(played.steps) - len(rollout.steps)
    masked_episodes = sum(e.failed and e.length > 0 for e in played.episodes) if masked_steps else 0
    layer = hidden.layer if hidden.source == "old_logprobs" else None
    batch, batch_metrics, states = training_batch(spec, rollout, sync, layer, behaviour_policy=prefetched is not None)
    if forward_hidden is not None and rollout.steps:
        states = forward_hidden([s.prompt_ids for s in rollout.steps])
    start = time.perf_counter()
    estimate = estimator.estimate(rollout.step_batch(states), reduce=sync.mean)
    if advantages_of is not None:
        estimate = advantages_of(rollout, estimate)
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
    signal = sync.any(bool((advantages != 0).any()))
    return ScoredRollout(
        rollout, batch, batch_metrics, estimate, estimator_seconds, signal, masked_episodes, masked_steps,
        behaviour_step=prefetched.snapshot_step if prefetched is not None else None,
    )


def generation_metrics(
    scored: ScoredRollout, played: list[Episode], *, env_metrics: dict[str, float], trl_metrics: dict[str, float],
    resamples: int | None = None, weight_syncs: int | None = None, global_step: int | None = None,
    skip_without_signal: bool = True,
) -> dict[str, float]:
    """A training generation's metrics: the rollout's, the estimator's diagnostics, the envs', the batch's,
    TRL's own (`trl_metrics`), what was masked or skipped (a batch without signal, when
    `skip_without_signal`); with `resamples` (dynamic sampling on) the resample count and the success
    rate over every episode `played`; `weight_syncs` under vLLM; with `global_step` (`max_staleness=1`)
    the staleness of the trained batch."""
    metrics = {**scored.rollout.metrics(), **scored.estimate.diagnostics, **env_metrics, **scored.batch_metrics}
    metrics.update(trl_metrics)
    metrics["train/masked_failed_episodes"] = float(scored.masked_episodes)
    metrics["train/masked_failed_steps"] = float(scored.masked_steps)
    metrics["train/skipped_batches"] = float(not scored.signal and skip_without_signal)
    if resamples is not None:
        metrics["train/resamples"] = float(resamples)
        # the trained batch was selected for signal; this rate counts every episode the step played
        metrics["episode/success_rate_all_played"] = sum(e.won for e in played) / max(len(played), 1)
    metrics["time/estimator_s"] = scored.estimator_seconds
    if weight_syncs is not None:
        metrics["vllm/weight_syncs"] = float(weight_syncs)
    if global_step is not None:
        # optimizer steps between the weights that played the trained batch and the current ones
        behind = scored.behaviour_step  # None: played now (the first generation, an epoch's, a resampled one)
        metrics["rollout/staleness"] = float(global_step - behind) if behind is not None else 0.0
        metrics["rollout/prefetched"] = float(behind is not None)
    return metrics
