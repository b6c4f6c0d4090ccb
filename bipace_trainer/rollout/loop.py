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
(`continuous.continuous_stream`; see `run_rollouts`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from envs.base import MILESTONE_PLAN

from .adapters import EnvAdapter, TextEnvAdapter, is_failure
from .continuous import InlineEnvRunner, ThreadEnvRunner, continuous, continuous_stream
from .lockstep import lockstep
from .play import LoopState, Play, PromptCounter
from .sync import LocalSync
from .types import (
    ROLLOUT_MODES, Action, EnvSpec, Episode, Generation, Generator, Rollout, RolloutSettings, StepRecord,
    StreamingGenerator, TaskRef,
)

__all__ = [
    "Generation",
    "Generator",
    "StreamingGenerator",
    "StepRecord",
    "Episode",
    "Rollout",
    "RolloutSettings",
    "EnvSpec",
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

_is_failure = is_failure  # the name other modules imported before the split


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
    streaming = isinstance(generate, StreamingGenerator)
    if streaming and settings.mode != "continuous":
        raise ValueError(
            f"rollout_mode={settings.mode!r} needs a generate callable; a StreamingGenerator plays "
            "rollout_mode='continuous' only."
        )
    adapter = adapter or TextEnvAdapter(settings)
    rollout_start = clock()
    seconds = {"generate": 0.0, "env": 0.0, "hidden": 0.0, "env_wait": 0.0}
    play = _start(envs, tasks, adapter, traj_offset, seconds, clock)
    state = LoopState(envs, generate, settings, sync or LocalSync(), adapter, play, PromptCounter(), seconds, clock,
                      on_turn, env_runner)  # fmt: skip
    loop = lockstep if settings.mode == "lockstep" else continuous_stream if streaming else continuous
    generate_calls = loop(state)
    for episode, done in zip(play.episodes, play.done):
        episode.truncated = episode.truncated or not done
    seconds["rollout"] = clock() - rollout_start
    rollout = Rollout(
        steps=play.steps, episodes=play.episodes, seconds=seconds, generate_calls=generate_calls,
        prompt_counts=state.counter.counts, engine_steps=generate_calls if streaming else 0,
    )
    if tasks:
        start = clock()
        adapter.finish(envs, rollout)
        seconds["env"] += clock() - start
        seconds["env_wait"] += clock() - start
        seconds["rollout"] = clock() - rollout_start
    return rollout


def _start(envs, tasks: Sequence[TaskRef], adapter: EnvAdapter, traj_offset: int, seconds, clock) -> Play:
    """Reset the envs (`adapter.start`): an episode whose reset failed has failed with no step, one
    solved at reset is won in zero steps."""
    n = len(tasks)
    episodes = [Episode(traj_offset + i, task.group, task.task_id, dict(task.attributes)) for i, task in enumerate(tasks)]
    start = clock()
    current = list(adapter.start(envs if n else None, tasks))
    seconds["env"] += clock() - start
    seconds["env_wait"] += clock() - start
    for episode, result in zip(episodes, current):
        episode.task = (result.info or {}).get("task", "") if result is not None else ""
        plan = (result.info or {}).get(MILESTONE_PLAN) if result is not None else None
        episode.milestones = tuple(plan) if plan is not None else None
    done = [False] * n
    for i, result in enumerate(current):
        if is_failure(result):  # zero-length episode
            done[i] = True
            episodes[i].failed = True
            episodes[i].failure = (result.info or {}).get("env_failure", "reset returned nothing") if result else ""
        elif result.done:
            done[i] = True
            episodes[i].won = result.won  # solved at reset: a success in zero steps
    return Play(tasks, episodes, current, done)
