"""A rollout's steps made into TRL's training batch: padded rows, old and reference log-probs, and
TRL's vLLM importance-sampling correction.

    batch, metrics, hidden = training_batch(spec, rollout, sync, hidden_layer=...)

One row per env step (prompt = that step's prompt, completion = its reply), rows padded to
the same count on every rank; `advantages` is a zero placeholder until the estimator has
run. When the run's `HiddenPlan` says "old_logprobs" (vLLM with a `hidden` preset), the hidden
states at the last prompt token come from the old-logprob pass, which runs anyway (attention is
causal, so they are the prefill's), and are returned, for the caller to pass into the estimator's
input (`Rollout.step_batch(hidden=...)`). `spec` (`TRLBatchSpec`) is what this takes of the
trainer, as values and bound methods.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from trl.trainer.utils import pad

from ..rollout.hidden import PositionCapture
from ..rollout.loop import Rollout
from ..rollout.vllm_backend import importance_sampling_metrics, importance_sampling_ratio

__all__ = ["TRLBatchSpec", "training_batch", "padded_tensors", "importance_sampling", "reference_logps", "mask_cut_episodes"]


@dataclass
class TRLBatchSpec:
    """What building TRL's batch takes of the `GRPOTrainer`, handed over by the trainer.

    Settings are values read when the trainer is built (`GRPOAdapter.trl_batch_spec`): setting
    TRL's attribute on the trainer afterwards (`trainer.vllm_importance_sampling_correction = False`)
    changes the batch only once `trainer.batch_spec` is built again from it."""

    args: Any  # steps_per_generation, per_device_train_batch_size, gradient_accumulation_steps
    accelerator: Any
    pad_token_id: int
    eos_token_ids: list[int]
    mask_truncated_completions: bool
    num_iterations: int
    use_vllm: bool
    vllm_importance_sampling_correction: bool
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_min: float | None
    vllm_importance_sampling_clip_max: float | None
    beta: float
    per_token_logps: Callable  # TRL's `_get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=)`
    model: Callable[[], Any]  # the live model (`trainer.model`)
    ref_model: Any = None
    # `mask_truncated_completions` with TRL's meaning on TRL's envs, where an episode is TRL's one
    # completion: every step of an episode whose last reply was cut leaves the loss (`mask_cut_episodes`)
    mask_cut_episodes: bool = False


def training_batch(
    spec: TRLBatchSpec, rollout: Rollout, sync, hidden_layer: int | None = None, behaviour_policy: bool = False
) -> tuple[dict[str, Any], dict[str, float], torch.Tensor | None]:
    """Pad the step samples into TRL's batch layout, with equal row counts on every rank.

    Rows are padded to the largest count over ranks, rounded up to a multiple of
    `steps_per_generation` (TRL splits the batch that many ways). Padding rows have
    an empty completion mask and zero advantage: they add nothing to the loss.
    `advantages` is a zero placeholder of the padded size until the estimator has run.
    `sync` is the rollout's cross-rank reductions (`collector.CrossRankSync`).
    `behaviour_policy`: the steps were sampled by an earlier policy (`overlap`), whose per-token
    log-probs are their `sampling_logprobs`; the batch then carries TRL's importance-sampling
    ratio of the current policy against it (`importance_sampling`) and its `sampling/*` metrics.
    `hidden_layer`: capture hidden_states[hidden_layer] at the last prompt token in the old-logprob pass.
    Returns the batch, its metrics (padding, log-prob time, vLLM sampling metrics) and the (N, d)
    hidden states of the rollout's steps (None without `hidden_layer`).
    """
    steps = rollout.steps
    chunks = spec.args.steps_per_generation
    target = sync.max(len(steps))
    target = max(chunks, math.ceil(target / chunks) * chunks)
    padded_rows = target - len(steps)
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded_tensors(spec, steps, target)
    device = completion_mask.device
    output = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.zeros(target, device=device),
        "num_items_in_batch": spec.accelerator.gather(completion_mask.sum()).sum(),
    }
    start = time.perf_counter()
    # A stale rollout (`overlap`, behaviour log-probs on its steps) needs the current policy's
    # log-probs for its importance ratio, whether or not TRL's loss reads them.
    stale = behaviour_policy
    logps, hidden = reference_logps(
        spec, prompt_ids, prompt_mask, completion_ids, completion_mask, hidden_layer, force_old=stale
    )
    output.update(logps)
    metrics = {"time/logps_s": time.perf_counter() - start, "episode/padded_rows": float(padded_rows)}
    if hidden is not None:
        hidden = hidden[: len(steps)]  # the padding rows' states are no step's
    if (spec.use_vllm and spec.vllm_importance_sampling_correction) or stale:
        output.update(importance_sampling(spec, steps, output, completion_mask, metrics))
    if stale and not _loss_reads_old_logps(spec):
        # TRL's loss then takes the PPO ratio's denominator from the live forward (`per_token_logps.detach()`,
        # the same weights); keep its path bit for bit, the pass above served only the importance ratio.
        del output["old_per_token_logps"]
    if spec.mask_cut_episodes:
        mask_cut_episodes(spec, steps, output)
    return output, metrics, hidden


def mask_cut_episodes(spec: TRLBatchSpec, steps, output: dict[str, Any]) -> None:
    """Every row of an episode whose last reply was cut (no EOS) out of the loss, not only that reply
    (which `padded_tensors` masks on every env): TRL's `mask_truncated_completions` where an episode
    is TRL's one completion (TRL's envs); `num_items_in_batch` counted again."""
    eos, last = set(spec.eos_token_ids), {}
    for step in steps:
        last[step.traj] = step
    cut = {traj for traj, step in last.items() if not step.completion_ids or step.completion_ids[-1] not in eos}
    rows = [j for j, step in enumerate(steps) if step.traj in cut]
    if rows:
        output["completion_mask"][rows] = 0
    output["num_items_in_batch"] = spec.accelerator.gather(output["completion_mask"].sum()).sum()


def _loss_reads_old_logps(spec: TRLBatchSpec) -> bool:
    """TRL's rule (`_generate_and_score_completions`): the old-logprob pass runs when the weights can
    change between the generation and its last micro-batch, or under vLLM."""
    generate_every = spec.args.steps_per_generation * spec.num_iterations
    return spec.args.gradient_accumulation_steps % generate_every != 0 or spec.use_vllm


def padded_tensors(spec: TRLBatchSpec, steps, target: int) -> tuple[torch.Tensor, ...]:
    """(prompt_ids, prompt_mask, completion_ids, completion_mask) of `steps`, padded with empty rows to
    `target` rows: prompts left-padded, completions right-padded, TRL's truncated-completion mask applied.
    The old-logprob pass and the behaviour-logprob pass of a stale rollout (`overlap`) read the same
    tensors, so their log-probs agree bit for bit when the weights do."""
    device = spec.accelerator.device
    padded_rows = target - len(steps)
    pad_id = spec.pad_token_id
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
    if spec.mask_truncated_completions and steps:
        eos = set(spec.eos_token_ids)
        truncated = [not s.completion_ids or s.completion_ids[-1] not in eos for s in steps] + [False] * padded_rows
        completion_mask = completion_mask * (~torch.tensor(truncated, device=device)).unsqueeze(1).long()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def importance_sampling(spec: TRLBatchSpec, steps, output, completion_mask, metrics) -> dict[str, torch.Tensor]:
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
        spec.vllm_importance_sampling_mode,
        spec.vllm_importance_sampling_clip_min,
        spec.vllm_importance_sampling_clip_max,
    )
    local = importance_sampling_metrics(old, sampling, completion_mask, ratio)
    reduce = {"mean": torch.mean, "max": torch.max, "min": torch.min}
    for key, value in local.items():  # over ranks as TRL does: the ratio's statistics ignore NaN
        gathered = spec.accelerator.gather(value.reshape(1).float())
        if key.startswith("sampling/importance_sampling_ratio"):
            gathered = gathered[~torch.isnan(gathered)]
        metrics[key] = float(reduce[key.rsplit("/", 1)[1]](gathered)) if gathered.numel() else math.nan
    return {"importance_sampling_ratio": ratio, "sampling_per_token_logps": sampling}


def reference_logps(
    spec: TRLBatchSpec, prompt_ids, prompt_mask, completion_ids, completion_mask, hidden_layer: int | None = None,
    force_old: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """old_per_token_logps / ref_per_token_logps exactly when TRL's loss needs them (old ones also
    with `force_old`), and, with `hidden_layer`, the hidden states at the last prompt token from the old pass."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    batch_size = spec.args.per_device_train_batch_size
    out, hidden = {}, None
    with torch.no_grad():
        model = spec.model()
        if _loss_reads_old_logps(spec) or force_old:
            capture = (
                PositionCapture(spec.accelerator.unwrap_model(model), hidden_layer, position=prompt_ids.size(1) - 1)
                if hidden_layer is not None
                else contextlib.nullcontext()
            )
            with capture:
                out["old_per_token_logps"], _, _ = spec.per_token_logps(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            hidden = capture.states if hidden_layer is not None else None
        if spec.beta != 0.0:
            if spec.ref_model is not None:
                ref_model, adapter = spec.ref_model, contextlib.nullcontext()
            else:  # LoRA: the base model with the adapter disabled is the reference
                ref_model, adapter = model, spec.accelerator.unwrap_model(model).disable_adapter()
            with adapter:
                out["ref_per_token_logps"], _, _ = spec.per_token_logps(
                    ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
    return out, hidden
