"""Our text envs as TRL `environment_factory` classes, for `GRPOTrainer` and `BiPACETrainer` alike.

    from envs import as_trl_environment, trl_task_dataset
    from trl import GRPOConfig, GRPOTrainer

    TextCraft = as_trl_environment("textcraft")          # a class, built with no arguments
    trainer = GRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        train_dataset=trl_task_dataset("textcraft", split="train"),
        environment_factory=TextCraft,                     # reward: its get_reward()
        args=GRPOConfig(max_completion_length=1024),
    )

TRL 1.16's contract (`trl/trainer/grpo_trainer.py`, `docs/source/openenv.md`): the trainer
builds instances with no arguments (one per rollout, pooled and reused), calls
`reset(**row)` with every column of the dataset row and appends the string it returns to the
row's last user message; every public method other than `reset` and `get_reward` is a tool
whose schema comes from its type hints and Google-style docstring; `get_reward()` is one more
reward source of weight 1, called once per finished rollout; reward functions see the
instances as their `environments` argument. An exception raised by a tool reaches the model
as `{"error": ...}` and is counted by TRL as a tool failure.

How one of our `TextEnv` steps maps onto it:
- `reset(task_id=..., **row)` plays task `task_id` (the dataset's column) and returns the
  env's instruction, the task and the first observation.
- The one tool is `act(command)`: one env step. It returns the env's own observation text,
  then the admissible actions when the engine knows them, or, once the episode is over, a
  line saying so. The observation is passed unchanged because it is the state: exact-match
  step credit (GiGPO's anchor, `BiPACETrainer`'s hash partition) groups on it. The env's
  own anchor (the observation without action feedback) is the attribute `anchor`.
- A call after the episode ended changes nothing and says so (not an exception: a trainer
  that counts a raising tool as an env failure would turn a won episode into a failed one);
  after a failed episode it raises `EnvironmentFailure` again.
- An env that fails (raises, hangs past `step_timeout`, returns garbage) is handled by
  `envs.vector.VectorEnv`'s failure contract: the episode ends, `failure` holds the reason,
  and the failed `act` raises `EnvironmentFailure` so the trainer sees a failed tool call.
  A failing `reset` raises `EnvironmentFailure` too, as a local env that cannot start would:
  under GRPOTrainer the run stops there instead of training on episodes that never played
  (TRL calls reset outside any guard); `BiPACETrainer` ends only that episode, as failed.
- `get_reward()` is the episode return: the sum of the env's step rewards (`R^ep`,
  docs/concepts/math.md#episode-advantage; 1.0 for a won TextCraft or ALFWorld task, WebShop's score).
- Milestones (BEACON's, `envs.base`): an env whose steps flag them (`milestone_kind = "flag"`: tiny,
  WebShop, ScienceWorld) gets a class attribute `milestones_reached`, the episode's count of flagged
  steps, which `BiPACETrainer` reads after each turn. Plan envs (TextCraft, ALFWorld) do not: a plan is
  matched by the estimator at its threshold, and through TRL a turn is a tool call, not a command.

The state a reward function or a trainer may read off an instance: `task_id`, `task`,
`observation`, `anchor`, `admissible_actions`, `reward`, `won`, `done`, `failure`, `steps`,
`milestones_reached`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from .base import MILESTONE_FLAG, StepResult, TextEnv, resolve_env_class, stratified_subset
from .vector import VectorEnv

__all__ = [
    "EnvironmentFailure",
    "TRLEnvironment",
    "TextEnvEnvironment",
    "as_trl_environment",
    "trl_task_dataset",
    "describe_step",
    "TASK_PROMPT",
]

TASK_PROMPT = (
    "Play the episode below. Call the tool `act` with one command at a time; it returns what happens. "
    "When the episode is over, reply without calling a tool.\n\n"
)
MAX_ADMISSIBLE_SHOWN = 50  # ScienceWorld lists hundreds; a tool result stays bounded
EPISODE_OVER = "The episode is over"


class EnvironmentFailure(RuntimeError):
    """The environment behind a tool failed (crashed, hung past its timeout, answered garbage,
    could not be reached); the episode it was playing is over.

    Raised by `reset` and the tools of `as_trl_environment` and `envs.openenv_env` classes; TRL
    feeds a tool's message back to the model as the tool's error, and a raising `reset` stops
    GRPOTrainer as any local env's would; `BiPACETrainer` ends that episode as an env failure of
    this `kind` ("connection_lost", "unreachable", "timeout"...: the "<kind>: <reason>" prefix of
    the failure text, "exception" when it has none), counted in `env/failures/<kind>`.
    """

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        prefix = re.match(r"\(?([a-z_]+):", message)
        self.kind = kind or (prefix.group(1) if prefix else "exception")


def describe_step(
    observation: str,
    done: bool,
    won: bool,
    admissible_actions: Sequence[str] | None,
    max_admissible: int = MAX_ADMISSIBLE_SHOWN,
) -> str:
    """The text a tool returns for one env step: the observation, then one line of status.

    `observation` first and unchanged (the state anchor); then, if the episode is over,
    "The episode is over (task completed|task not completed). Reply without calling a tool.";
    otherwise, when the engine lists them, "Admissible actions: a, b, ..." (at most
    `max_admissible`, with a count of the rest). A pure function of its arguments, so equal
    engine states give equal text.
    """
    if done:
        outcome = "task completed" if won else "task not completed"
        return f"{observation}\n{EPISODE_OVER} ({outcome}). Reply without calling a tool."
    if admissible_actions is None:
        return observation
    shown = ", ".join(admissible_actions[:max_admissible])
    hidden = len(admissible_actions) - max_admissible
    more = f", ... and {hidden} more" if hidden > 0 else ""
    return f"{observation}\nAdmissible actions: {shown}{more}"


class TRLEnvironment:
    """TRL's `environment_factory` contract over any engine that gives `StepResult`s (module docstring).

    Subclasses implement `_start(task_id)` and `_step(command)`, each returning a
    `StepResult` and never raising for a failing engine: a failure comes back as
    `envs.vector.failure_result(reason)` (done, `info["env_failure"]`). A reset result may
    carry `info["task"]` and `info["instruction"]`. Everything else (the tool, the text it
    returns, the reward, the state attributes) is here, once for every engine.
    """

    instruction: str = ""
    max_admissible: int = MAX_ADMISSIBLE_SHOWN

    def __init__(self):
        self.task_id: int | None = None
        self.task = ""
        self.observation = ""
        self.anchor = ""
        self.admissible_actions: list[str] | None = None
        self.reward = 0.0
        self.won = False
        self.done = True
        self.failure: str | None = None
        self.steps = 0
        self.milestones_reached = 0  # steps the env flagged (read by BiPACETrainer where the class declares it)

    def reset(self, task_id: int | None = None, **row: Any) -> str:
        """Start the episode of `task_id` (the dataset row's column); returns the env's
        instruction, the task and the first observation. Other row columns are ignored."""
        if task_id is None:
            raise ValueError(
                f"{type(self).__name__}.reset got no task_id (row columns: {sorted(row)}); build the "
                "dataset with envs.trl_task_dataset(...) or give it an integer 'task_id' column."
            )
        self.task_id = int(task_id)
        self.reward, self.won, self.steps, self.milestones_reached = 0.0, False, 0, 0
        result = self._start(self.task_id)
        self.task = str(result.info.get("task", ""))
        text = self._take(result)
        if self.failure:
            raise self._failure_error(f"reset failed: {self.failure}")
        instruction = str(result.info.get("instruction", self.instruction))
        header = [instruction] if instruction else []
        if self.task and self.task not in result.observation:  # ALFWorld's first observation holds its task
            header.append(f"Your task is to: {self.task}")
        return "\n".join([*header, text])

    def act(self, command: str) -> str:
        """Send one command to the environment and get what happens.

        Args:
            command: The command to perform, in the environment's own words (one of the
                admissible actions when they are listed).

        Returns:
            The environment's observation after the command, then the admissible actions or,
            once the episode is over, a line saying so.
        """
        if self.done and self.failure:  # a call after the env failed: still failed, of the same kind
            raise self._failure_error(f"The environment failed ({self.failure}); this episode is over.")
        if self.done:
            # Said, not raised: an extra call after a finished episode is the model's mistake, not an
            # env failure (a trainer that counts raising tools as failed episodes would undo a win).
            return f"{EPISODE_OVER}; nothing was done. Reply without calling a tool."
        result = self._step(str(command))
        self.steps += 1
        text = self._take(result)
        if self.failure:
            raise self._failure_error(result.observation)
        return text

    def _failure_error(self, message: str) -> EnvironmentFailure:
        """`message` as an `EnvironmentFailure` of this episode's failure kind (`failure` is "<kind>: <reason>")."""
        return EnvironmentFailure(message, kind=self.failure.split(":", 1)[0].strip() or None)

    def get_reward(self) -> float:
        """The episode return: the sum of the env's step rewards (0.0 for a failed episode)."""
        return float(self.reward)

    def _start(self, task_id: int) -> StepResult:
        raise NotImplementedError

    def _step(self, command: str) -> StepResult:
        raise NotImplementedError

    def _take(self, result: StepResult) -> str:
        """Record a `StepResult` on the instance; returns the tool text (`describe_step`)."""
        self.observation, self.anchor = result.observation, result.anchor
        self.admissible_actions = result.admissible_actions
        self.reward += float(result.reward)
        self.done, self.won = bool(result.done), bool(result.won)
        self.failure = result.info.get("env_failure")
        self.milestones_reached += bool(result.info.get(MILESTONE_FLAG))
        if self.failure:
            self.reward = 0.0
        return describe_step(result.observation, self.done, self.won, self.admissible_actions, self.max_admissible)


class TextEnvEnvironment(TRLEnvironment):
    """One of our `TextEnv`s, run in this process by a one-env `VectorEnv` (its timeouts and
    failure contract). `as_trl_environment` makes the subclasses; they set the class
    attributes `env` (registry name, dotted path or `TextEnv` class), `env_kwargs`,
    `instruction`, `step_timeout`, `backend` and `max_admissible`.
    """

    env: str | type[TextEnv] = "tiny"
    env_kwargs: dict[str, Any] = {}
    step_timeout: float | None = 60.0
    backend: str = "serial"

    def __init__(self):
        super().__init__()
        # The engine is built at the first reset: TRL builds one instance at trainer init
        # only to read the tools, and pools the rest.
        self._vector: VectorEnv | None = None

    def _start(self, task_id: int) -> StepResult:
        if self._vector is None:
            self._vector = VectorEnv(self.env, 1, self.env_kwargs, backend=self.backend, step_timeout=self.step_timeout)
        (result,) = self._vector.reset([task_id])
        return result

    def _step(self, command: str) -> StepResult:
        (result,) = self._vector.step([command])
        return result


def _class_name(env: str | type) -> str:
    base = env if isinstance(env, str) else env.__name__
    words = re.split(r"[^0-9A-Za-z]+", base.rpartition(":")[2].rpartition(".")[2])
    return "".join(word[:1].upper() + word[1:] for word in words if word) + "Environment"


def as_trl_environment(
    env: str | type[TextEnv],
    *,
    step_timeout: float | None = 60.0,
    backend: str = "serial",
    max_admissible: int = MAX_ADMISSIBLE_SHOWN,
    **env_kwargs: Any,
) -> type[TextEnvEnvironment]:
    """A TRL `environment_factory` class playing `env` (registry name, dotted path or `TextEnv` class).

    Args:
        env: "alfworld", "textcraft", "webshop", "scienceworld", "tiny", or any registered env.
        step_timeout: seconds one reset or step may take before its episode fails (None: wait).
        backend: where the engine runs (`envs.vector` backends): "serial" (in this process,
            watched by a helper thread), "thread", or "process" (a worker process per instance).
        max_admissible: at most this many admissible actions are listed in a tool result.
        **env_kwargs: passed to the env's constructor and to its `tasks` (e.g. `size=4` for
            tiny, `source="generated"` for ALFWorld).

    Returns:
        A `TextEnvEnvironment` subclass named after the env (e.g. `TextcraftEnvironment`), built
        with no arguments; TRL logs its `get_reward` under that name.

    A missing optional dependency fails here (`EnvUnavailableError` naming the install command),
    before any model is loaded.
    """
    env_class = resolve_env_class(env) if isinstance(env, str) else env
    if not (isinstance(env_class, type) and issubclass(env_class, TextEnv)):
        raise ValueError(f"as_trl_environment env={env!r}: pass a registered env name, a dotted path or a TextEnv class.")
    if step_timeout is not None and step_timeout <= 0:
        raise ValueError(f"as_trl_environment step_timeout={step_timeout}: use a positive number of seconds, or None.")
    if max_admissible < 1:
        raise ValueError(f"as_trl_environment max_admissible={max_admissible}: list at least one action.")
    env_class.check_available(**env_kwargs)
    attributes = {
        "env": env,
        "env_kwargs": dict(env_kwargs),
        "instruction": env_class.instruction,
        "step_timeout": step_timeout,
        "backend": backend,
        "max_admissible": max_admissible,
        **({"milestones_reached": 0} if env_class.milestone_kind == "flag" else {}),  # declared: BEACON can read it
        "__doc__": f"The {env_class.name or env_class.__name__} env as a TRL environment_factory class "
        f"(envs.trl_env.as_trl_environment, env_kwargs={env_kwargs!r}).",
        "__module__": __name__,
    }
    return type(_class_name(env), (TextEnvEnvironment,), attributes)


def trl_task_dataset(
    env: str | type[TextEnv],
    split: str = "train",
    num_tasks: int = 0,
    prompt: str = TASK_PROMPT,
    **env_kwargs: Any,
):
    """A `datasets.Dataset` of the tasks of `split`, one row per task, for `train_dataset`.

    Columns: `prompt` (a one-message conversation, `prompt`, to which TRL appends what
    `reset` returns: instruction, task, first observation), `task_id` (read by `reset`) and
    `split`. `num_tasks` > 0 takes that many, spread over the env's report strata
    (`stratified_subset`); 0 takes all. GRPO's `num_generations` rollouts of a row play the
    same task, which is what makes them a group.
    """
    from datasets import Dataset

    env_class = resolve_env_class(env) if isinstance(env, str) else env
    specs = stratified_subset(env_class.tasks(split, **env_kwargs), num_tasks, env_class.report_key, label=f"{split} tasks")
    if not specs:
        raise ValueError(f"trl_task_dataset: env {env!r} has no {split!r} tasks with env_kwargs={env_kwargs!r}.")
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": prompt}], "task_id": spec.task_id, "split": spec.split} for spec in specs]
    )
