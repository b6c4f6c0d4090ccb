"""The continuous rollout: each episode advances on its own, its env step beside the next generation.

Two ways (see `loop.run_rollouts`): `continuous`, through generate calls, and `continuous_stream`,
through a `StreamingGenerator` whose engine batches requests continuously (e.g. `vllm_stream`).
Env steps run on an env runner (`ThreadEnvRunner`: one worker thread; `InlineEnvRunner`: in place).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .play import LoopState, timed_generate
from .types import Action, Generation

__all__ = ["continuous", "continuous_stream", "InlineEnvRunner", "ThreadEnvRunner"]


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



class _Episodes:
    """What both continuous loops track per episode: its turn, the ready queue, the one env
    step in flight on the runner, and which turns every episode has finished (`on_turn`)."""

    def __init__(self, loop: LoopState):
        self.envs, self.adapter, self.settings, self.play = loop.envs, loop.adapter, loop.settings, loop.play
        self.seconds, self.clock, self.on_turn = loop.seconds, loop.clock, loop.on_turn
        self.runner = loop.env_runner if loop.env_runner is not None else ThreadEnvRunner()
        n = len(self.play.done)
        self.turn = [0] * n
        self.ready = [i for i in range(n) if not self.play.done[i]]
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



def continuous(loop: LoopState) -> int:
    """`run_rollouts`' "continuous" through generate calls: see its docstring. Returns the calls made."""
    generate, settings, sync, adapter, play = loop.generate, loop.settings, loop.sync, loop.adapter, loop.play
    counter, seconds, clock = loop.counter, loop.seconds, loop.clock
    state = _Episodes(loop)
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
            (out,) = timed_generate(generate, adapter, [messages], [environments], seconds, clock)
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



def continuous_stream(loop: LoopState) -> int:
    """`run_rollouts`' "continuous" through a `StreamingGenerator`: see its docstring. Returns the engine steps run."""
    generate, settings, adapter, play = loop.generate, loop.settings, loop.adapter, loop.play
    counter, seconds, clock = loop.counter, loop.seconds, loop.clock
    state = _Episodes(loop)
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

