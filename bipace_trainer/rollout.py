"""Lockstep multi-turn rollouts over many envs → flat step records (SPEC §1).

    rollout = run_rollouts(envs, tasks, generate, RolloutSettings(max_turns=15, ...))
    rollout.steps        # one StepRecord per env step = one training sample
    rollout.episodes     # one Episode per (task, rollout)
    rollout.step_batch() # the estimator's input

Every turn, the prompts of all still-active envs are built, generated in batches by
`generate`, parsed into actions, and sent to the envs in one `VectorEnv.step`. What a
prompt is and how a reply becomes an action belong to the kind of environment, an
`EnvAdapter`: `TextEnvAdapter` (our `TextEnv`s: task, last `history_length`
observation/action pairs, current observation, admissible actions; a `<action>` reply)
is the default, `tool_envs.ToolEnvAdapter` plays TRL's `environment_factory` envs
(a chat with tools; a reply's tool calls). The loop is the same for every kind. An
episode ends when its env says done, when the env fails (the episode counts as
failed), or at `max_turns` (truncated: neither success nor an env end). A malformed
reply is an invalid step, penalised later; a text env receives its harmless
`invalid_action` instead.

Distributed training needs every rank to make the same generate calls (ZeRO-3 gathers
parameters collectively inside each call). `sync` carries that: the loop runs while
*any* rank has an active env, and the number of generate calls per turn is the
maximum over ranks; a rank with nothing left calls `generate([])`, which the trainer
turns into a dummy generation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Protocol, Sequence

import torch

from envs.base import StepResult

from .actions import parse_reply, token_prefix_key
from .advantages import StepBatch
from .prompting import action_for_env, build_messages

__all__ = [
    "Generation",
    "StepRecord",
    "Episode",
    "Rollout",
    "RolloutSettings",
    "TaskRef",
    "LocalSync",
    "Action",
    "EnvAdapter",
    "TextEnvAdapter",
    "run_rollouts",
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


class LocalSync:
    """Single-process stand-in for the cross-rank reductions the rollout needs."""

    def any(self, flag: bool) -> bool:
        return flag

    def max(self, value: int) -> int:
        return value


@dataclass(frozen=True)
class TaskRef:
    """One rollout to run: env task id, its task group, and attributes for reporting.
    `inputs` is the dataset row the task came from, for envs that reset from a row (TRL's)."""

    task_id: int
    group: int
    attributes: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] | None = field(default=None, compare=False)


@dataclass
class RolloutSettings:
    max_turns: int = 15
    history_length: int = 2
    rollout_batch_size: int = 0  # most prompts per generate call; 0 = all active envs
    require_think: bool = False
    action_key_tokens: int = 0  # > 0: key actions on their first k tokens
    instruction: str = ""
    invalid_action: str = "look"


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


@dataclass
class Rollout:
    """What `run_rollouts` played: the steps in batch order, one `Episode` per task, and wall
    times in seconds: the whole rollout ("rollout"), generation ("generate", without
    "hidden"), the envs ("env"), and the passes run only for hidden states ("hidden")."""

    steps: list[StepRecord]
    episodes: list[Episode]
    seconds: dict[str, float]
    generate_calls: int = 0
    reward_metrics: dict[str, float] = field(default_factory=dict)  # what reward functions logged (`log_metric`)

    def step_batch(self) -> StepBatch:
        """The estimator's input: one row per step (hidden stacked when every step has it)."""
        steps = self.steps
        hidden = None
        if steps and all(s.hidden is not None for s in steps):
            hidden = torch.stack([s.hidden for s in steps])
        last_of_cut = {e.traj: e.length - 1 for e in self.episodes if e.truncated}  # the turn budget ended these
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
        )

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


class EnvAdapter:
    """One kind of environment as `run_rollouts` plays it: what the prompt of env i is,
    how a reply becomes an action, and how the envs are stepped.

    `start` resets the envs for `tasks` and returns the first results (a `StepResult`
    whose `info` has "env_failure" fails that episode); `messages(i, turn)` is env i's
    chat prompt; `act` parses env i's reply; `step` sends the actions (None: inactive)
    and returns the results, updating the adapter's own per-episode state (history, a
    chat); `finish` may add end-of-episode rewards once every episode is over. A result
    whose `info` holds "truncated" ends its episode as cut by a budget, not by the env.
    The trainer-side part of a kind (its tasks, its `VectorEnv`) is in `collector.py`.
    """

    uses_tools = False  # prompts are rendered with the tool schema of `environment(i)`

    def start(self, envs, tasks: Sequence[TaskRef]) -> list[StepResult | None]:
        raise NotImplementedError

    def messages(self, i: int, turn: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def environment(self, i: int) -> Hashable:
        return None

    def act(self, i: int, text: str, prompt_ids: list[int], completion_ids: list[int]) -> Action:
        raise NotImplementedError

    def step(self, envs, actions: list[Action | None]) -> list[StepResult | None]:
        raise NotImplementedError

    def finish(self, envs, rollout: "Rollout") -> None:
        """Called once, after the last turn; the default adds nothing."""


class TextEnvAdapter(EnvAdapter):
    """Our `TextEnv`s: a GiGPO-format prompt (`prompting.build_messages`) and an
    `<action>` reply (`actions.parse_reply`); a malformed one sends `invalid_action`."""

    def __init__(self, settings: RolloutSettings):
        self.settings = settings

    def start(self, envs, tasks):
        self.current = envs.reset([task.task_id for task in tasks]) if tasks else []
        self.task_text = [(r.info or {}).get("task", "") if r is not None else "" for r in self.current]
        self.history: list[list[tuple[str, str]]] = [[] for _ in tasks]
        return self.current

    def messages(self, i, turn):
        settings, current = self.settings, self.current[i]
        return build_messages(
            settings.instruction,
            self.task_text[i],
            self.history[i],
            current.observation,
            current.admissible_actions,
            step_index=turn,
            history_length=settings.history_length,
        )

    def act(self, i, text, prompt_ids, completion_ids):
        settings = self.settings
        reply = parse_reply(text, require_think=settings.require_think)
        key = token_prefix_key(completion_ids, settings.action_key_tokens) if settings.action_key_tokens else reply.key
        return Action(action_for_env(reply, settings.invalid_action), reply.valid, key, reply)

    def step(self, envs, actions):
        results = envs.step([a.command if a is not None else None for a in actions]) if any(actions) else [None] * len(actions)
        for i, (action, result) in enumerate(zip(actions, results)):
            if action is not None and not _is_failure(result):
                self.history[i].append((self.current[i].observation, action.command))
                self.current[i] = result
        return results


def _is_failure(result: StepResult | None) -> bool:
    return result is None or "env_failure" in (result.info or {})


def run_rollouts(
    envs,
    tasks: Sequence[TaskRef],
    generate: Generator | Callable[..., Generation],
    settings: RolloutSettings,
    *,
    sync: LocalSync | None = None,
    traj_offset: int = 0,
    on_turn: Callable[[int, int], None] | None = None,
    adapter: EnvAdapter | None = None,
) -> Rollout:
    """Play `tasks[i]` in env i of `envs` (a `VectorEnv` with len(tasks) envs) in lockstep.

    Args:
        envs: a `VectorEnv` (or anything with the same reset/step contract).
        tasks: one `TaskRef` per env; rollouts of one task share its `group`.
        generate: maps a list of chat messages to a `Generation` (`Generator`).
        settings: turn budget, history window, parsing options.
        sync: cross-rank reductions (`LocalSync` for one process).
        traj_offset: first trajectory id (keeps ids unique across calls or ranks).
        on_turn: called after every turn with (turn, envs still playing), e.g. to show progress.
        adapter: the kind of environment (`EnvAdapter`); default `TextEnvAdapter(settings)`.
    """
    sync = sync or LocalSync()
    adapter = adapter or TextEnvAdapter(settings)
    rollout_start = time.perf_counter()
    seconds = {"generate": 0.0, "env": 0.0, "hidden": 0.0}
    n = len(tasks)
    episodes = [Episode(traj_offset + i, task.group, task.task_id, dict(task.attributes)) for i, task in enumerate(tasks)]
    start = time.perf_counter()
    current = list(adapter.start(envs if n else None, tasks))
    seconds["env"] += time.perf_counter() - start
    for episode, result in zip(episodes, current):
        episode.task = (result.info or {}).get("task", "") if result is not None else ""
    done = [False] * n
    for i, result in enumerate(current):
        if _is_failure(result):  # zero-length episode
            done[i] = True
            episodes[i].failed = True
            episodes[i].failure = (result.info or {}).get("env_failure", "reset returned nothing") if result else ""
        elif result.done:
            done[i] = True
            episodes[i].won = result.won  # solved at reset: a success in zero steps
    steps: list[StepRecord] = []
    generate_calls = 0
    for turn in range(settings.max_turns):
        active = [i for i in range(n) if not done[i]]
        if not sync.any(bool(active)):
            break
        messages = [adapter.messages(i, turn) for i in active]
        environments = [adapter.environment(i) for i in active]
        chunk = settings.rollout_batch_size or max(len(active), 1)
        num_calls = sync.max(math.ceil(len(active) / chunk))
        outputs: list[Generation] = []
        start = time.perf_counter()
        for c in range(num_calls):
            batch = messages[c * chunk : (c + 1) * chunk]
            if adapter.uses_tools:
                outputs.append(generate(batch, environments=environments[c * chunk : (c + 1) * chunk]))
            else:
                outputs.append(generate(batch))
        hidden_seconds = sum(out.hidden_seconds for out in outputs)
        seconds["generate"] += time.perf_counter() - start - hidden_seconds
        seconds["hidden"] += hidden_seconds
        generate_calls += num_calls
        prompt_ids = [ids for out in outputs for ids in out.prompt_ids]
        completion_ids = [ids for out in outputs for ids in out.completion_ids]
        texts = [text for out in outputs for text in out.texts]
        hidden_rows = [out.hidden for out in outputs if out.hidden is not None and len(out.hidden)]
        hidden = torch.cat(hidden_rows) if hidden_rows else None
        logprobs = [lp for out in outputs for lp in out.logprobs] if all(out.logprobs is not None for out in outputs) else None

        actions: list[Action | None] = [None] * n
        for j, i in enumerate(active):
            actions[i] = adapter.act(i, texts[j], prompt_ids[j], completion_ids[j])
        start = time.perf_counter()
        results = adapter.step(envs, actions) if active else [None] * n
        seconds["env"] += time.perf_counter() - start

        for j, i in enumerate(active):
            result, action, episode = results[i], actions[i], episodes[i]
            failed = _is_failure(result)
            reward = 0.0 if failed else float(result.reward)
            steps.append(
                StepRecord(
                    group=tasks[i].group,
                    traj=episode.traj,
                    t=turn,
                    prompt_ids=prompt_ids[j],
                    completion_ids=completion_ids[j],
                    reply=texts[j],
                    action=action.command if action.command is not None else "",
                    valid=action.valid,
                    action_key=action.key,
                    anchor=current[i].anchor,
                    observation=current[i].observation,
                    reward=reward,
                    hidden=hidden[j] if hidden is not None else None,
                    sampling_logprobs=logprobs[j] if logprobs is not None else None,
                )
            )
            episode.length += 1
            episode.reward += reward
            episode.invalid_steps += not action.valid
            if failed:
                done[i] = episode.failed = True
                episode.failure = (result.info or {}).get("env_failure", "") if result else "no result"
                continue
            episode.won = episode.won or result.won
            if "score" in (result.info or {}):
                episode.score = float(result.info["score"])
            episode.truncated = "truncated" in (result.info or {})
            current[i] = result
            done[i] = result.done
        if on_turn is not None:
            on_turn(turn, done.count(False))
    for i in range(n):
        if not done[i]:
            episodes[i].truncated = True
    seconds["rollout"] = time.perf_counter() - rollout_start
    rollout = Rollout(steps=steps, episodes=episodes, seconds=seconds, generate_calls=generate_calls)
    if n:
        start = time.perf_counter()
        adapter.finish(envs, rollout)
        seconds["env"] += time.perf_counter() - start
        seconds["rollout"] = time.perf_counter() - rollout_start
    return rollout
