"""Many text envs stepped at once, with timeouts and failure capture.

    vec = VectorEnv("textcraft", num_envs=128, backend="process", num_workers=2)
    first = vec.reset(task_ids)          # list[StepResult], env i plays task_ids[i]
    nexts = vec.step(actions)            # actions[i] None: env i sits this turn out -> None
    vec.num_failures, vec.failures, vec.metrics()
    vec.close()

Failure contract. One broken env must not stop a rollout batch. When an env raises
(in reset or step), runs past `step_timeout`, or returns something that is not a
sane `StepResult` (a non-string observation, a non-finite reward, an info that is
not a dict...), its episode ends as failed:

    StepResult(observation="The environment failed (...); this episode is over.",
               reward=0.0, done=True, won=False, anchor=FAILURE_ANCHOR,
               info={"env_failure": "<kind>: <reason>"})

The failure is counted (`num_failures`, `failure_counts[kind]`, the latest
`failures`), the batch goes on, and the broken instance is dropped: the env is
rebuilt at its next reset. Observations longer than `max_observation_chars` are cut
with a note (not a failure: ALFWorld and ScienceWorld rooms can be long), but one
over ENORMOUS_FACTOR times that comes from a runaway engine and fails; anchors
that long are cut and suffixed with a hash of the full text, so exact matching
stays exact.

A reset result carries the episode's task text (`env.task`) in `info["task"]`: the
env object itself may live in a worker process. With `milestones=True` it also carries
the task's milestone plan (`env.milestones()`, for an env whose `milestone_kind` is "plan")
in `info["milestones"]`, for the estimators that read milestones (BEACON's). Envs are built on their first
reset, inside that call's time budget (a ScienceWorld env starts its JVM there). An
env whose dependency is missing (`EnvUnavailableError`) is a setup error, not a
failure: reset raises it.

Rewards beyond +-MAX_ABS_REWARD are a bad result too: the estimator squares them in
float32, where 1e39 is already infinite. An env that calls `sys.exit()` fails its
episode like one that raises.

Backends (`EnvBackend` subclasses, registered by name in `BACKENDS`; each runs a batch of
calls under this contract and VectorEnv counts and records the failures the same way for
all of them; add one with `@register_backend("name")` or pass the class as `backend`):
- "serial" (the default, `SerialBackend`): one env after another. With a `step_timeout` the calls run
  on one helper thread that the calling thread watches, so a hang past the timeout
  ends its episode exactly as in "thread"; with `step_timeout=None` they run in the
  calling thread itself (for engines that must stay on the main thread).
- "thread" (`ThreadBackend`): a pool of daemon threads. Suits engines that wait on another process
  (ScienceWorld's JVM), since the GIL is released while waiting. A call past the
  timeout is abandoned with its env: the stuck thread gets an exception raised into
  it (which stops a busy Python loop; a call blocked in C code stops when it returns),
  a replacement thread takes its place, and the env is closed and rebuilt for the
  next reset.
- "process" (`ProcessBackend`): `num_workers` worker processes (started with "spawn", so no state is
  inherited and CUDA or threads in the trainer are safe), env i living in worker
  i % num_workers and each worker running its envs one after another. A worker whose
  current env runs past the timeout, or that dies, is killed and respawned; the
  other unfinished episodes of that worker are lost with it and end as failed
  ("worker_restarted"), so give each env its own worker (num_workers=num_envs)
  when isolation matters more than memory. The env must be given by registry name,
  dotted path, or a picklable class or factory. Workers end with `close()`, when
  the VectorEnv is garbage collected, and at interpreter exit; a worker whose parent
  process died (even by SIGKILL) exits within 5 s (it checks every 0.5 s; docs/RELIABILITY.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import Counter, deque
from concurrent.futures import ALL_COMPLETED, Future, wait
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

from .base import MILESTONE_PLAN, EnvUnavailableError, StepResult, TextEnv, resolve_env_class
from .factory import build_env

__all__ = [
    "VectorEnv",
    "EnvFailure",
    "failure_result",
    "sanitize_result",
    "FAILURE_ANCHOR",
    "BACKENDS",
    "EnvBackend",
    "Batch",
    "CallFailure",
    "EnvSlot",
    "SerialBackend",
    "ThreadBackend",
    "ProcessBackend",
    "register_backend",
    "resolve_backend",
]

FAILURE_ANCHOR = "<env failure>"
_MAX_REASON_CHARS = 300
ENORMOUS_FACTOR = 8  # observations beyond 8 x max_observation_chars end the episode as failed
MAX_ABS_REWARD = 1e6  # larger rewards end the episode as failed: squared in float32 they overflow
_MAX_RECORDED_FAILURES = 1000
# A spawned worker imports the env's module before it can take calls; that time is
# not charged to the first call's `step_timeout`, but a worker that never starts is.
_WORKER_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class EnvFailure:
    """One env failure.

    Attributes:
        env_index: position of the env in the batch.
        phase: "reset" or "step".
        kind: "exception", "timeout", "bad_result", "build_error", "worker_died" or
            "worker_restarted" (the episode was lost with a worker killed for another env).
        reason: the message, also in the failed step's `info["env_failure"]`.
    """

    env_index: int
    phase: str
    kind: str
    reason: str


@dataclass(frozen=True)
class CallFailure:
    """What a call returns instead of a `StepResult` when the env failed (`kind` as in `EnvFailure`)."""

    kind: str
    reason: str


class _Unavailable(CallFailure):
    """The env could not be built for lack of a dependency: a setup error, raised to the caller."""


def failure_result(reason: str) -> StepResult:
    """The `StepResult` that ends an episode whose env failed."""
    return StepResult(
        observation=f"The environment failed ({reason}); this episode is over.",
        reward=0.0,
        done=True,
        won=False,
        anchor=FAILURE_ANCHOR,
        info={"env_failure": reason},
    )


def _short(text: str, limit: int = _MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _cap_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"


def _cap_anchor(anchor: str, limit: int) -> str:
    if len(anchor) <= limit:
        return anchor
    return f"{anchor[:limit]}#{hashlib.sha1(anchor.encode('utf-8', 'replace')).hexdigest()}"


def sanitize_result(result: Any, max_observation_chars: int) -> StepResult:
    """Check and normalise what an env returned; raises ValueError naming the bad field.

    Coerces done/won to bool, reward to float and admissible actions to a list of
    str; cuts the observation and the anchor at `max_observation_chars`. An
    observation over ENORMOUS_FACTOR times that is a failure, not a long room.
    """
    if not isinstance(result, StepResult):
        raise ValueError(f"returned {type(result).__name__}, not a StepResult")
    if not isinstance(result.observation, str):
        raise ValueError(f"observation is {type(result.observation).__name__}, not str")
    if len(result.observation) > ENORMOUS_FACTOR * max_observation_chars:
        # Long is normal (cut below); this long is a runaway engine, not a state.
        raise ValueError(f"observation of {len(result.observation)} characters")
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        raise ValueError(f"reward {result.reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"reward {reward:g} is beyond +-{MAX_ABS_REWARD:g}; scale the env's rewards down")
    actions = result.admissible_actions
    if actions is not None:
        if isinstance(actions, (str, bytes)) or not hasattr(actions, "__iter__"):
            raise ValueError(f"admissible_actions is {type(actions).__name__}, not a list of str")
        actions = [str(action) for action in actions]
    if not isinstance(result.info, dict):
        raise ValueError(f"info is {type(result.info).__name__}, not dict")
    return StepResult(
        observation=_cap_text(result.observation, max_observation_chars),
        reward=reward,
        done=bool(result.done),
        won=bool(result.won),
        admissible_actions=actions,
        anchor=_cap_anchor(str(result.anchor), max_observation_chars),
        info=result.info,
    )


class _EnvFactory:
    """Builds one env: `env(**env_kwargs)` (`build_env`: surface_variation wraps it). Picklable when `env` is (a class, or a module-level function).

    `described` is the env as the user gave it (a registry name, a class...), for messages.
    """

    def __init__(
        self, env: type[TextEnv] | Callable[..., TextEnv], env_kwargs: dict[str, Any], described: str = "",
        milestones: bool = False,
    ):  # fmt: skip
        self.env = env
        self.env_kwargs = env_kwargs
        self.described = described or repr(env)
        self.milestones = milestones  # each reset result carries the task's milestone plan
        # numbers the envs this factory builds, so a surface-varied VectorEnv renders each env's
        # episodes differently and a rerun the same, whatever else the process built before
        self.built = 0

    def __call__(self) -> TextEnv:
        self.built += 1
        return build_env(self.env, self.env_kwargs, stream=self.built - 1)


class EnvSlot:
    """One env position: builds its env on demand, runs calls, drops the env when it fails.

    `call` is where the failure contract is kept for one env: whatever the env does, it
    returns a sanitised `StepResult` or a `CallFailure`. Backends run slots; they add only
    what a slot cannot see from inside its call (a timeout, a dead worker).
    """

    def __init__(self, factory: _EnvFactory, max_observation_chars: int):
        self.factory = factory
        self.max_observation_chars = max_observation_chars
        self.env: TextEnv | None = None

    def call(self, method: str, arg: Any) -> StepResult | CallFailure:
        """Run env.reset(arg) or env.step(arg). Never raises."""
        if self.env is None:
            try:
                self.env = self.factory()
            except EnvUnavailableError as err:
                return _Unavailable("unavailable", str(err))
            except (Exception, SystemExit) as err:
                return CallFailure("build_error", _short(f"{type(err).__name__}: {err}"))
        try:
            raw = getattr(self.env, method)(arg)
        except (Exception, SystemExit) as err:  # an engine calling sys.exit() must not end the training run
            self.discard()
            kind = getattr(err, "kind", None)  # envs.trl_env.EnvironmentFailure says which kind of failure it is
            kind = kind if isinstance(kind, str) and kind else "exception"
            return CallFailure(kind, _short(f"{method} raised {type(err).__name__}: {err}"))
        try:
            result = sanitize_result(raw, self.max_observation_chars)
        except ValueError as err:
            self.discard()
            return CallFailure("bad_result", _short(f"{method} {err}"))
        if method == "reset":
            # The task text is an attribute of the env, out of the caller's reach when the
            # env lives in a worker process: it travels in the reset result.
            result.info = {"task": str(self.env.task), **result.info}
            if self.factory.milestones:
                return self._with_plan(result)
        return result

    def _with_plan(self, result: StepResult) -> StepResult | CallFailure:
        """The reset result with the task's milestone plan, when the env gives one; a plan that
        is not a list of strings fails the episode like any bad result."""
        if self.env.milestone_kind != "plan":
            return result
        try:
            plan = self.env.milestones()
        except (Exception, SystemExit) as err:
            self.discard()
            return CallFailure("exception", _short(f"milestones raised {type(err).__name__}: {err}"))
        if plan is not None and (isinstance(plan, (str, bytes)) or not all(isinstance(m, str) for m in plan)):
            self.discard()
            return CallFailure("bad_result", _short(f"milestones returned {plan!r}, not a list of str"))
        result.info[MILESTONE_PLAN] = None if plan is None else list(plan)
        return result

    def discard(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            try:
                env.close()
            except Exception:
                pass  # the env is being dropped because it is broken; its close may be too


class _Job:
    def __init__(self, fn: Callable[[], Any], on_abandoned: Callable[[], None]):
        self.fn = fn
        self.on_abandoned = on_abandoned
        self.future: Future = Future()
        self.started_at: float | None = None
        self.thread_id: int | None = None


class _Abandoned(BaseException):
    """Raised into a thread whose call ran past the timeout, to stop a busy loop."""


def _interrupt_thread(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(_Abandoned))


class _DaemonThreadPool:
    """Worker threads that can be abandoned while stuck in a call.

    `concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so
    one env hung forever would hang the program's exit; these are daemon threads, and
    `abandon` starts a replacement so the pool keeps its size. An abandoned thread gets
    `_Abandoned` raised into it, so a busy loop in the env stops burning a core.
    """

    def __init__(self, num_threads: int):
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[_Job] = set()
        self._num_threads = num_threads
        for _ in range(num_threads):
            self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._work, name="VectorEnv-worker", daemon=True).start()

    def submit(self, fn: Callable[[], Any], on_abandoned: Callable[[], None]) -> _Job:
        job = _Job(fn, on_abandoned)
        self._jobs.put(job)
        return job

    def abandon(self, job: _Job) -> bool:
        """Give up on a running job; False when it finished meanwhile."""
        with self._lock:
            if job.future.done():
                return False
            self._abandoned.add(job)
            if job.thread_id is not None:
                _interrupt_thread(job.thread_id)
        self._start_thread()
        return True

    def _work(self) -> None:
        job = None
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                job.thread_id = threading.get_ident()
                job.started_at = time.monotonic()
                try:
                    value = job.fn()
                except BaseException as err:  # e.g. an engine calling sys.exit(): fail the call, keep the thread
                    value = CallFailure("exception", _short(f"{type(err).__name__}: {err}"))
                with self._lock:
                    job.future.set_result(value)
                    retired = job in self._abandoned
                    self._abandoned.discard(job)
                if retired:  # a replacement thread already took this one's place
                    job.on_abandoned()
                    return
        except _Abandoned:  # arrived just after the call returned: this thread is retired all the same
            if job is not None:
                job.on_abandoned()

    def shutdown(self) -> None:
        for _ in range(self._num_threads):
            self._jobs.put(None)


def _worker_main(conn, factory: _EnvFactory, env_indices: list[int], max_observation_chars: int) -> None:
    """Worker process loop: receive (method, [(env index, arg), ...]), send one (index, outcome) per call."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the workers
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    slots = {index: EnvSlot(factory, max_observation_chars) for index in env_indices}
    exit_code = 0
    try:
        conn.send("ready")
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            method, calls = message
            for index, arg in calls:
                outcome = slots[index].call(method, arg)
                try:
                    conn.send((index, outcome))
                except (BrokenPipeError, EOFError):
                    return
                except Exception as err:  # the env put something unpicklable in its result
                    slots[index].discard()
                    conn.send((index, CallFailure("bad_result", _short(f"{method} result cannot be sent: {err}"))))
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    finally:
        for slot in slots.values():
            slot.discard()
        # Skip the interpreter's teardown: a spawned worker has imported the trainer's main
        # module (torch, transformers...), whose teardown takes seconds per worker.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit the worker when its parent is gone: a SIGKILLed trainer cannot close its workers,
    and a worker busy in a hung env would not notice the closed pipe."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


class _Worker:
    """A worker process, its pipe, and the calls it still owes in the current batch."""

    def __init__(self, context, factory: _EnvFactory, env_indices: list[int], max_observation_chars: int):
        self.env_indices = env_indices
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_worker_main,
            args=(child_conn, factory, env_indices, max_observation_chars),
            name="VectorEnv-worker",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False  # the worker has imported what it needs and said so
        self.owed: list[int] = []  # env indices in the order the worker runs them
        self.current_since = 0.0  # when the worker started on owed[0]
        self.asked_to_stop = False

    def overdue(self, step_timeout: float | None, now: float) -> str | None:
        """Why the worker is late on its current call, or None."""
        if not self.ready:
            if now - self.started_at > _WORKER_START_TIMEOUT:
                return f"the worker did not start within {_WORKER_START_TIMEOUT} s"
            return None
        if step_timeout is not None and now - self.current_since > step_timeout:
            return f"did not return within {step_timeout} s; worker killed"
        return None

    def deadline(self, step_timeout: float | None) -> float | None:
        if not self.ready:
            return self.started_at + _WORKER_START_TIMEOUT
        return None if step_timeout is None else self.current_since + step_timeout

    def ask_to_stop(self) -> None:
        if self.process.is_alive() and not self.asked_to_stop:
            self.asked_to_stop = True
            try:
                self.conn.send(None)
            except OSError:
                pass

    def stop(self, grace: float = 2.0) -> None:
        if self.process.is_alive():
            self.ask_to_stop()
            self.process.join(grace)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(grace)
        self.conn.close()


Outcome = StepResult | CallFailure  # what one call gives back, under the failure contract


@dataclass
class Batch:
    """What a backend gives back for one batch of calls.

    Attributes:
        outcomes: env index -> the outcome of its call, one per call of the batch.
        dropped: env index -> the failure, for envs the batch did not fail through their
            own call but whose instance it dropped all the same (a worker process killed
            for another env takes its envs along). VectorEnv ends an episode they were
            running: in this batch when they are in it, at their next step otherwise.
    """

    outcomes: dict[int, Outcome] = field(default_factory=dict)
    dropped: dict[int, CallFailure] = field(default_factory=dict)


BACKENDS: dict[str, type[EnvBackend]] = {}


def register_backend(name: str):
    """Register an `EnvBackend` subclass under `name` (decorator), for `VectorEnv(backend=name)`."""

    def decorator(cls: type[EnvBackend]) -> type[EnvBackend]:
        BACKENDS[name] = cls
        if not vars(cls).get("name"):  # not the name a parent backend was registered under
            cls.name = name
        return cls

    return decorator


class EnvBackend(ABC):
    """How a `VectorEnv` runs a batch of calls: in turn, on threads, in worker processes...

    Every backend keeps the failure contract of the module docstring. `run(method, calls)`
    calls `env.reset(arg)` or `env.step(arg)` for each `(env index, arg)` of `calls` and
    gives back one outcome per call, never raising for anything an env does. `EnvSlot.call`
    keeps the contract inside a call (exceptions, bad results, the env's build); a backend
    adds what only it can see: a call past `step_timeout` (kind "timeout") and what its
    own machinery loses (a dead worker: "worker_died", and `Batch.dropped`). VectorEnv
    does the rest the same way for every backend: counting, recording, the failure
    result, raising `EnvUnavailableError`.

    VectorEnv builds its backend once, `backend(factory, num_envs, num_workers=...,
    step_timeout=..., max_observation_chars=...)` (`factory()` builds one env;
    `num_workers` None asks for the backend's default), and calls `close` once, also when
    it is garbage collected: a backend must hold no reference to its VectorEnv. Register
    yours with `@register_backend("name")`, or pass the class as `VectorEnv(backend=...)`.
    """

    name: ClassVar[str] = ""

    def __init__(
        self,
        factory: Callable[[], TextEnv],
        num_envs: int,
        *,
        num_workers: int | None = None,
        step_timeout: float | None = 60.0,
        max_observation_chars: int = 8000,
    ):
        self.factory = factory
        self.num_envs = num_envs
        self.step_timeout = step_timeout
        self.max_observation_chars = max_observation_chars
        self.num_workers = 1  # threads or processes the envs run on; set by each backend

    def new_slot(self) -> EnvSlot:
        """A fresh env position, whose env is built at its first call."""
        return EnvSlot(self.factory, self.max_observation_chars)

    @abstractmethod
    def run(self, method: str, calls: dict[int, Any]) -> Batch:
        """Run `env.<method>(arg)` for every (env index, arg) of `calls`; one outcome each."""

    def close(self) -> None:
        """Close every env and stop every thread or process."""


class _InProcessBackend(EnvBackend):
    """Envs in this process, one `EnvSlot` each, their calls run on a pool of daemon threads
    that the calling thread watches for the timeout; with no pool, in the calling thread."""

    def __init__(self, factory, num_envs, *, num_threads: int, step_timeout, max_observation_chars):
        super().__init__(factory, num_envs, step_timeout=step_timeout, max_observation_chars=max_observation_chars)
        self.slots = [self.new_slot() for _ in range(num_envs)]
        self.pool = _DaemonThreadPool(num_threads) if num_threads else None

    def run(self, method: str, calls: dict[int, Any]) -> Batch:
        if self.pool is None:
            return Batch({i: self.slots[i].call(method, arg) for i, arg in calls.items()})
        jobs = {
            i: self.pool.submit(functools.partial(self.slots[i].call, method, arg), self.slots[i].discard)
            for i, arg in calls.items()
        }
        outcomes: dict[int, Outcome] = {}
        while jobs:
            now = time.monotonic()
            for i, job in list(jobs.items()):
                if job.future.done():
                    outcomes[i] = job.future.result()
                    del jobs[i]
                elif self._timed_out(job.started_at, now) and self.pool.abandon(job):
                    # The stuck thread keeps the old slot and closes its env if it ever returns.
                    self.slots[i] = self.new_slot()
                    outcomes[i] = CallFailure("timeout", f"{method} did not return within {self.step_timeout} s")
                    del jobs[i]
            if jobs:
                # Wake when all are done or the earliest running call is due: one wait per
                # batch in the common case, not one per finished call.
                wait(
                    [job.future for job in jobs.values()],
                    timeout=self._wait_time([job.started_at for job in jobs.values()], now),
                    return_when=ALL_COMPLETED,
                )
        return Batch(outcomes)

    def _timed_out(self, started_at: float | None, now: float) -> bool:
        return self.step_timeout is not None and started_at is not None and now - started_at > self.step_timeout

    def _wait_time(self, started: list[float | None], now: float) -> float:
        """Seconds until the earliest running call times out (at most 1 s, to notice calls that start)."""
        if self.step_timeout is None:
            return 1.0
        deadlines = [t + self.step_timeout - now for t in started if t is not None]
        return max(0.0, min([1.0, *deadlines])) if deadlines else 1.0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        for slot in self.slots:
            slot.discard()


@register_backend("serial")
class SerialBackend(_InProcessBackend):
    """One env after another. With a `step_timeout` on one helper thread, so that a hang
    ends its episode as in "thread"; without one in the calling thread itself, for engines
    that must stay on the main thread. `num_workers` is ignored."""

    def __init__(self, factory, num_envs, *, num_workers=None, step_timeout=60.0, max_observation_chars=8000):
        super().__init__(
            factory,
            num_envs,
            num_threads=0 if step_timeout is None else 1,
            step_timeout=step_timeout,
            max_observation_chars=max_observation_chars,
        )


@register_backend("thread")
class ThreadBackend(_InProcessBackend):
    """`num_workers` daemon threads (default min(num_envs, 32)); abandons a hung call with its env."""

    def __init__(self, factory, num_envs, *, num_workers=None, step_timeout=60.0, max_observation_chars=8000):
        threads = min(num_envs, num_workers or 32)
        super().__init__(
            factory, num_envs, num_threads=threads, step_timeout=step_timeout, max_observation_chars=max_observation_chars
        )
        self.num_workers = threads


@register_backend("process")
class ProcessBackend(EnvBackend):
    """`num_workers` spawned worker processes (default min(num_envs, cpu count)), env i in
    worker i % num_workers; a worker late on a call, or dead, is killed and respawned."""

    def __init__(self, factory, num_envs, *, num_workers=None, step_timeout=60.0, max_observation_chars=8000):
        super().__init__(factory, num_envs, step_timeout=step_timeout, max_observation_chars=max_observation_chars)
        try:
            pickle.dumps(factory)
        except Exception as err:
            described = getattr(factory, "described", repr(factory))
            raise ValueError(
                f"VectorEnv env={described} with backend='process': the env and env_kwargs must be picklable "
                f"to reach the worker processes ({err}). Pass a registry name or a module-level class."
            ) from err
        self.num_workers = min(num_envs, num_workers or os.cpu_count() or 1)
        self._context = multiprocessing.get_context("spawn")
        self.workers = [self._start_worker(w) for w in range(self.num_workers)]

    def run(self, method: str, calls: dict[int, Any]) -> Batch:
        batch = Batch()
        now = time.monotonic()
        for w, worker in enumerate(self.workers):
            mine = [(i, calls[i]) for i in worker.env_indices if i in calls]
            if not mine:
                continue
            try:
                worker.conn.send((method, mine))
            except OSError:  # died between batches
                worker.owed = [i for i, _ in mine]
                self._replace_worker(w, "worker_died", f"worker exited with code {worker.process.exitcode}", batch)
                continue
            worker.owed = [i for i, _ in mine]
            worker.current_since = now
        while True:
            busy = [(w, worker) for w, worker in enumerate(self.workers) if worker.owed]
            if not busy:
                return batch
            deadlines = [d for _, worker in busy if (d := worker.deadline(self.step_timeout)) is not None]
            wait_time = min([1.0, *(d - time.monotonic() for d in deadlines)])
            ready = multiprocessing.connection.wait([worker.conn for _, worker in busy], timeout=max(0.0, wait_time))
            for w, worker in busy:
                if worker.conn in ready:
                    self._receive(w, worker, batch)
                elif (late := worker.overdue(self.step_timeout, time.monotonic())) is not None:
                    self._replace_worker(w, "timeout", f"{method} {late}", batch)

    def close(self) -> None:
        for worker in self.workers:  # ask all at once, then wait: the workers close their envs in parallel
            worker.ask_to_stop()
        for worker in self.workers:
            worker.stop()

    def _start_worker(self, w: int) -> _Worker:
        return _Worker(
            self._context, self.factory, list(range(w, self.num_envs, self.num_workers)), self.max_observation_chars
        )

    def _receive(self, w: int, worker: _Worker, batch: Batch) -> None:
        """Take every outcome the worker has sent so far."""
        while worker.owed:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(1.0)
                self._replace_worker(w, "worker_died", f"worker exited with code {worker.process.exitcode}", batch)
                return
            if message == "ready":
                worker.ready = True
                worker.current_since = time.monotonic()
                continue
            i, outcome = message
            batch.outcomes[i] = outcome
            worker.owed.remove(i)
            worker.current_since = time.monotonic()

    def _replace_worker(self, w: int, kind: str, reason: str, batch: Batch) -> None:
        """Kill worker w and start a fresh one; its envs are dropped with it."""
        worker = self.workers[w]
        culprit = worker.owed[0]
        batch.outcomes[culprit] = CallFailure(kind, reason)
        collateral = CallFailure("worker_restarted", f"worker restarted after env {culprit} failed ({kind})")
        for i in worker.owed[1:]:
            batch.outcomes[i] = collateral
        for i in worker.env_indices:
            if i not in worker.owed:  # answered in this batch, or not in it
                batch.dropped[i] = collateral
        worker.owed = []
        worker.process.kill()
        worker.stop(grace=1.0)
        self.workers[w] = self._start_worker(w)


def resolve_backend(backend: str | type[EnvBackend]) -> type[EnvBackend]:
    """The backend class registered under `backend`, or `backend` itself when it is one."""
    if isinstance(backend, type) and issubclass(backend, EnvBackend):
        return backend
    if isinstance(backend, str) and backend in BACKENDS:
        return BACKENDS[backend]
    raise ValueError(
        f"VectorEnv backend={backend!r}: use one of {tuple(BACKENDS)}, or an envs.vector.EnvBackend subclass."
    )


class VectorEnv:
    """`num_envs` envs of one kind, reset and stepped as a batch. See the module docstring.

    Args:
        env: registry name or dotted path ("package.module:Class"), a `TextEnv`
            subclass, or a callable returning a `TextEnv`.
        num_envs: number of env instances.
        env_kwargs: keyword arguments for each env.
        backend: "serial", "thread", "process" (module docstring), another name in
            `BACKENDS` (`register_backend`), or an `EnvBackend` subclass.
        num_workers: threads or processes; default min(num_envs, 32) threads or
            min(num_envs, cpu count) processes. Ignored by "serial".
        step_timeout: seconds one reset or step may take before its episode fails
            (None: wait forever; "serial" then runs the envs in the calling thread).
        max_observation_chars: longer observations are cut, with a note.
        milestones: every reset result carries the task's milestone plan (module docstring).
    """

    def __init__(
        self,
        env: str | type[TextEnv] | Callable[[], TextEnv],
        num_envs: int,
        env_kwargs: dict[str, Any] | None = None,
        backend: str | type[EnvBackend] = "serial",
        num_workers: int | None = None,
        step_timeout: float | None = 60.0,
        max_observation_chars: int = 8000,
        milestones: bool = False,
    ):
        backend_class = resolve_backend(backend)
        if num_envs < 1:
            raise ValueError(f"VectorEnv num_envs={num_envs}: need at least one env.")
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"VectorEnv step_timeout={step_timeout}: use a positive number of seconds, or None.")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"VectorEnv num_workers={num_workers}: use a positive number, or None for the default.")
        self.num_envs = num_envs
        self.backend = vars(backend_class).get("name") or backend_class.__name__
        self.step_timeout = step_timeout
        self.max_observation_chars = max_observation_chars
        env_class = resolve_env_class(env) if isinstance(env, str) else env
        if not callable(env_class):
            raise ValueError(
                f"VectorEnv env={env!r}: pass a registry name, a TextEnv class or a factory, not an instance."
            )
        self._factory = _EnvFactory(env_class, dict(env_kwargs or {}), described=repr(env), milestones=milestones)

        self.num_failures = 0
        self.failure_counts: Counter[str] = Counter()
        self.failures: deque[EnvFailure] = deque(maxlen=_MAX_RECORDED_FAILURES)  # the latest ones
        self._calls: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._in_episode = [False] * num_envs
        self._lost: dict[int, CallFailure] = {}  # env index -> how its running episode was lost off-batch

        self._backend = backend_class(
            self._factory,
            num_envs,
            num_workers=num_workers,
            step_timeout=step_timeout,
            max_observation_chars=max_observation_chars,
        )
        self.num_workers = self._backend.num_workers
        self._finalizer = weakref.finalize(self, self._backend.close)

    # ------------------------------------------------------------------ public API

    def reset(self, task_ids: Sequence[int | dict | None]) -> list[StepResult | None]:
        """Reset env i to task_ids[i] (None: leave env i alone, get None back). A task may
        also be a dict, passed to the env's reset as it is (a dataset row, for TRL's envs)."""
        self._check_length("task_ids", task_ids)
        calls = {
            i: task_id if isinstance(task_id, dict) else int(task_id)
            for i, task_id in enumerate(task_ids)
            if task_id is not None
        }
        for i in calls:
            self._lost.pop(i, None)
        return self._run("reset", calls)

    def step(self, actions: Sequence[str | None]) -> list[StepResult | None]:
        """Step env i with actions[i] (None: env i is inactive this turn, get None back)."""
        self._check_length("actions", actions)
        calls = {i: str(action) for i, action in enumerate(actions) if action is not None}
        lost = {i: self._lost.pop(i) for i in list(calls) if i in self._lost}
        results = self._run("step", {i: a for i, a in calls.items() if i not in lost})
        for i, failure in lost.items():
            results[i] = self._record(i, "step", failure)
        return results

    def counters(self) -> dict[str, Any]:
        """The counters behind `metrics`, to carry into a resumed run (`add_counters`)."""
        return {
            "failures": self.num_failures,
            "failure_counts": dict(self.failure_counts),
            "calls": dict(self._calls),
            "seconds": dict(self._seconds),
        }

    def add_counters(self, counters: dict[str, Any]) -> None:
        """Add the `counters()` of an earlier VectorEnv (the run before a resume)."""
        self.num_failures += int(counters["failures"])
        self.failure_counts.update(counters["failure_counts"])
        self._calls.update(counters["calls"])
        self._seconds.update(counters["seconds"])

    def metrics(self) -> dict[str, float]:
        """Counters and timings, namespaced for logging."""
        out = {
            "env/failures": float(self.num_failures),
            "env/resets": float(self._calls["reset"]),
            "env/steps": float(self._calls["step"]),
            "env/reset_seconds": self._seconds["reset"],
            "env/step_seconds": self._seconds["step"],
            "env/steps_per_second": self._calls["step"] / self._seconds["step"] if self._seconds["step"] else 0.0,
        }
        out.update({f"env/failures/{kind}": float(count) for kind, count in self.failure_counts.items()})
        return out

    def local_envs(self) -> list[TextEnv | None]:
        """The env objects of an in-process backend ("serial", "thread"), None where one is
        not built yet; [] when the envs live in worker processes."""
        return [slot.env for slot in getattr(self._backend, "slots", [])]

    def close(self) -> None:
        """Close every env and stop every worker; safe to call twice."""
        self._finalizer()

    def __enter__(self) -> VectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_length(self, name: str, values: Sequence[Any]) -> None:
        if len(values) != self.num_envs:
            raise ValueError(f"VectorEnv: {name} has {len(values)} entries; pass one per env ({self.num_envs}).")

    def _run(self, method: str, calls: dict[int, Any]) -> list[StepResult | None]:
        if not self._finalizer.alive:
            raise RuntimeError("VectorEnv is closed; build a new one.")
        start = time.perf_counter()
        batch = self._backend.run(method, calls)
        self._seconds[method] += time.perf_counter() - start
        self._calls[method] += len(calls)
        self._end_dropped_episodes(batch)
        unavailable = [outcome for outcome in batch.outcomes.values() if isinstance(outcome, _Unavailable)]
        if unavailable:
            raise EnvUnavailableError(unavailable[0].reason)
        results: list[StepResult | None] = [None] * self.num_envs
        for i, outcome in batch.outcomes.items():
            results[i] = self._record(i, method, outcome)
        return results

    def _end_dropped_episodes(self, batch: Batch) -> None:
        """A dropped env's running episode is over: now if this batch answered it, else at its next step."""
        for i, failure in batch.dropped.items():
            if i in batch.outcomes:
                outcome = batch.outcomes[i]
                if isinstance(outcome, StepResult) and not outcome.done:
                    batch.outcomes[i] = failure
            elif self._in_episode[i]:
                self._lost[i] = failure
                self._in_episode[i] = False

    def _record(self, i: int, phase: str, outcome: StepResult | CallFailure) -> StepResult:
        if isinstance(outcome, StepResult):
            self._in_episode[i] = not outcome.done
            return outcome
        self._in_episode[i] = False
        self.num_failures += 1
        self.failure_counts[outcome.kind] += 1
        self.failures.append(EnvFailure(i, phase, outcome.kind, outcome.reason))
        return failure_result(f"{outcome.kind}: {outcome.reason}")

    # What tests and debugging reach for: the backend's env slots, thread pool and worker processes.
    @property
    def _slots(self) -> list[EnvSlot]:
        return getattr(self._backend, "slots", [])

    @property
    def _pool(self) -> _DaemonThreadPool | None:
        return getattr(self._backend, "pool", None)

    @property
    def _workers(self) -> list[_Worker]:
        return getattr(self._backend, "workers", [])
