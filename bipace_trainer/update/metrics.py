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

- `num_tokens` (`trl_token_count`): TRL's running count of prompt and model-generated tokens,
  each training sample's prompt and its completion's model tokens: an episode of TRL's envs (one
  chat that grows) counts its first prompt and every reply, not the tool results between them;
  a step of our envs (a prompt rebuilt every turn: its own sample) counts its prompt and reply.
  Ours beside it: `rollout/tokens_processed`, every token the model read or wrote once
  (`processed_token_count`, the tool results too), and `rollout/tokens_all_turns`.

Every function takes plain per-episode values (gathered over ranks by the caller), so all
ranks log the same numbers, and the standard deviations are TRL's own (`nanstd`, unbiased).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch
from trl.trainer.utils import nanstd

__all__ = [
    "EpisodeSummary", "summarise_episodes", "trl_metrics", "trl_token_count", "processed_token_count",
    "generation_trl_metrics",
]


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


def _shared_prefix(before: Sequence[int], prompt: Sequence[int]) -> int:
    shared = 0
    for a, b in zip(before, prompt):
        if a != b:
            break
        shared += 1
    return shared


def trl_token_count(steps: Sequence) -> int:
    """TRL's `num_tokens` of one generation's steps: each sample's prompt tokens and its completion's
    model-generated tokens (TRL 1.16 `_generate_and_score_completions`: prompt lengths plus the
    completion lengths under `tool_mask`).

    TRL's sample on a tool env is the whole chat: one prompt, then replies and tool results (masked
    out of the count). A step whose prompt starts with its episode's previous prompt (a chat that
    grew: the reply as the template renders it, then tool results) is a turn of that one sample: its
    reply counts, its prompt's new tokens do not. Any other prompt (our envs rebuild theirs each
    turn) is a sample of its own and counts whole. Steps must be in turn order within an episode."""
    previous: dict[int, list[int]] = {}
    total = 0
    for step in steps:
        before, prompt = previous.get(step.traj), list(step.prompt_ids)
        grown = before is not None and _shared_prefix(before, prompt) == len(before)
        total += (0 if grown else len(prompt)) + len(step.completion_ids)
        previous[step.traj] = prompt
    return total


def processed_token_count(steps: Sequence) -> int:
    """The tokens the model read or wrote in one generation's steps, each once: a step's prompt
    counts only past the longest prefix it shares with its episode's previous prompt and reply (a
    grown chat's tool results count, a rebuilt prompt counts whole). Steps in turn order per episode."""
    previous: dict[int, list[int]] = {}
    total = 0
    for step in steps:
        prompt = list(step.prompt_ids)
        total += len(prompt) - _shared_prefix(previous.get(step.traj, []), prompt) + len(step.completion_ids)
        previous[step.traj] = prompt + list(step.completion_ids)
    return total


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
) -> tuple[dict[str, float], dict[str, int]]:
    """GRPOTrainer's own metrics of one generation over every rank (`summarise_episodes` → `trl_metrics`)
    and its token counts over every rank: "trl" (`trl_token_count`, what TRL adds to
    `num_input_tokens_seen`), "processed" (`processed_token_count`) and "all_turns" (every step's whole
    prompt and completion)."""
    from accelerate.utils import gather_object

    summaries = summarise_episodes(
        rollout, stop_token_ids, rank=accelerator.process_index, single_source=single_source, failed_scored=failed_scored
    )
    steps = rollout.steps
    counts = [trl_token_count(steps), processed_token_count(steps), sum(len(s.prompt_ids) + len(s.completion_ids) for s in steps)]
    tokens = torch.tensor([counts], device=accelerator.device)
    if accelerator.num_processes > 1:
        summaries = gather_object(summaries)
    totals = [int(n) for n in accelerator.gather(tokens).sum(dim=0)]
    return trl_metrics(summaries, reward_func_names, tools=tools), dict(zip(("trl", "processed", "all_turns"), totals))
