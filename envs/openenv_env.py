"""A TRL `environment_factory` class over an OpenEnv server, wired as TRL's OpenEnv guide wires one.

    from envs.openenv_env import openenv_trl_environment
    TextCraft = openenv_trl_environment("http://127.0.0.1:8001")   # python -m envs.openenv_server --env textcraft
    GRPOTrainer(..., environment_factory=TextCraft, train_dataset=trl_task_dataset("textcraft"))

As in TRL's `docs/source/openenv.md` (the Wordle and multi-env examples): the class takes no
arguments (the URL is captured when the class is made), `reset` closes the previous client and
opens a fresh WebSocket session (one per rollout; the server gives each its own env), and the
tool `act` sends one `TextAction` through OpenEnv's client (`EnvClient(...).sync()`). The text
returned, the reward and the state attributes are `envs.trl_env.TRLEnvironment`'s, so a local
env and a served one are the same class to a trainer.

Nothing the server does can hang the caller or end a training run: connecting is bounded by
`connect_timeout_s`, each answer by `timeout_s`, closing by `close_timeout_s`. A refused
connection, a server that dies, an answer later than `timeout_s`, bytes that are not JSON, a
malformed observation or a server-side error end that episode only, as `envs.vector` ends
the episode of a failing local env: `failure` says "<kind>: <reason>", kinds "unreachable",
"connection_lost", "timeout", "bad_result", "server_error"; `reset` returns the failure text,
`act` raises `EnvironmentFailure`; the next `reset` connects afresh.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openenv.core.client_types import StepResult as OpenEnvStepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import State
from pydantic import ValidationError

from .base import StepResult
from .openenv_server import TextAction, TextObservation
from .trl_env import MAX_ADMISSIBLE_SHOWN, TRLEnvironment
from .vector import failure_result

__all__ = ["TextEnvClient", "OpenEnvEnvironment", "openenv_trl_environment", "failure_kind"]


class TextEnvClient(EnvClient[TextAction, TextObservation, State]):
    """OpenEnv's WebSocket client for `envs.openenv_server`, with a bounded close."""

    def __init__(self, base_url: str, *, close_timeout_s: float = 2.0, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self._close_timeout = close_timeout_s

    def _step_payload(self, action: TextAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> OpenEnvStepResult[TextObservation]:
        observation = TextObservation(**payload["observation"], reward=payload.get("reward"), done=payload.get("done", False))
        return OpenEnvStepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done")))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)

    async def disconnect(self) -> None:
        # The close handshake waits on the server (10 s by default in `websockets`); a
        # server that hangs must not hold the trainer, so the wait is bounded and then the
        # connection is dropped.
        try:
            await asyncio.wait_for(super().disconnect(), timeout=self._close_timeout)
        except (asyncio.TimeoutError, TimeoutError):
            if self._ws is not None:
                self._ws.transport.abort()
            self._ws = None


def failure_kind(error: BaseException) -> str:
    """The failure kind of an exception raised by OpenEnv's client (module docstring)."""
    from websockets.exceptions import ConnectionClosed

    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(error, ConnectionClosed):
        return "connection_lost"
    if isinstance(error, ConnectionError):  # OpenEnv raises it when connecting fails
        return "unreachable"
    if isinstance(error, (json.JSONDecodeError, ValidationError, KeyError, TypeError)):
        return "bad_result"
    if isinstance(error, RuntimeError) and str(error).startswith("Server error"):
        return "server_error"
    return "exception"


def _from_wire(result: OpenEnvStepResult[TextObservation]) -> StepResult:
    """OpenEnv's step result as our `StepResult` (a server-side engine failure stays one)."""
    observation = result.observation
    if observation.failure:
        return failure_result(observation.failure)
    info = {"task": observation.task, "instruction": observation.instruction} if observation.instruction else {}
    return StepResult(
        observation=observation.text,
        reward=float(result.reward or 0.0),
        done=bool(result.done),
        won=observation.won,
        admissible_actions=observation.admissible_actions,
        anchor=observation.anchor,
        info=info,
    )


class OpenEnvEnvironment(TRLEnvironment):
    """`TRLEnvironment` over an `envs.openenv_server` (module docstring). `openenv_trl_environment`
    makes the subclasses; they set `base_url`, `timeout_s`, `connect_timeout_s`, `close_timeout_s`
    and `max_admissible`.
    """

    base_url: str = ""
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    close_timeout_s: float = 2.0

    def __init__(self):
        super().__init__()
        self._client = None  # opened at reset (TRL's guide: lazy, and closed before reopening)

    def _start(self, task_id: int) -> StepResult:
        self._close_client()
        self._client = TextEnvClient(
            self.base_url,
            connect_timeout_s=self.connect_timeout_s,
            message_timeout_s=self.timeout_s,
            close_timeout_s=self.close_timeout_s,
        ).sync()
        return self._call("reset", lambda: self._client.reset(task_id=task_id))

    def _step(self, command: str) -> StepResult:
        return self._call("step", lambda: self._client.step(TextAction(command=command)))

    def _call(self, phase: str, request) -> StepResult:
        """`request()` through the client; any failure ends the episode and drops the connection."""
        try:
            return _from_wire(request())
        except Exception as error:  # whatever the server or the wire did, only this episode ends
            self._close_client()
            kind = failure_kind(error)
            detail = f"no answer within {self.timeout_s:g} s" if kind == "timeout" else f"{type(error).__name__}: {error}"
            return failure_result(f"{kind}: {phase} at {self.base_url}: {detail}"[:400])

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass  # the connection is being dropped because it is broken; its close may be too


def openenv_trl_environment(
    base_url: str,
    *,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 10.0,
    close_timeout_s: float = 2.0,
    max_admissible: int = MAX_ADMISSIBLE_SHOWN,
    name: str = "OpenEnvTextEnvironment",
) -> type[OpenEnvEnvironment]:
    """A TRL `environment_factory` class whose episodes are played on the OpenEnv server at `base_url`.

    Args:
        base_url: "http://host:port" (or ws://) of an `envs.openenv_server`.
        timeout_s: seconds to wait for each answer; a later one fails the episode ("timeout").
        connect_timeout_s: seconds to open the WebSocket ("unreachable" after that).
        close_timeout_s: seconds the close handshake may take before the connection is dropped.
        max_admissible: at most this many admissible actions are listed in a tool result.
        name: the class name (TRL logs `get_reward` under it).
    """
    for field, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                         ("close_timeout_s", close_timeout_s)):
        if not value > 0:
            raise ValueError(f"openenv_trl_environment {field}={value}: use a positive number of seconds.")
    if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(f"openenv_trl_environment base_url={base_url!r}: use http://host:port or ws://host:port.")
    attributes = {
        "base_url": base_url.rstrip("/"),
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
        "close_timeout_s": close_timeout_s,
        "max_admissible": max_admissible,
        "__doc__": f"The OpenEnv text env served at {base_url} as a TRL environment_factory class.",
        "__module__": __name__,
    }
    return type(name, (OpenEnvEnvironment,), attributes)
