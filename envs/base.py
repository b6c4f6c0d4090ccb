"""The text-environment interface every engine implements, and the registry.

An environment is text in, text out, gymnasium-like:

    env = make_env("textcraft")
    first = env.reset(task_id=7)          # StepResult with the first observation
    while not first.done:
        first = env.step("get 1 oak log")

`reset` and `step` both return a `StepResult`. Besides observation, reward and
done, a step says whether the task was *won* (so success is never guessed from the
reward), the admissible actions when the engine knows them, and the *anchor*: the raw
current observation with no history, which GiGPO/GAGPO group on by exact match.

Milestones (BEACON's subgoals, docs/concepts/math.md#milestones) are optional; an env says
which kind it gives in `TextEnv.milestone_kind`:

    "plan"   the task's milestone actions in order: `TextEnv.milestones()` after a reset
             (a `VectorEnv(milestones=True)` puts them in the reset result's
             info["milestones"]); the estimator matches them to the actions taken
    "flag"   the step that reached the next milestone says so: info["milestone"] = True
    None     no milestones: the presets that read them refuse the env before a run starts

Register your own env with the decorator, or pass a dotted path to `make_env` (`envs.factory`):

    @register_env("my-env")
    class MyEnv(TextEnv): ...

    make_env("my_package.my_module:MyEnv", some_kwarg=1)
"""

from __future__ import annotations

import importlib
import traceback
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

__all__ = [
    "MILESTONE_FLAG",
    "MILESTONE_PLAN",
    "MILESTONE_KINDS",
    "StepResult",
    "TaskSpec",
    "TextEnv",
    "stratified_subset",
    "normalise_action",
    "register_env",
    "resolve_env_class",
    "registered_envs",
    "EnvUnavailableError",
]


MILESTONE_FLAG = "milestone"  # step info key: this step reached the next milestone (milestone_kind "flag")
MILESTONE_PLAN = "milestones"  # reset info key: the task's milestone actions in order (milestone_kind "plan")
MILESTONE_KINDS = ("plan", "flag")


class EnvUnavailableError(RuntimeError):
    """An env's optional dependency (package, data, Java...) is missing; the message says how to get it."""


@dataclass
class StepResult:
    """What the env says after a reset or a step.

    Attributes:
        observation: text shown to the agent for this step (may include feedback on
            the last action, e.g. "Crafted 1 minecraft:stick").
        reward: env reward of the step just taken (0.0 after a reset).
        done: the episode is over (won, lost, or ended by the engine). A turn budget
            imposed by the trainer is *not* reported here; the rollout truncates.
        won: the task was accomplished at this step.
        admissible_actions: the actions the engine accepts now, or None when it does
            not know them.
        anchor: the raw current observation with no history, used for exact-match
            state grouping. Two steps in the same engine state must get the same anchor.
        info: engine-specific extras (task type, expert plan, failure reason...).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    won: bool = False
    admissible_actions: list[str] | None = None
    anchor: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """One task of an env: the id passed to `reset` and what is known about it.

    `attributes` holds whatever the env exposes for splitting and reporting, for
    example {"depth": 2} for TextCraft or {"task_type": "pick_heat_then_place_in_recep"}
    for ALFWorld. Which attribute success is reported per is the env's
    `TextEnv.report_key` (e.g. "task_type"), or None.
    """

    task_id: int
    split: str
    attributes: dict[str, Any] = field(default_factory=dict)


def normalise_action(action: Any, lower: bool = True) -> str:
    """The command an engine is given for a model's `action`: white space folded, lower-cased.

    Every run of white space (newlines and tabs too) becomes one space and the ends are
    stripped, so stray spacing from a model never fails a command. Engines that match
    commands in lower case (TextCraft's regexes, ALFWorld's parser) get it lower-cased;
    `lower=False` leaves the case as written, for engines whose arguments keep theirs.
    """
    text = " ".join(str(action).split())
    return text.lower() if lower else text


def stratified_subset(specs: Sequence[TaskSpec], n: int, key: str | None, label: str = "tasks") -> list[TaskSpec]:
    """`n` of `specs` spread evenly over the values of `attributes[key]` (0: all of them), in `specs` order.

    Strata (values of `key`, e.g. ALFWorld's task type or TextCraft's depth) are dealt one
    task at a time in turn, each stratum giving its tasks in `specs` order, until `n` are
    taken: stratum sizes in the subset differ by at most one unless a stratum runs out.
    Deterministic, and a subset of size n is contained in every larger one. With no `key`
    this is `specs[:n]`. Prints how many tasks of each stratum were taken, as `label`.
    """
    if n < 0:
        raise ValueError(f"{label}={n}: the subset size must be >= 0 (0 = all tasks).")
    if not key:
        return list(specs[:n] if n else specs)
    strata: dict[str, list[int]] = {}
    for index, spec in enumerate(specs):
        strata.setdefault(str(spec.attributes.get(key)), []).append(index)
    queues = [strata[value] for value in sorted(strata)]
    taken: list[int] = []
    wanted = min(n or len(specs), len(specs))
    for rank in range(max(map(len, queues), default=0)):
        taken += [queue[rank] for queue in queues if rank < len(queue)][: wanted - len(taken)]
    subset = [specs[index] for index in sorted(taken)]
    counts = Counter(str(spec.attributes.get(key)) for spec in subset)
    split = specs[0].split if specs else "?"
    print(
        f"{label}: {len(subset)} of {len(specs)} {split} tasks, per {key}: "
        + ", ".join(f"{value} {counts[value]}" for value in sorted(strata)),
        flush=True,
    )
    return subset


class TextEnv(ABC):
    """Base class of every text environment.

    Subclasses set `name`, `instruction` (one line describing the env to the agent,
    used at the top of every prompt) and `invalid_action` (the harmless command sent
    to the engine when the model's reply holds no usable action), and implement
    `tasks`, `reset` and `step`. `task` is the goal text of the current episode.
    """

    name: ClassVar[str] = ""
    instruction: ClassVar[str] = ""
    invalid_action: ClassVar[str] = "look"
    report_key: ClassVar[str | None] = None  # TaskSpec attribute success is reported per
    milestone_kind: ClassVar[str | None] = None  # "plan", "flag" or None (module docstring, "Milestones")

    task: str = ""

    @classmethod
    @abstractmethod
    def tasks(cls, split: str = "train", **env_kwargs: Any) -> list[TaskSpec]:
        """The tasks of a split ("train", "valid", ... as the env defines them)."""

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return ("train", "valid")

    @classmethod
    def check_available(cls, **env_kwargs: Any) -> None:
        """Raise `EnvUnavailableError` naming the install command if a dependency is missing.

        Cheap (no engine start, no game generation): the trainer's config calls it so a
        missing package fails at start, before any model is loaded.
        """

    @abstractmethod
    def reset(self, task_id: int) -> StepResult:
        """Start the episode of `task_id`; sets `self.task` and returns the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action string; never raises on an inadmissible or garbled action."""

    def expert_action(self) -> str | None:
        """The oracle's next action in the current state, or None when there is no oracle."""
        return None

    def milestones(self) -> list[str] | None:
        """The current task's milestone actions in order (`milestone_kind = "plan"`), or None."""
        return None

    def close(self) -> None:
        """Release engine resources (processes, JVMs, temp files)."""


_REGISTRY: dict[str, type[TextEnv] | Callable[..., TextEnv]] = {}
# Names whose module is imported on first use, so `import envs` stays cheap and an
# engine's optional dependency is only needed when that engine is asked for.
_LAZY: dict[str, str] = {}


def register_env(name: str, *, lazy_module: str | None = None):
    """Register an env class under `name` (decorator), or a module to import on demand."""
    if lazy_module is not None:
        _LAZY[name] = lazy_module
        return None

    def decorator(cls):
        _REGISTRY[name] = cls
        if isinstance(cls, type) and not getattr(cls, "name", ""):
            cls.name = name
        return cls

    return decorator


def registered_envs() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY))


def _import_env_module(name: str, module_name: str):
    """Import an env's module. ImportError (a missing package or name) is the caller's to word;
    anything else the module raises while importing (a RuntimeError, a SyntaxError) becomes one
    ValueError naming the module, the error and where it was raised, so that train.py can refuse
    the setting in one line before any model loads instead of printing the module's traceback."""
    try:
        return importlib.import_module(module_name)
    except (ImportError, EnvUnavailableError):
        raise
    except Exception as err:  # noqa: BLE001 - a user's module can raise anything at import time
        if isinstance(err, SyntaxError):
            where = f"{err.filename}:{err.lineno}"
            what = f"SyntaxError: {err.msg}"
        else:
            frame = traceback.extract_tb(err.__traceback__)[-1]
            where = f"{frame.filename}:{frame.lineno}"
            what = " ".join(f"{type(err).__name__}: {err}".split())
        raise ValueError(
            f"env={name!r}: importing module {module_name!r} raised {what} ({where}); fix that module, "
            "or pick another env."
        ) from None


def resolve_env_class(name: str) -> type[TextEnv]:
    """Look `name` up in the registry, or import it as "package.module:ClassName" (a `TextEnv` subclass)."""
    if name not in _REGISTRY and name in _LAZY:
        _import_env_module(name, _LAZY[name])
    if name in _REGISTRY:
        return _REGISTRY[name]  # type: ignore[return-value]
    if ":" in name or "." in name:
        module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
        try:
            env_class = getattr(_import_env_module(name, module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"env={name!r}: could not import {attr!r} from {module_name!r} ({err}).") from err
        if not (isinstance(env_class, type) and issubclass(env_class, TextEnv)):
            raise ValueError(
                f"env={name!r} is {env_class!r}, not a subclass of envs.base.TextEnv; subclass TextEnv and "
                "implement tasks, reset and step (see envs/tiny.py)."
            )
        return env_class
    raise ValueError(
        f"env={name!r} is not a registered env. Registered: {', '.join(registered_envs())}. "
        "Register your own with @envs.register_env('name') or pass a dotted path 'package.module:Class'."
    )
