"""Multi-turn rollouts over many envs, lockstep or continuous → flat step records (docs/concepts/math.md#step-records).

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

`settings.mode="continuous"` plays the same episodes without the turn barrier: see
`run_rollouts`. It goes through the same adapters and gives the same `Rollout`. What it
overlaps: one env step (the `adapter.step` of the previous call's episodes) with the next
generate call. What it does not: two generate calls with each other (TRL's
`_generate_single_turn` is synchronous; under vLLM the engine batches continuously
inside a call, and a call still ends with its longest reply), nor the KV cache of a
prompt across calls (HF `generate` prefills every prompt, copies included;
`PromptCounter` counts what could be reused). Env steps then run on a worker thread: an
engine that must stay on the main thread (the "serial" backend with `step_timeout=None`)
needs lockstep.

A generator with the streaming interface (`StreamingGenerator`: `submit` prompts, `step` an
engine, e.g. `vllm_stream.StreamTurns` over vLLM colocate's engine) plays "continuous" at the
engine level instead: each ready episode's prompt enters the engine as soon as it is ready,
and each reply leaves it when it is done, not when the longest reply of its call is
(`_continuous_stream`; see `run_rollouts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from envs.base import StepResult

from .actions import parse_reply, token_prefix_key
from ..advantages import StepBatch
from .prompting import action_for_env, build_messages

__all__ = [
    "Generation",
    "Generator",
    "StreamingGenerator",
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
    "ROLLOUT_MODES",
    "PromptCounter",
    "InlineEnvRunner",
    "ThreadEnvRunner",
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
    mode: str = "lockstep"  # "lockstep" or "continuous" (ROLLOUT_MODES; see run_rollouts)


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
    generate_calls: int = 0  # generate calls; through a StreamingGenerator, engine steps
    engine_steps: int = 0  # engine steps of a StreamingGenerator (0: played by generate calls)
    reward_metrics: dict[str, float] = field(default_factory=dict)  # what reward functions logged (`log_metric`)
    prompt_counts: dict[str, int] = field(default_factory=dict)  # PromptCounter's tallies over the generate calls

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


class PromptCounter:
    """Prompt tokens sent to the engine, and how many of them it could have skipped.

    - prompt_tokens: every prompt token of every generate call (what HF `generate` prefills);
    - prompt_tokens_shared: tokens of prompts identical to an earlier prompt of the same call
      (a group's G turn-0 prompts are G copies of one): vLLM's prefix cache encodes them once,
      HF `generate` encodes every copy;
    - prompt_tokens_prefix_of_previous: tokens at the start of a prompt that repeat the same
      episode's previous prompt and reply (the history that only grew): what a KV cache kept
      across turns could skip. Neither HF path here keeps one, so this counts, it does not save.
    """

    def __init__(self):
        self.counts = {"prompt_tokens": 0, "prompt_tokens_shared": 0, "prompt_tokens_prefix_of_previous": 0}
        self.previous: dict[int, list[int]] = {}  # episode -> its last prompt + reply

    def add(self, episodes: Sequence[int], generation: Generation) -> None:
        """One generate call: its prompts, then their replies."""
        self.add_prompts(episodes, generation.prompt_ids)
        self.add_replies(episodes, generation.prompt_ids, generation.completion_ids)

    def add_replies(self, episodes: Sequence[int], prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]]) -> None:
        """What each episode's next prompt may repeat: this prompt and its reply."""
        for i, prompt, completion in zip(episodes, prompt_ids, completion_ids):
            self.previous[i] = list(prompt) + list(completion)

    def add_prompts(self, episodes: Sequence[int], prompt_ids: Sequence[list[int]]) -> None:
        """Prompts sent together (one generate call, or one round of submissions to a stream)."""
        seen: set[tuple[int, ...]] = set()
        for i, prompt in zip(episodes, prompt_ids):
            key = tuple(prompt)
            self.counts["prompt_tokens"] += len(prompt)
            if key in seen:
                self.counts["prompt_tokens_shared"] += len(prompt)
            seen.add(key)
            before = self.previous.get(i)
            if before is not None:
                common = 0
                for a, b in zip(before, prompt):
                    if a != b:
                        break
                    common += 1
                self.counts["prompt_tokens_prefix_of_previous"] += common


class InlineEnvRunner:
    """Runs an env step where it is asked for: the lockstep rollout's way."""

    def submit(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def result(self, handle: Any) -> Any:
        return handle

    def close(self) -> None:
        pass


class ThreadEnvRunner:
    """Runs env steps on one worker thread while the calling thread generates: the
    continuous rollout's way. One step call is in flight at a time, so a `VectorEnv`
    (whose own backend may fan the call out) is never entered by two threads at once."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-env")

    def submit(self, fn: Callable[[], Any]) -> Any:
        return self.pool.submit(fn)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _Play:
    """The per-episode bookkeeping both rollout modes share: turning a reply, its action and
    the env's result into a `StepRecord` and updating the `Episode`."""

    def __init__(self, tasks, episodes, current, done):
        self.tasks, self.episodes, self.current, self.done = tasks, episodes, current, done
        self.steps: list[StepRecord] = []

    def record(self, i, turn, result, action, prompt_ids, completion_ids, text, hidden, logprobs) -> None:
        episode = self.episodes[i]
        failed = _is_failure(result)
        reward = 0.0 if failed else float(result.reward)
        self.steps.append(
            StepRecord(
                group=self.tasks[i].group,
                traj=episode.traj,
                t=turn,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                reply=text,
                action=action.command if action.command is not None else "",
                valid=action.valid,
                action_key=action.key,
                anchor=self.current[i].anchor,
                observation=self.current[i].observation,
                reward=reward,
                hidden=hidden,
                sampling_logprobs=logprobs,
            )
        )
        episode.length += 1
        episode.reward += reward
        episode.invalid_steps += not action.valid
        if failed:
            self.done[i] = episode.failed = True
            episode.failure = (result.info or {}).get("env_failure", "") if result else "no result"
            return
        episode.won = episode.won or result.won
        if "score" in (result.info or {}):
            episode.score = float(result.info["score"])
        episode.truncated = "truncated" in (result.info or {})
        self.current[i] = result
        self.done[i] = result.done


def _call(generate, adapter, messages, environments) -> Generation:
    if adapter.uses_tools:
        return generate(messages, environments=environments)
    return generate(messages)


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
    clock: Callable[[], float] = time.perf_counter,
    env_runner: Any = None,
) -> Rollout:
    """Play `tasks[i]` in env i of `envs` (a `VectorEnv` with len(tasks) envs), in `settings.mode`.

    "lockstep" (the default): every turn, all active envs' prompts are generated (in calls
    of at most `rollout_batch_size`), then all envs step at once; the next turn waits for both.

    "continuous": each episode advances on its own. The ready episodes (reset, or their
    env step returned) are kept in (turn, index) order; the next generate call takes the
    first `rollout_batch_size` of them (0: all ready), their replies go to their envs in
    one `adapter.step` on a worker thread (`ThreadEnvRunner`), and while that step runs
    the next call is formed from the episodes ready *before* it and generated. The step
    is joined after that call returns, so which episodes share a call depends only on the
    replies, never on thread timing: under a seed a run is repeatable. When nothing is
    ready, the loop waits for the step in flight (`seconds["env_wait"]`). Envs overlap
    generation only when a call holds fewer episodes than are playing: with
    `rollout_batch_size=0` every call takes all ready episodes and the loop is lockstep
    with other bookkeeping. Steps come back sorted as lockstep orders them (turn, then env).
    With `sync`, every rank makes the same number of generate calls (an empty call is a
    dummy generation), for generation backends that gather across ranks (vLLM); a per-rank
    backend (HF `generate` under DDP) needs no `sync` in this mode.

    "continuous" with a `StreamingGenerator` (an engine this process owns, e.g. vLLM
    colocate): no calls at all. The ready episodes' prompts are submitted in (turn, index)
    order, at most `rollout_batch_size` requests in the engine at once (0: no cap; the
    engine's own `max_num_seqs` still bounds its batch); then one engine step runs, and the
    episodes whose replies finished in it are parsed and sent to their envs in one
    `adapter.step` on the worker thread. That env step is joined after the *next* engine
    step (or at once when nothing else is in the engine), and its episodes are submitted
    before the one after: which requests share an engine step depends only on the replies,
    never on thread timing. `Rollout.generate_calls` and `engine_steps` are then the engine
    steps run; `sync` is not used (every rank's engine is its own).

    Args:
        envs: a `VectorEnv` (or anything with the same reset/step contract).
        tasks: one `TaskRef` per env; rollouts of one task share its `group`.
        generate: maps a list of chat messages to a `Generation` (`Generator`), or a
            `StreamingGenerator` ("continuous" only).
        settings: turn budget, history window, parsing options, `mode`.
        sync: cross-rank reductions (`LocalSync` for one process).
        traj_offset: first trajectory id (keeps ids unique across calls or ranks).
        on_turn: called after every turn with (turn, envs still playing), e.g. to show progress
            (continuous: when the slowest episode has finished that turn).
        adapter: the kind of environment (`EnvAdapter`); default `TextEnvAdapter(settings)`.
        clock: the time source of `Rollout.seconds` (a simulation passes its virtual clock).
        env_runner: where continuous env steps run (default `ThreadEnvRunner()`; a
            simulation passes one that runs them on its virtual clock).
    """
    if settings.mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode={settings.mode!r} must be one of {ROLLOUT_MODES}.")
    sync = sync or LocalSync()
    adapter = adapter or TextEnvAdapter(settings)
    rollout_start = clock()
    seconds = {"generate": 0.0, "env": 0.0, "hidden": 0.0, "env_wait": 0.0}
    n = len(tasks)
    episodes = [Episode(traj_offset + i, task.group, task.task_id, dict(task.attributes)) for i, task in enumerate(tasks)]
    start = clock()
    current = list(adapter.start(envs if n else None, tasks))
    seconds["env"] += clock() - start
    seconds["env_wait"] += clock() - start
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
    play = _Play(tasks, episodes, current, done)
    counter = PromptCounter()
    streaming = isinstance(generate, StreamingGenerator)
    if streaming and settings.mode != "continuous":
        raise ValueError(
            f"rollout_mode={settings.mode!r} needs a generate callable; a StreamingGenerator plays "
            "rollout_mode='continuous' only."
        )
    loop = _lockstep if settings.mode == "lockstep" else _continuous_stream if streaming else _continuous
    generate_calls = loop(envs, generate, settings, sync, adapter, play, counter, seconds, clock, on_turn, env_runner)
    for i in range(n):
        if not done[i]:
            episodes[i].truncated = True
    seconds["rollout"] = clock() - rollout_start
    rollout = Rollout(
        steps=play.steps, episodes=episodes, seconds=seconds, generate_calls=generate_calls, prompt_counts=counter.counts,
        engine_steps=generate_calls if streaming else 0,
    )
    if n:
        start = clock()
        adapter.finish(envs, rollout)
        seconds["env"] += clock() - start
        seconds["env_wait"] += clock() - start
        seconds["rollout"] = clock() - rollout_start
    return rollout


def _timed_generate(generate, adapter, batches, environments, seconds, clock) -> list[Generation]:
    outputs = []
    start = clock()
    for messages, envs_of_batch in zip(batches, environments):
        outputs.append(_call(generate, adapter, messages, envs_of_batch))
    hidden_seconds = sum(out.hidden_seconds for out in outputs)
    seconds["generate"] += clock() - start - hidden_seconds
    seconds["hidden"] += hidden_seconds
    return outputs


def _lockstep(envs, generate, settings, sync, adapter, play, counter, seconds, clock, on_turn, env_runner) -> int:
    done, current, n = play.done, play.current, len(play.done)
    generate_calls = 0
    for turn in range(settings.max_turns):
        active = [i for i in range(n) if not done[i]]
        if not sync.any(bool(active)):
            break
        messages = [adapter.messages(i, turn) for i in active]
        environments = [adapter.environment(i) for i in active]
        chunk = settings.rollout_batch_size or max(len(active), 1)
        num_calls = sync.max(math.ceil(len(active) / chunk))
        cuts = [slice(c * chunk, (c + 1) * chunk) for c in range(num_calls)]
        outputs = _timed_generate(
            generate, adapter, [messages[cut] for cut in cuts],
            [environments[cut] if adapter.uses_tools else None for cut in cuts], seconds, clock,
        )
        generate_calls += num_calls
        for c, out in enumerate(outputs):
            counter.add(active[cuts[c]], out)
        prompt_ids = [ids for out in outputs for ids in out.prompt_ids]
        completion_ids = [ids for out in outputs for ids in out.completion_ids]
        texts = [text for out in outputs for text in out.texts]
        hidden_rows = [out.hidden for out in outputs if out.hidden is not None and len(out.hidden)]
        hidden = torch.cat(hidden_rows) if hidden_rows else None
        logprobs = [lp for out in outputs for lp in out.logprobs] if all(out.logprobs is not None for out in outputs) else None

        actions: list[Action | None] = [None] * n
        for j, i in enumerate(active):
            actions[i] = adapter.act(i, texts[j], prompt_ids[j], completion_ids[j])
        start = clock()
        results = adapter.step(envs, actions) if active else [None] * n
        seconds["env"] += clock() - start
        seconds["env_wait"] += clock() - start  # lockstep waits out every env step

        for j, i in enumerate(active):
            play.record(
                i, turn, results[i], actions[i], prompt_ids[j], completion_ids[j], texts[j],
                hidden[j] if hidden is not None else None, logprobs[j] if logprobs is not None else None,
            )
        if on_turn is not None:
            on_turn(turn, done.count(False))
    return generate_calls


class _Episodes:
    """What both continuous loops track per episode: its turn, the ready queue, the one env
    step in flight on the runner, and which turns every episode has finished (`on_turn`)."""

    def __init__(self, envs, adapter, settings, play, seconds, clock, on_turn, env_runner):
        self.envs, self.adapter, self.settings, self.play = envs, adapter, settings, play
        self.seconds, self.clock, self.on_turn = seconds, clock, on_turn
        self.runner = env_runner if env_runner is not None else ThreadEnvRunner()
        n = len(play.done)
        self.turn = [0] * n
        self.ready = [i for i in range(n) if not play.done[i]]
        self.in_flight = None  # (handle, the batch's records) of the env step running now
        self.reported = -1  # the last turn every episode has finished (for on_turn)

    def take_ready(self, count: int | None = None) -> list[int]:
        """The first `count` ready episodes (None: all) in (turn, index) order, out of the queue."""
        self.ready.sort(key=lambda i: (self.turn[i], i))
        count = len(self.ready) if count is None else count
        batch, self.ready[:] = self.ready[:count], self.ready[count:]
        return batch

    def records(self, batch, out: Generation, actions: list) -> list:
        """Each reply of `out` (row j is episode batch[j]) parsed into actions[i]; the rows to record."""
        rows = []
        for j, i in enumerate(batch):
            actions[i] = self.adapter.act(i, out.texts[j], out.prompt_ids[j], out.completion_ids[j])
            hidden = out.hidden[j] if out.hidden is not None and len(out.hidden) else None
            logprobs = out.logprobs[j] if out.logprobs is not None else None
            rows.append((i, actions[i], out.prompt_ids[j], out.completion_ids[j], out.texts[j], hidden, logprobs))
        return rows

    def send(self, actions, rows) -> None:
        """Step the envs of `rows` on the runner (nothing else may be in flight)."""
        clock, adapter, envs = self.clock, self.adapter, self.envs

        def step_batch():
            start = clock()
            results = adapter.step(envs, actions)
            return results, clock() - start

        self.in_flight = (self.runner.submit(step_batch), rows)

    def land(self) -> None:
        """Join the env step in flight: record its steps, queue the episodes that go on."""
        if self.in_flight is None:
            return
        (handle, batch), self.in_flight = self.in_flight, None
        start = self.clock()
        results, env_seconds = self.runner.result(handle)
        self.seconds["env_wait"] += self.clock() - start
        self.seconds["env"] += env_seconds
        turn, done = self.turn, self.play.done
        for i, action, prompt_ids, completion_ids, text, hidden, logprobs in batch:
            self.play.record(i, turn[i], results[i], action, prompt_ids, completion_ids, text, hidden, logprobs)
            turn[i] += 1
            if not done[i] and turn[i] < self.settings.max_turns:
                self.ready.append(i)
        self.report_turns()

    def report_turns(self) -> None:
        if self.on_turn is None:
            return
        turn, done, max_turns = self.turn, self.play.done, self.settings.max_turns
        playing = [turn[i] for i in range(len(turn)) if not done[i] and turn[i] < max_turns]
        finished = min(playing) - 1 if playing else max_turns - 1
        while self.reported < finished:
            self.reported += 1
            self.on_turn(self.reported, len(playing))

    def close(self) -> None:
        """Let an env step still in flight (an error above) finish before the envs are reused."""
        if self.in_flight is not None:
            try:
                self.runner.result(self.in_flight[0])
            except Exception:  # noqa: BLE001 - the first error is the one to raise
                pass
            self.in_flight = None
        self.runner.close()

    def finish(self) -> None:
        self.report_turns()
        self.play.steps.sort(key=lambda s: (s.t, s.traj))  # lockstep's order: turn, then env


def _continuous(envs, generate, settings, sync, adapter, play, counter, seconds, clock, on_turn, env_runner) -> int:
    state = _Episodes(envs, adapter, settings, play, seconds, clock, on_turn, env_runner)
    n = len(play.done)
    generate_calls = 0
    try:
        while True:
            if not state.ready and state.in_flight is not None:
                state.land()
            if not sync.any(bool(state.ready) or state.in_flight is not None):
                break
            batch = state.take_ready(settings.rollout_batch_size or None)
            messages = [adapter.messages(i, state.turn[i]) for i in batch]
            environments = [adapter.environment(i) for i in batch] if adapter.uses_tools else None
            (out,) = _timed_generate(generate, adapter, [messages], [environments], seconds, clock)
            generate_calls += 1
            counter.add(batch, out)
            actions: list[Action | None] = [None] * n
            rows = state.records(batch, out, actions)
            state.land()  # joined only now: the call above was formed without it
            if batch:
                state.send(actions, rows)
    finally:
        state.close()
    state.finish()
    return generate_calls


def _continuous_stream(envs, generate, settings, sync, adapter, play, counter, seconds, clock, on_turn, env_runner) -> int:
    """`run_rollouts`' "continuous" through a `StreamingGenerator`: see its docstring."""
    state = _Episodes(envs, adapter, settings, play, seconds, clock, on_turn, env_runner)
    n = len(play.done)
    index = {episode.traj: i for i, episode in enumerate(play.episodes)}
    cap = settings.rollout_batch_size
    running = 0  # requests in the engine
    engine_steps = 0
    try:
        while True:
            batch = state.take_ready(max(cap - running, 0) if cap else None)
            if batch:
                keys = [(play.episodes[i].traj, state.turn[i]) for i in batch]
                messages = [adapter.messages(i, state.turn[i]) for i in batch]
                environments = [adapter.environment(i) for i in batch] if adapter.uses_tools else None
                start = clock()
                prompt_ids = generate.submit(keys, messages, environments)
                seconds["generate"] += clock() - start
                counter.add_prompts(batch, prompt_ids)
                running += len(batch)
            if not running:  # nothing to generate: wait for the envs, or stop
                if state.in_flight is None:
                    break
                state.land()
                continue
            start = clock()
            keys, out = generate.step()
            seconds["generate"] += clock() - start - out.hidden_seconds
            seconds["hidden"] += out.hidden_seconds
            engine_steps += 1
            running -= len(keys)
            finished = [index[traj] for traj, _ in keys]
            counter.add_replies(finished, out.prompt_ids, out.completion_ids)
            actions: list[Action | None] = [None] * n
            rows = state.records(finished, out, actions)
            state.land()  # the env step sent after the previous engine step: joined only after this one
            if finished:
                state.send(actions, rows)
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to raise
            generate.abort()  # the engine must not keep this rollout's requests for the next one
        raise
    finally:
        state.close()
        if (close := getattr(generate, "close", None)) is not None:
            close()
    state.finish()
    return engine_steps
