"""Our text envs served over HTTP/WebSocket by OpenEnv's own server (`openenv-core`), with fault injection.

    python -m envs.openenv_server --env textcraft --port 8001             # serve TextCraft
    python -m envs.openenv_server --env tiny --env-kwargs '{"size": 4}' \\
        --fault die:tasks=3:step=2 --fault slow:step=1:seconds=30          # a server that misbehaves

Each WebSocket session (one per client, so one per TRL rollout) gets its own env instance
(`SUPPORTS_CONCURRENT_SESSIONS`, up to `--max-sessions`). The wire types:
- `TextAction(command)`: one env command.
- `TextObservation`: the env's `StepResult` (`text` = observation, `anchor`, `won`,
  `admissible_actions`, `failure`), plus `task` and `instruction` after a reset; OpenEnv
  carries `reward` and `done` beside it. `reset` takes `task_id` (or `seed`).
Engine failures on the server keep `envs.vector`'s contract (the episode ends, `failure`
says why); the client side is `envs.openenv_env`.

Fault injection, for reliability tests of a trainer against a server that misbehaves. A
`Fault(kind, task_ids, at_step, seconds)` strikes at step `at_step` of the episodes whose
task is in `task_ids` (None: every episode), so a test knows which episodes it touches:
- "die": the server process kills itself (SIGKILL) mid-episode: every open session is cut,
  later connections are refused.
- "slow": the step stalls `seconds` before answering (past a client's timeout).
- "garble": the step's answer is replaced by bytes that are not JSON.
- "error": the step raises inside the server; OpenEnv answers with its error message.
A refused connection needs no server: `refused_url()` names a local port nobody listens on.

`LocalServer` starts the real server in a child process on 127.0.0.1 and a free port, waits
until it answers `/health`, and stops or kills it; a test fixture owns its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from .base import StepResult, TextEnv, resolve_env_class
from .vector import VectorEnv

__all__ = [
    "TextAction",
    "TextObservation",
    "TextEnvServerEnvironment",
    "Fault",
    "create_text_env_app",
    "LocalServer",
    "free_port",
    "refused_url",
    "GARBLED_RESPONSE",
]

FAULT_KINDS = ("die", "slow", "garble", "error")
# The step's observation carries this mark; the ASGI wrapper replaces any frame holding it.
_GARBLE_MARK = "@@garble-this-frame@@"
GARBLED_RESPONSE = '{"type": "observation", "data": {"observation": \x00\x01 not json'


class TextAction(Action):
    """One command for a text env."""

    command: str


class TextObservation(Observation):
    """A text env's `StepResult` on the wire (`reward` and `done` are OpenEnv's own fields)."""

    text: str = ""
    anchor: str = ""
    won: bool = False
    admissible_actions: list[str] | None = None
    failure: str | None = None
    task: str = ""
    instruction: str = ""


@dataclass(frozen=True)
class Fault:
    """A misbehaviour of the server at step `at_step` (1 = first step) of the episodes of `task_ids`.

    kind: "die" (SIGKILL the server), "slow" (stall `seconds`), "garble" (answer non-JSON
    bytes) or "error" (the step raises). task_ids None: every episode.
    """

    kind: str
    task_ids: frozenset[int] | None = None
    at_step: int = 1
    seconds: float = 30.0

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault kind={self.kind!r}: use one of {FAULT_KINDS}.")
        if self.at_step < 1:
            raise ValueError(f"Fault at_step={self.at_step}: steps count from 1.")

    def strikes(self, task_id: int | None, step: int) -> bool:
        return step == self.at_step and (self.task_ids is None or task_id in self.task_ids)

    @classmethod
    def parse(cls, text: str) -> Fault:
        """'kind[:tasks=1,2][:step=N][:seconds=S]', as the command line writes it."""
        kind, *fields = text.split(":")
        values: dict[str, Any] = {}
        for field in fields:
            key, _, value = field.partition("=")
            if key == "tasks":
                values["task_ids"] = frozenset(int(t) for t in value.split(",") if t)
            elif key == "step":
                values["at_step"] = int(value)
            elif key == "seconds":
                values["seconds"] = float(value)
            else:
                raise ValueError(f"--fault {text!r}: unknown field {key!r}; use tasks=1,2, step=N or seconds=S.")
        return cls(kind, **values)

    def to_arg(self) -> str:
        tasks = f":tasks={','.join(map(str, sorted(self.task_ids)))}" if self.task_ids is not None else ""
        return f"{self.kind}{tasks}:step={self.at_step}:seconds={self.seconds:g}"


def _observation(result: StepResult, **extra: Any) -> TextObservation:
    return TextObservation(
        text=result.observation,
        anchor=result.anchor,
        won=result.won,
        admissible_actions=result.admissible_actions,
        failure=result.info.get("env_failure"),
        reward=result.reward,
        done=result.done,
        **extra,
    )


class TextEnvServerEnvironment(Environment):
    """An OpenEnv `Environment` playing one of our `TextEnv`s (one instance per session).

    The engine runs in a one-env `VectorEnv`, so an engine that raises or hangs past
    `step_timeout` ends its episode with `failure` set instead of breaking the session.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: str | type[TextEnv], env_kwargs: dict[str, Any] | None = None,
                 faults: Sequence[Fault] = (), step_timeout: float | None = 60.0):
        super().__init__()
        env_class = resolve_env_class(env) if isinstance(env, str) else env
        self._instruction = env_class.instruction
        self._vector = VectorEnv(env, 1, dict(env_kwargs or {}), step_timeout=step_timeout)
        self._faults = tuple(faults)
        self._task_id: int | None = None
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: int | None = None,
              **kwargs: Any) -> TextObservation:
        if task_id is None and seed is None:
            raise ValueError("reset needs task_id (or seed): the task of the episode to play.")
        self._task_id = int(task_id if task_id is not None else seed)
        self._state = State(episode_id=episode_id, step_count=0)
        (result,) = self._vector.reset([self._task_id])
        return _observation(result, task=str(result.info.get("task", "")), instruction=self._instruction)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        fault = next((f for f in self._faults if f.strikes(self._task_id, self._state.step_count)), None)
        if fault is not None and fault.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault is not None and fault.kind == "slow":
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "error":
            raise RuntimeError(f"injected server error at step {self._state.step_count} of task {self._task_id}")
        (result,) = self._vector.step([action.command])
        observation = _observation(result)
        if fault is not None and fault.kind == "garble":
            observation.text += _GARBLE_MARK
        return observation

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self._vector.close()


class _GarbleMarkedFrames:
    """ASGI wrapper: a WebSocket frame holding the garble mark goes out as `GARBLED_RESPONSE`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)

        async def garbling_send(message):
            if message.get("type") == "websocket.send" and _GARBLE_MARK in (message.get("text") or ""):
                message = {"type": "websocket.send", "text": GARBLED_RESPONSE}
            await send(message)

        return await self.app(scope, receive, garbling_send)


def create_text_env_app(env: str | type[TextEnv], env_kwargs: dict[str, Any] | None = None, *,
                        faults: Sequence[Fault] = (), max_sessions: int = 64, step_timeout: float | None = 60.0):
    """OpenEnv's FastAPI app (`openenv.core.env_server.create_app`) serving `env`, one instance per session."""
    env_class = resolve_env_class(env) if isinstance(env, str) else env
    env_class.check_available(**(env_kwargs or {}))

    def factory() -> TextEnvServerEnvironment:
        return TextEnvServerEnvironment(env, env_kwargs, faults, step_timeout)

    app = create_app(factory, TextAction, TextObservation, env_name=str(env), max_concurrent_envs=max_sessions)
    if any(fault.kind == "garble" for fault in faults):
        app.add_middleware(_GarbleMarkedFrames)
    return app


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def refused_url(host: str = "127.0.0.1") -> str:
    """The URL of a local port with no server: connecting to it is refused at once."""
    return f"http://{host}:{free_port(host)}"


class LocalServer:
    """The real OpenEnv server for `env` in a child process on `host`:`port` (a free one by default).

        with LocalServer("tiny", {"size": 4}) as server:
            Env = openenv_trl_environment(server.url)
            ...
            server.kill()                           # the server dies mid-episode

    `start` returns once `/health` answers (or raises, with the server's output, if it
    exits or does not answer within `startup_timeout`); `stop` ends it (SIGTERM, then
    SIGKILL), `kill` SIGKILLs it at once. The child's PID is `pid`.
    """

    def __init__(self, env: str = "tiny", env_kwargs: dict[str, Any] | None = None, *, faults: Sequence[Fault] = (),
                 host: str = "127.0.0.1", port: int | None = None, max_sessions: int = 64,
                 startup_timeout: float = 120.0, log_path: str | os.PathLike | None = None):
        self.env, self.env_kwargs, self.faults = env, dict(env_kwargs or {}), tuple(faults)
        self.host, self.port = host, port or free_port(host)
        self.max_sessions, self.startup_timeout = max_sessions, startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "envs.openenv_server", "--env", self.env, "--env-kwargs", json.dumps(self.env_kwargs),
                "--host", self.host, "--port", str(self.port), "--max-sessions", str(self.max_sessions)]
        for fault in self.faults:
            args += ["--fault", fault.to_arg()]
        return args

    def start(self) -> LocalServer:
        import tempfile

        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="openenv_server_", suffix=".log")[1])
        root = str(Path(__file__).resolve().parents[1])  # so `-m envs.openenv_server` is this checkout's
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=environment)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"OpenEnv server exited with code {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"OpenEnv server did not answer {self.url}/health within {self.startup_timeout:g} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server now (a crash mid-episode) and reap it."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self, grace: float = 5.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve one of our text envs with OpenEnv's server.")
    parser.add_argument("--env", default="tiny", help="registry name or dotted path of the env")
    parser.add_argument("--env-kwargs", default="{}", help="JSON object of env constructor arguments")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent WebSocket sessions (>= rollouts per batch)")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="seconds an engine step may take before its episode fails")
    parser.add_argument("--fault", action="append", default=[], type=Fault.parse,
                        help="kind[:tasks=1,2][:step=N][:seconds=S], kind in die/slow/garble/error (repeatable)")
    args = parser.parse_args(argv)
    import uvicorn

    app = create_text_env_app(args.env, json.loads(args.env_kwargs), faults=args.fault, max_sessions=args.max_sessions,
                              step_timeout=args.step_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
