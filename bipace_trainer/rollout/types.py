"""What a rollout is made of: the generator's reply, the task to play, the settings, and what was played.

    Generation     what one generate call returns (prompt and completion ids, texts, hidden states, log-probs)
    Generator / StreamingGenerator   what the loops generate through (calls, or a stream of requests)
    TaskRef        one rollout to run; RolloutSettings: turn budget, history, parsing, mode
    StepRecord     one env step = one training sample; Episode: how one rollout went
    Rollout        the steps in batch order, the episodes, the wall times; `step_batch()` is the estimator's input
    Action         a reply made into an env action

These change when what a rollout records changes; the loops that fill them live in `lockstep`,
`continuous` and `loop` (`run_rollouts`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple, Protocol, runtime_checkable

import torch

from ..advantages import StepBatch

__all__ = [
    "Generation", "Generator", "StreamingGenerator", "TaskRef", "RolloutSettings", "EnvSpec", "ROLLOUT_MODES", "StepRecord",
    "Episode", "Rollout", "Action",
]


@dataclass
class Generation:
    """What a generate call returns for n prompts.

    prompt_ids / completion_ids: n token id lists; texts: n decoded replies;
    hidden: (n, d) hidden states at the last prompt token, or None;
    logprobs: n lists of the sampler's logprob of each completion token (vLLM), or None;
    hidden_seconds: the part of the call spent on a pass only for `hidden` (timed apart).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    hidden: torch.Tensor | None = None
    logprobs: list[list[float | None]] | None = None
    hidden_seconds: float = 0.0


class Generator(Protocol):
    """Maps chat prompts to a `Generation`; `environments` (one per prompt, given only by an
    adapter with `uses_tools`) names whose tool schema each prompt is rendered with."""

    def __call__(self, messages: list[list[dict[str, Any]]], environments: list[Hashable] | None = None) -> Generation: ...


@runtime_checkable
class StreamingGenerator(Protocol):
    """Generation as a stream of requests rather than calls: `run_rollouts` plays "continuous"
    through it at the engine level (`_continuous_stream`).

    `submit(keys, messages, environments)` tokenizes the chat prompts and adds one request
    per prompt (`keys[j]` = (trajectory id, turn): what seeds its sampling, so that a reply
    does not depend on which requests share an engine step); it returns the prompt ids.
    `step()` runs one engine step and returns the keys of the requests that finished in it
    and their `Generation` (one row each, in the engine's order). `abort()` drops every
    request still in the engine (the rollout failed and will not collect them). An optional
    `close()` is called when the rollout ends, either way (a server stream's threads go).
    `environments` is as for `Generator`."""

    def submit(
        self, keys: list[tuple[int, int]], messages: list[list[dict[str, Any]]], environments: list[Hashable] | None = None
    ) -> list[list[int]]: ...

    def step(self) -> tuple[list[tuple[int, int]], Generation]: ...

    def abort(self) -> None: ...



@dataclass(frozen=True)
class TaskRef:
    """One rollout to run: env task id, its task group, and attributes for reporting.
    `inputs` is the dataset row the task came from, for envs that reset from a row (TRL's)."""

    task_id: int
    group: int
    attributes: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollout reads of a run's settings, as plain values: the loop's (turns, prompts, replies)
    and the collector's (evaluation panels, progress, dumps, the estimator's return terms for them).
    The trainer and `bipace-eval` build it (`run.plan.rollout_settings`, `cli.evaluate`); the rollout
    never sees the run's config. `instruction` and `invalid_action` are the env's, filled by the collector."""

    max_turns: int = 15
    history_length: int = 2
    rollout_batch_size: int = 0  # most prompts per generate call; 0 = all active envs
    require_think: bool = False
    action_key_tokens: int = 0  # > 0: key actions on their first k tokens
    instruction: str = ""
    invalid_action: str = "look"
    mode: str = "lockstep"  # "lockstep" or "continuous" (ROLLOUT_MODES; see run_rollouts)
    eval_tasks: int = 32  # tasks an evaluation plays, stratified over the env's report key; 0 = all
    eval_rollouts_per_task: int = 1
    tool_errors: str = "observe"  # TRL's envs: a raising tool is shown to the model ("observe") or fails the episode
    disable_tqdm: bool = False
    rollout_dump_steps: int = 0  # every this-many optimizer steps a rollout dump (`trajectories`); 0 = none
    output_dir: str = ""  # where dumps go, and where the "every episode failed" error points
    # the estimator's, for the dumps' per-step returns (`trajectories.step_rows`); EstimatorSettings' defaults
    step_gamma: float = 0.95
    invalid_action_penalty: float = 0.1
    rollout_needs: frozenset[str] = frozenset()  # what the step term reads beyond rewards ("milestone": envs plan)


@dataclass(frozen=True)
class EnvSpec:
    """Which envs a rollout plays and how they are stepped (`envs.vector.VectorEnv`).

    Attributes:
        name: a registered `TextEnv` name or `package.module:Class` ("" for TRL's envs, built by the trainer).
        kwargs: the env's constructor options (`env_kwargs`).
        train_split, eval_split: the splits whose tasks training rows and evaluations name.
        backend: "serial", "thread" or "process" stepping; workers: the pool's size (None: one per env).
        step_timeout: seconds one env step may take before the episode fails (None: no limit).
    """

    name: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "valid"
    backend: str = "serial"
    workers: int | None = None
    step_timeout: float | None = 60.0


ROLLOUT_MODES = ("lockstep", "continuous")


@dataclass
class StepRecord:
    """One env step = one training sample. How its episode ended is the `Episode`'s."""

    group: int
    traj: int
    t: int
    prompt_ids: list[int]
    completion_ids: list[int]
    reply: str
    action: str
    valid: bool
    action_key: Any
    anchor: str
    reward: float
    observation: str = ""  # what the env showed the agent before this step
    hidden: torch.Tensor | None = None
    sampling_logprobs: list[float | None] | None = None  # the generation backend's, per completion token
    milestone: bool | None = None  # the env flagged this step as reaching a milestone (None: it says nothing)


@dataclass
class Episode:
    traj: int
    group: int
    task_id: int
    attributes: dict[str, Any]
    length: int = 0
    reward: float = 0.0
    won: bool = False
    failed: bool = False  # the env raised, hung or returned garbage
    truncated: bool = False  # the turn budget ended it
    invalid_steps: int = 0
    failure: str = ""
    score: float | None = None  # the env's own episode score (`info["score"]`, e.g. WebShop's), if it reports one
    task: str = ""  # the task text the env gave at reset
    tool_calls: int = 0  # TRL's envs: the tool calls the episode made, and how many returned an error
    tool_failures: int = 0
    reward_terms: dict[str, float] = field(default_factory=dict)  # reward by source (TRL's reward_func_names), unweighted
    # What the env returned after the episode's last action (a win, a turn-limit cut, a loss the env
    # ended): its observation and anchor. None when there is none: an env fault ended the episode (no
    # state was reached), or it took no step (a reset that failed or solved the task).
    final_observation: str | None = None
    final_anchor: str | None = None
    milestones: tuple[str, ...] | None = None  # the task's milestone plan, when the env gave one at reset


@dataclass
class Rollout:
    """What `run_rollouts` played: the steps in batch order, one `Episode` per task, and wall
    times in seconds: the whole rollout ("rollout"), generation ("generate", without
    "hidden"), the envs ("env"), and the passes run only for hidden states ("hidden")."""

    steps: list[StepRecord]
    episodes: list[Episode]
    seconds: dict[str, float]
    generate_calls: int = 0  # generate calls; through a StreamingGenerator, engine steps
    engine_steps: int = 0  # engine steps of a StreamingGenerator (0: played by generate calls)
    reward_metrics: dict[str, float] = field(default_factory=dict)  # what reward functions logged (`log_metric`)
    prompt_counts: dict[str, int] = field(default_factory=dict)  # PromptCounter's tallies over the generate calls

    def step_batch(self, hidden: torch.Tensor | None = None) -> StepBatch:
        """The estimator's input: one row per step. `hidden`: the (N, d) states of the steps captured
        apart from the rollout (the training batch's old-logprob pass); without it, the steps' own
        states, stacked when every step has one (captured in the generation).

        `next_anchor` is the anchor of the state each step led to: the next step's, and after an
        episode's last step the env's final observation (`Episode.final_anchor`), None (a dead end
        of its own) where an env fault left none. The graph return reads it (GraphGPO's next_obs)."""
        steps = self.steps
        if hidden is None and steps and all(s.hidden is not None for s in steps):
            hidden = torch.stack([s.hidden for s in steps])
        last_of_cut = {e.traj: e.length - 1 for e in self.episodes if e.truncated}  # the turn budget ended these
        plans = {e.traj: e.milestones for e in self.episodes}
        has_plans = any(plans[s.traj] is not None for s in steps)
        has_flags = has_plans or any(s.milestone is not None for s in steps)
        return StepBatch(
            group=[s.group for s in steps],
            traj=[s.traj for s in steps],
            t=[s.t for s in steps],
            reward=[s.reward for s in steps],
            valid=[s.valid for s in steps],
            anchor=[s.anchor for s in steps],
            action_key=[s.action_key for s in steps],
            hidden=hidden,
            truncated=[last_of_cut.get(s.traj) == s.t for s in steps],
            next_anchor=self.next_anchors(),
            milestone=[bool(s.milestone) for s in steps] if has_flags else None,
            milestone_plan=[plans[s.traj] for s in steps] if has_plans else None,
            action_text=[s.action for s in steps],
        )

    def next_anchors(self) -> list[str | None]:
        """Per step (batch order), the anchor of the state it led to (`step_batch`)."""
        anchor_at = {(s.traj, s.t): s.anchor for s in self.steps}
        end = {e.traj: e.final_anchor for e in self.episodes}
        return [anchor_at[(s.traj, s.t + 1)] if (s.traj, s.t + 1) in anchor_at else end.get(s.traj) for s in self.steps]

    def without_failed_episodes(self) -> "Rollout":
        """The rollout with the steps of env-failed episodes left out (`penalize_env_failures=False`):
        an env fault is not the policy's failure, so those steps enter neither the loss nor their
        group's statistics. The episodes stay, failed, for the episode metrics and the dumps."""
        failed = {e.traj for e in self.episodes if e.failed}
        if not failed:
            return self
        kept = [s for s in self.steps if s.traj not in failed]
        return dataclasses.replace(self, steps=kept)

    def metrics(self) -> dict[str, float]:
        """Episode statistics, namespaced for logging."""
        episodes = self.episodes
        n = max(len(episodes), 1)
        steps = max(len(self.steps), 1)
        out = {
            "episode/success_rate": sum(e.won for e in episodes) / n,
            "episode/length": sum(e.length for e in episodes) / n,
            "episode/reward": sum(e.reward for e in episodes) / n,
            "episode/truncated_rate": sum(e.truncated for e in episodes) / n,
            "episode/env_failures": float(sum(e.failed for e in episodes)),
            "episode/invalid_action_rate": sum(e.invalid_steps for e in episodes) / steps,
            "episode/steps": float(len(self.steps)),
        }
        if any(e.score is not None for e in episodes):  # an episode that never scored (no purchase) scores 0
            out["episode/score"] = sum(e.score or 0.0 for e in episodes) / n
        out.update({f"time/{name}_s": value for name, value in self.seconds.items()})
        wall = self.seconds.get("rollout", 0.0)
        if wall > 0:  # how much of the wall time the engine sat idle, and how much of it waited on envs
            busy = self.seconds.get("generate", 0.0) + self.seconds.get("hidden", 0.0)
            out["rollout/engine_idle_share"] = min(max(1.0 - busy / wall, 0.0), 1.0)
            out["rollout/env_wait_share"] = min(self.seconds.get("env_wait", 0.0) / wall, 1.0)
        if self.engine_steps:  # played through the engine's own continuous batching
            out["rollout/engine_steps"] = float(self.engine_steps)
        out.update({f"rollout/{name}": float(value) for name, value in self.prompt_counts.items()})
        if "prompt_tokens_reused" in self.prompt_counts:  # the engine said what it reused (collector)
            reused = self.prompt_counts["prompt_tokens_reused"]
            total = reused + self.prompt_counts.get("prompt_tokens_encoded", 0)
            out["rollout/prefix_cache_hit_rate"] = reused / total if total else 0.0
        out.update(self.reward_metrics)
        return out


class Action(NamedTuple):
    """A reply made into an env action: what the env receives (`command`; None: the
    episode ends here without an env call), whether the reply was well formed, the
    key PACE groups actions by, and the adapter's own parse (`parsed`)."""

    command: str | None
    valid: bool
    key: Any
    parsed: Any = None

