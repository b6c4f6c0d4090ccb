"""The metrics GRPOTrainer logs for a generation, with TRL's names and meanings, per episode.

    metrics = trl_metrics(episodes, reward_func_names, tools=bool(trainer.tools))

TRL's `_generate` and `_generate_and_score_completions` log, for each generation, the
completion lengths (`completions/*`), the tool counts (`tools/*`, when there are tools), each
reward source (`rewards/<name>/mean|std`), the total reward (`reward`, `reward_std`) and the
share of rows whose group has no reward spread (`frac_reward_zero_std`). A user's dashboards
read those names, so `BiPACETrainer` logs them too, next to its own (`episode/*`,
`advantage/*`...). TRL's row is one trajectory; ours is one episode, whose model-written
tokens are the completions of all its turns:

- `completions/mean_length` (min, max): the model's tokens per episode (TRL counts the
  completion's model tokens, tool results masked out: the same tokens);
- `completions/clipped_ratio`: the share of episodes whose last reply did not end with EOS
  (cut by `max_completion_length`); `completions/*_terminated_length` over the others
  (0 when there are none, as TRL);
- `tools/call_frequency`: tool calls per episode; `tools/failure_frequency`: the share of
  calls that returned an error (0 without calls);
- `rewards/<name>/mean|std` (unweighted), `reward` and `reward_std` (weighted total) over the
  scored episodes: an env-failed episode has no reward (TRL: an unscorable row, NaN), so it
  is left out, as TRL's `nanmean` leaves NaN out; `frac_reward_zero_std` is the share of
  scored episodes whose task group's rewards are all equal.

Every function takes plain per-episode values (gathered over ranks by the caller), so all
ranks log the same numbers, and the standard deviations are TRL's own (`nanstd`, unbiased).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch
from trl.trainer.utils import nanstd

__all__ = ["EpisodeSummary", "summarise_episodes", "trl_metrics", "loss_metric_names"]


@dataclass(frozen=True)
class EpisodeSummary:
    """What TRL's metrics need of one episode (a plain, picklable record to gather over ranks)."""

    group: Hashable  # its task group, unique over ranks
    model_tokens: int  # completion tokens of all its turns
    clipped: bool  # its last reply did not end with EOS
    scored: bool  # not failed: it has a reward
    reward: float  # the weighted total, as trained
    reward_terms: dict[str, float] = field(default_factory=dict)  # per reward source, unweighted
    tool_calls: int = 0
    tool_failures: int = 0


def loss_metric_names(loss_type: str, beta: float) -> list[str]:
    """The metrics GRPOTrainer's `_compute_loss` logs for `loss_type`: an update skipped for want of
    signal logs them as unknown (NaN, which TRL's `log` shows as None), so no name goes missing."""
    names = ["entropy"] + (["kl"] if beta != 0.0 else [])
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        names += [f"clip_ratio/{name}" for name in ("low_mean", "high_mean", "region_mean", "low_min", "high_max")]
    elif loss_type == "cispo":
        names.append("cispo_clip_ratio")
    elif loss_type == "vespo":
        names.append("vespo/phi_seq_mean")
    return names


def summarise_episodes(
    rollout, eos_token_ids: Sequence[int], rank: int = 0, single_source: str | None = None, failed_scored: bool = False
) -> list[EpisodeSummary]:
    """One `EpisodeSummary` per episode of `rollout` (episodes without a step are left out: no completion).

    `single_source`: the reward's one source, for envs that give a single reward (ours: `env_reward`);
    `failed_scored`: env-failed episodes are trained with reward 0 (`penalize_env_failures`), so scored."""
    steps_of: dict[int, list] = {}
    for step in rollout.steps:
        steps_of.setdefault(step.traj, []).append(step)
    eos = set(eos_token_ids)
    out = []
    for episode in rollout.episodes:
        steps = steps_of.get(episode.traj)
        if not steps:
            continue
        last = steps[-1].completion_ids
        out.append(
            EpisodeSummary(
                group=(rank, episode.group),
                model_tokens=sum(len(s.completion_ids) for s in steps),
                clipped=not last or last[-1] not in eos,
                scored=failed_scored or not episode.failed,
                reward=float(episode.reward),
                reward_terms=dict(episode.reward_terms) or ({single_source: float(episode.reward)} if single_source else {}),
                tool_calls=episode.tool_calls,
                tool_failures=episode.tool_failures,
            )
        )
    return out


def trl_metrics(episodes: Sequence[EpisodeSummary], reward_func_names: Sequence[str], tools: bool) -> dict[str, float]:
    """GRPOTrainer's per-generation metrics over `episodes` (module docstring); {} without episodes."""
    if not episodes:
        return {}
    lengths = torch.tensor([e.model_tokens for e in episodes], dtype=torch.float32)
    clipped = torch.tensor([e.clipped for e in episodes])
    terminated = lengths[~clipped] if (~clipped).any() else torch.zeros(1)
    out = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": clipped.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }
    if tools:
        calls = sum(e.tool_calls for e in episodes)
        out["tools/call_frequency"] = calls / len(episodes)
        out["tools/failure_frequency"] = sum(e.tool_failures for e in episodes) / calls if calls else 0.0
    scored = [e for e in episodes if e.scored]
    nan = float("nan")
    for name in reward_func_names:
        values = torch.tensor([e.reward_terms.get(name, nan) for e in scored] or [nan], dtype=torch.float32)
        out[f"rewards/{name}/mean"] = torch.nanmean(values).item()
        out[f"rewards/{name}/std"] = nanstd(values).item()
    rewards = torch.tensor([e.reward for e in scored] or [nan], dtype=torch.float32)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    by_group: dict[Hashable, list[float]] = {}
    for e in scored:
        by_group.setdefault(e.group, []).append(e.reward)
    flat = [len(set(values)) == 1 for values in by_group.values() for _ in values]
    out["frac_reward_zero_std"] = sum(flat) / len(flat) if flat else nan
    return out


def generation_trl_metrics(
    rollout, reward_func_names: Sequence[str], stop_token_ids: Sequence[int], accelerator, *, single_source: str | None,
    failed_scored: bool, tools: bool,
) -> tuple[dict[str, float], int]:
    """GRPOTrainer's own metrics of one generation over every rank (`summarise_episodes` → `trl_metrics`)
    and the tokens (prompt + completion) its steps hold over every rank, for TRL's `num_input_tokens_seen`."""
    from accelerate.utils import gather_object

    summaries = summarise_episodes(
        rollout, stop_token_ids, rank=accelerator.process_index, single_source=single_source, failed_scored=failed_scored
    )
    tokens = torch.tensor([sum(len(s.prompt_ids) + len(s.completion_ids) for s in rollout.steps)], device=accelerator.device)
    if accelerator.num_processes > 1:
        summaries = gather_object(summaries)
    return trl_metrics(summaries, reward_func_names, tools=tools), int(accelerator.gather(tokens).sum())
