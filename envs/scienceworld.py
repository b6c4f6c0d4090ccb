"""ScienceWorld: elementary-school science tasks in a text simulator, on `scienceworld` (1.2.3).

    pip install scienceworld==1.2.3        # the simulator jar ships in the wheel
    apt-get install openjdk-17-jre-headless  # it runs on Java 17+

Each env instance owns one JVM (about 3 s to start). 30 tasks ("boil", "find-plant",
"power-component", ...), each with its own number of variations (10 to 1,386; 7,207
in all). A task id encodes one (task, variation) pair:

    task_id = 10_000 * task_index + variation

with `task_index` the task's position in ScienceWorld's own table (paper order 1-1,
1-2, ..., 10-2), so ids stay put when a release changes variation counts. Splits are
ScienceWorld's: "train", "valid" (its dev set) and "test", from
`get_variations_train/dev/test`. Enumerating them loads all 30 tasks (about 15 s), so
the table is cached on disk per scienceworld version (see `cache_dir`).

Choices (the engine does not decide these):
- Reward: `reward="success"` (default) gives 1.0 on the winning step, like the other
  envs and the sparse setting of the papers; `reward="score"` gives the change of
  the engine's progress score in [0, 1] (a failed task falls back to 0, so the
  episode return is the final progress). `info["score"]` always holds the raw score
  (-1 after a failure, 1 after a win).
- `admissible_actions` is None: the engine's valid list holds ~2,800 action-object
  combinations and costs ~0.8 s per step to compute. The task text lists the 26
  action templates ("open OBJ", "move OBJ to OBJ", ...) instead.
- Steps call the simulator directly (`server.step`, `getScore`, `getCompleted`)
  rather than `ScienceWorldEnv.step`, which also recomputes that valid list: 5-50 ms
  per step instead of 100-700 ms.
- Anchor: the room seen by a free "look around" plus the inventory, which change
  only when the world does (the step's own text, e.g. "The door is now open.", does
  not say where the agent is).
- Done when the engine says the task is completed or its score falls below zero (a
  failed task, e.g. focusing on the wrong object); `won` only with a full score.
- Expert: the engine's gold action sequence, generated at reset when `gold_path=True`
  (0.5-10 s per reset, hence off by default). It is followed while the agent follows
  it; after a deviation there is no oracle and `expert_action` returns None.
- Milestones (`milestone_kind = "flag"`): a step whose score rose above the previous step's
  reached one (`info["milestone"]`), BEACON's `subgoal_completed`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Any

from .base import MILESTONE_FLAG, EnvUnavailableError, StepResult, TaskSpec, TextEnv, normalise_action, register_env

__all__ = ["ScienceWorldEnv", "TASK_ID_STRIDE", "encode_task_id", "decode_task_id"]

TASK_ID_STRIDE = 10_000
INSTALL_HINT = "pip install scienceworld==1.2.3 and Java 17+ on PATH (apt-get install openjdk-17-jre-headless)"
_SPLIT_QUERIES = {"train": "get_variations_train", "valid": "get_variations_dev", "test": "get_variations_test"}


def encode_task_id(task_index: int, variation: int) -> int:
    return TASK_ID_STRIDE * task_index + variation


def decode_task_id(task_id: int) -> tuple[int, int]:
    """task_id -> (task_index, variation)."""
    return divmod(int(task_id), TASK_ID_STRIDE)


def _import_scienceworld():
    if shutil.which("java") is None:
        raise EnvUnavailableError(f"ScienceWorldEnv needs a `java` executable on PATH. Install: {INSTALL_HINT}")
    try:
        import scienceworld
    except ImportError as err:
        message = f"ScienceWorldEnv needs the scienceworld package ({err}). Install: {INSTALL_HINT}"
        raise EnvUnavailableError(message) from err
    return scienceworld


def _start_engine(jar_path: str | None = None):
    """Start one simulator JVM; a start failure (Java too old, no memory) names the fix."""
    scienceworld = _import_scienceworld()
    try:
        return scienceworld.ScienceWorldEnv("", serverPath=jar_path)
    except Exception as err:
        message = f"ScienceWorld's JVM did not start ({type(err).__name__}: {err}). Check: {INSTALL_HINT}"
        raise EnvUnavailableError(message) from err


@functools.lru_cache(maxsize=None)
def _task_table() -> list[tuple[str, str]]:
    """(task name, topic) per task index, in ScienceWorld's own task order."""
    _import_scienceworld()
    from scienceworld.constants import TASKS
    from scienceworld.utils import infer_task

    return [(infer_task(task["task_name"]), f"{task['topic']}: {task['task']}") for task in TASKS]


def _default_cache_dir() -> str:
    """`$BIPACE_CACHE`, the project's one cache variable, or `~/.cache/bipace_trainer`."""
    return os.environ.get("BIPACE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "bipace_trainer")


@functools.lru_cache(maxsize=None)
def _variation_splits(cache_dir: str) -> dict[str, dict[str, list[int]]]:
    """{task name: {"train"|"valid"|"test": variations}}, from the disk cache or the engine."""
    scienceworld = _import_scienceworld()
    path = os.path.join(cache_dir, f"scienceworld-{scienceworld.__version__}-variations.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    engine = _start_engine()
    try:
        table = {}
        for task_name, _ in _task_table():
            engine.load(task_name, 0, "")
            table[task_name] = {split: list(getattr(engine, query)()) for split, query in _SPLIT_QUERIES.items()}
    finally:
        engine.close()
    os.makedirs(cache_dir, exist_ok=True)
    # Write then rename, so workers computing the table at once never read half a file.
    with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False, suffix=".tmp") as f:
        json.dump(table, f)
    os.replace(f.name, path)
    return table


@register_env("scienceworld")
class ScienceWorldEnv(TextEnv):
    """ScienceWorld behind the `TextEnv` interface. See the module docstring for ids and choices.

    Args:
        simplifications: ScienceWorld simplification string, e.g. "easy" or
            "openDoors,selfWateringFlowerPots" ("" = none, the paper's hardest setting).
        reward: "success" (1.0 on the winning step) or "score" (progress deltas in [0, 1]).
        gold_path: generate the gold action sequence at each reset, for `expert_action`.
        jar_path: simulator jar; None uses the one inside the package.
    """

    instruction = (
        "You are an agent in ScienceWorld, a text simulator of a house with a kitchen, a greenhouse, "
        "a workshop and more. Act with short commands built from the templates in the task, "
        "replacing OBJ with an object or place you can see."
    )
    invalid_action = "look around"
    report_key = "task_name"
    milestone_kind = "flag"  # a step whose score rose reached a subgoal (BEACON's subgoal_completed)

    def __init__(
        self, simplifications: str = "", reward: str = "success", gold_path: bool = False, jar_path: str | None = None
    ):
        if reward not in ("success", "score"):
            raise ValueError(f"ScienceWorldEnv reward={reward!r}: use 'success' or 'score'.")
        self.simplifications = simplifications
        self.reward_mode = reward
        self.gold_path = gold_path
        self._tasks = _task_table()
        self._engine = _start_engine(jar_path)
        self._server = self._engine.server
        self._gold: list[str] = []
        self._gold_position = 0
        self._progress = 0.0
        self._score = 0.0
        self.task_name = ""
        self.variation = 0
        self.done = True

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return ("train", "valid", "test")

    @classmethod
    def tasks(cls, split: str = "train", cache_dir: str | None = None, **_: Any) -> list[TaskSpec]:
        """All (task, variation) pairs of `split`; the first call per version starts a JVM (~15 s)."""
        if split not in cls.splits():
            raise ValueError(f"split={split!r} is not a ScienceWorld split; use one of {cls.splits()}.")
        variations = _variation_splits(cache_dir or _default_cache_dir())
        specs = []
        for task_index, (task_name, topic) in enumerate(_task_table()):
            for variation in variations[task_name][split]:
                attributes = {"task_name": task_name, "topic": topic, "variation": variation}
                specs.append(TaskSpec(encode_task_id(task_index, variation), split, attributes))
        return specs

    def _anchor(self) -> str:
        return f"{self._server.freeActionLook()}\n{self._server.freeActionInventory()}"

    @classmethod
    def check_available(cls, **env_kwargs: Any) -> None:
        if shutil.which("java") is None:
            raise EnvUnavailableError(f"ScienceWorldEnv needs a `java` executable on PATH. Install: {INSTALL_HINT}")
        if importlib.util.find_spec("scienceworld") is None:
            raise EnvUnavailableError(f"ScienceWorldEnv needs the scienceworld package. Install: {INSTALL_HINT}")

    def reset(self, task_id: int) -> StepResult:
        task_index, variation = decode_task_id(task_id)
        if not 0 <= task_index < len(self._tasks):
            raise ValueError(
                f"task_id={task_id}: task index {task_index} is not one of ScienceWorld's {len(self._tasks)} tasks "
                f"(task_id = {TASK_ID_STRIDE} * task_index + variation)."
            )
        task_name, _ = self._tasks[task_index]
        num_variations = int(self._server.getTaskMaxVariations(task_name))
        if not 0 <= variation < num_variations:
            raise ValueError(
                f"task_id={task_id}: {task_name!r} has variations 0..{num_variations - 1}, not {variation}."
            )
        self._engine.load(task_name, variation, self.simplifications, generateGoldPath=self.gold_path)
        self._gold = list(self._engine.get_gold_action_sequence()) if self.gold_path else []
        self._gold_position = 0
        self._progress = 0.0
        self._score = 0.0
        self.task_name, self.variation = task_name, variation
        self.done = False
        templates = ", ".join(action for action in self._engine.get_possible_actions() if action != "reset task")
        self.task = f"{self._server.getTaskDescription()}\nCommand templates: {templates}."
        observation = self._server.step("look around")
        return StepResult(observation=observation, anchor=self._anchor(), info=self._info(0.0))

    def _info(self, score: float) -> dict[str, Any]:
        return {"score": score, "task_name": self.task_name, "variation": self.variation}

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult(observation="The episode is over.", done=True, anchor=self._anchor())
        # Case is left as written: the engine's parser ignores it ("Open Door To Kitchen"
        # opens the door) and its gold path is compared without it just below.
        command = normalise_action(action, lower=False)
        if self._gold_position < len(self._gold) and command.lower() == self._gold[self._gold_position].lower():
            self._gold_position += 1
        else:
            self._gold = []  # off the gold path: it no longer applies
        observation = self._server.step(command)
        score = float(self._server.getScore())
        won = bool(self._server.getCompleted()) and score >= 1.0
        self.done = bool(self._server.getCompleted()) or score < 0
        progress = min(max(score, 0.0), 1.0)
        if self.reward_mode == "success":
            reward = 1.0 if won else 0.0
        else:
            reward = progress - self._progress
        self._progress = progress
        info = {**self._info(score), MILESTONE_FLAG: score > self._score}  # the score rose: a subgoal completed
        self._score = score
        return StepResult(
            observation=observation,
            reward=reward,
            done=self.done,
            won=won,
            anchor=self._anchor(),
            info=info,
        )

    def expert_action(self) -> str | None:
        if self.done or self._gold_position >= len(self._gold):
            return None
        return self._gold[self._gold_position]

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
