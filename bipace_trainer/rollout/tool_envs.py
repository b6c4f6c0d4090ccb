"""TRL's environments (`environment_factory`, `tools`, `reward_funcs`) played turn by turn.

TRL 1.16's `GRPOTrainer(environment_factory=MyEnv, tools=[...], reward_funcs=[...])`
plays one chat per rollout: the model calls the env's public methods as tools until it
answers without a tool call, and the whole chat is one sample with one advantage.
`BiPACETrainer` takes the same arguments and plays the same chat, with step credit:

- each assistant turn is one env step and one training sample; its prompt is the chat so
  far, rendered with the env's tool schema by TRL's own `_tokenize_prompts`;
- the reply is parsed by TRL's `parse_response` (transformers' response parsing), and its
  tool calls are run on the env; their results, as TRL's `tool` messages, are the next
  observation, and their text (joined by newlines) is the step's anchor, the state of the
  hash partition (exact match, like GiGPO's);
- the episode ends when a reply has no tool call, at `max_turns`, or once
  `max_tool_calling_iterations` rounds of tool calls have run (TRL's bound; the turn
  that would exceed it ends the episode as truncated, its calls not run);
- `max_completion_length` caps the episode's whole completion, every token after the first
  prompt (replies and tool results), as TRL caps its multi-turn completion: a reply is cut to
  the budget left, which ends the episode (truncated, its calls not run), and tool results
  that would push the completion past the budget are dropped and end it (TRL rolls them back);
  `max_turn_length` caps each reply on its own;
- the episode reward sits on its last step: the env's `get_reward()` (weight 1, as TRL)
  plus `reward_funcs` weighted by `reward_weights`, computed by TRL's own
  `_calculate_rewards` over the whole chat (`completions` are the messages after the
  prompt, `environments` the env instances), on each rank's own rows (no cross-rank
  gather: evaluation shards differ in size); an episode with a positive reward counts as won;
- a tool that raises, a tool call that names no tool or has arguments the tool does not
  take are, as in TRL, the model's mistakes: the error comes back as the tool's result
  (`{'error': '...'}`, TRL's text) and the episode goes on; `tools/failure_frequency` counts
  them (`tool_errors="fail"` ends the episode as an env failure instead). A tool or
  `get_reward` that hangs past `env_step_timeout`, a `reset` that raises, and a tool raising
  `envs.trl_env.EnvironmentFailure` (our envs' "the engine behind me is gone", with its kind:
  `connection_lost`, `unreachable`...) end that episode as failed (`env/failures/<kind>`), like
  any env failure (`envs.vector`), and the run goes on;
- the state of a turn is what its tools returned; a tool that returned nothing (None, or
  empty text) tells no state apart, so that turn's state is its episode's history of calls
  and results instead (distinct histories never share a cell), with a warning once per tool;
- `get_reward()` must return a number: anything else (the string "1.0", None) stops the run
  with an error naming the env's method and the type, as a wrong reward is not an env fault;
- milestones (BEACON's, docs/concepts/math.md#milestones): an env class that declares an integer
  attribute `milestones_reached` (`milestones_reached = 0` on the class; its tools add one for each
  milestone of the task they reach, its `reset` sets it back to 0) flags the turns whose tool calls
  raised it (`info["milestone"]`). An attribute, not a method: TRL makes every public method a tool.
  An estimator that reads milestones refuses a factory whose classes do not declare it, before
  the model loads (`check_milestones`). A static plan is not offered here: a turn is a set of tool
  calls, not one command a plan could name (`envs.as_trl_environment` flags for our flag envs).

Each rollout's env lives in a `ToolSession`, a `TextEnv` that a `VectorEnv` holds, so
TRL's envs get the same failure contract, timeouts and counters as ours. Instances are
built once per env slot and reset for every episode (TRL's "construct once, reset often").
The `serial` and `thread` env backends keep them in this process, where `reward_funcs`
see them as `environments`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from envs.base import MILESTONE_FLAG, StepResult, TextEnv
from envs.trl_env import EnvironmentFailure

from .adapters import EnvAdapter, is_failure as _is_failure
from .types import Action, Rollout, TaskRef

logger = logging.getLogger(__name__)

__all__ = [
    "ToolSession", "ToolEnvAdapter", "PromptAdapter", "ToolEnvSetup", "tool_methods", "check_environment_factory",
    "check_milestones", "SCORE", "MILESTONE_COUNT",
]

SCORE = "__bipace_score__"  # the command that asks a session for its env's get_reward()
MILESTONE_COUNT = "milestones_reached"  # an env's optional count of the milestones it reached (module docstring)
_warned_stateless: set[str] = set()  # tools already warned about (once per process)


def check_environment_factory(factory: Any, datasets: dict[str, Any]) -> None:
    """What GRPOTrainer would find only mid-run, or with a puzzling message, refused before training.

    `factory` must be callable (a class, not an instance); a dict factory's datasets must route every
    row (`environment` column) to one of its keys: TRL's own message, for every bad value at once."""
    if factory is None:
        return
    factories = factory if isinstance(factory, dict) else {None: factory}
    for name, one in factories.items():
        if not callable(one):
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            raise TypeError(
                f"{where} is a {type(one).__name__} instance, which cannot build environments: pass the class, "
                f"not an instance (environment_factory={type(one).__name__}), or a function returning a new instance."
            )
    if not isinstance(factory, dict):
        return
    for label, dataset in datasets.items():
        if dataset is None:
            continue
        names = dataset["environment"] if "environment" in getattr(dataset, "column_names", []) else [None] * len(dataset)
        unknown = sorted({name for name in names if name not in factory}, key=repr)
        if unknown:
            count = sum(name not in factory for name in names)
            raise ValueError(
                f"Example has `environment={unknown[0]!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(factory)}. {label}: {count} of {len(names)} rows "
                f"name an unknown environment ({', '.join(map(repr, unknown))}); fix their 'environment' column."
            )


def check_milestones(factory: Any, needed: bool) -> None:
    """Refuse, before the model loads, TRL envs that give no milestones to an estimator that reads them."""
    if not needed:
        return
    factories = factory if isinstance(factory, dict) else {None: factory}
    lacking = [name for name, one in factories.items() if one is None or not hasattr(one, MILESTONE_COUNT)]
    if lacking:
        where = "tools alone" if factory is None else ", ".join(
            "environment_factory" if name is None else f"environment_factory[{name!r}]" for name in lacking
        )
        raise ValueError(
            f"The estimator reads milestones (BEACON's), which {where} do(es) not give: declare "
            f"`{MILESTONE_COUNT} = 0` on the env class and add one in the tools that reach the task's next "
            "milestone (reset sets it back to 0), or pick a preset without milestones."
        )


def tool_methods(env: Any) -> list[Callable]:
    """The env's tools as TRL exposes them: its public methods but `reset` and `get_reward`
    (listed on the class, so properties are not evaluated)."""
    if env is None:
        return []
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _run(value: Any) -> Any:
    """A tool's result; an async tool's coroutine is run to completion here."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _text(content: Any) -> str:
    """An observation as text: a string, or the text parts of TRL's multimodal content list."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


class ToolSession(TextEnv):
    """One rollout slot: TRL env instances (one per environment name, built on first use)
    and the standalone tools, behind the `TextEnv` reset/step contract.

    `reset(row)` picks the env by the row's "environment" (a dict factory) and returns
    `env.reset(**row)` as the observation; `step(command)` takes the JSON list of a
    reply's tool calls (`{"name", "arguments"}`) and returns their results, or, for
    `SCORE`, the env's `get_reward()` as returned, in the done result's `info["get_reward"]`
    (with `info["env_class"]`, TRL's name for that reward column): the adapter checks its type.
    """

    name = "trl_environment"

    @classmethod
    def tasks(cls, split: str = "train", **env_kwargs: Any) -> list:
        return []  # TRL's envs take their tasks from the dataset's rows

    def __init__(self, factories: dict[Hashable, Callable[[], Any]] | None, tools: Sequence[Callable] = (),
                 multi_environment: bool = False, tool_errors: str = "observe"):
        self.factories = factories or {}
        self.standalone = list(tools)
        self.multi_environment = multi_environment
        self.tool_errors = tool_errors  # "observe": an error is the tool's result (TRL); "fail": the episode fails
        self.instances: dict[Hashable, Any] = {}
        self.env: Any = None  # the current episode's instance
        self.task = ""

    def reset(self, row: dict[str, Any]) -> StepResult:
        name = row.get("environment") if self.multi_environment else None
        if self.factories:
            if name not in self.instances:
                self.instances[name] = self.factories[name]()
            self.env = self.instances[name]
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row
            observation = _text(self.env.reset(**kwargs))
        else:
            observation = ""
        return StepResult(observation=observation, anchor=observation)

    def step(self, command: str) -> StepResult:
        if command == SCORE:  # the value travels as returned: the adapter checks its type in this process
            reward = getattr(self.env, "get_reward", None)
            value = _run(reward()) if reward else 0.0
            return StepResult(observation="", done=True, info={"get_reward": value, "env_class": type(self.env).__name__})
        tools = {tool.__name__: tool for tool in self.standalone + tool_methods(self.env)}
        reached_before = getattr(self.env, MILESTONE_COUNT, None)  # TRL's envs are duck-typed, as get_reward is
        messages, failures, stateless = [], 0, []
        for call in json.loads(command):
            name, arguments = call["name"], call["arguments"]
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")  # TRL's words
                if not isinstance(arguments, dict):
                    raise ValueError(f"the arguments of tool {name!r} are {type(arguments).__name__}, not an object")
                result = _run(tools[name](**arguments))
            except EnvironmentFailure:  # the engine behind the tool is gone: an env failure, whatever tool_errors says
                raise
            except Exception as err:
                if self.tool_errors == "fail":
                    raise
                failures += 1
                result = {"error": str(err)}  # TRL's tool error, shown to the model as the result
            if result is None or not _text(result if isinstance(result, list) else str(result)).strip():
                stateless.append(name)
            messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
        text = "\n".join(_text(m["content"]) for m in messages)
        info = {"tool_messages": messages, "tool_calls": len(messages), "tool_failures": failures}
        if reached_before is not None:
            info[MILESTONE_FLAG] = getattr(self.env, MILESTONE_COUNT) > reached_before
        if stateless:
            info["stateless_tools"] = stateless
        return StepResult(observation=text, anchor=text, info=info)

    def close(self) -> None:
        for env in self.instances.values():
            close = getattr(env, "close", None)
            if callable(close):
                close()
        self.instances.clear()


def _checked_reward(env_class: str, value: Any) -> float:
    """`get_reward()`'s value as a float; anything but a number is the env's bug, not a fault to survive."""
    if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:  # a number, or a 0-d tensor/array
        return float(value)
    raise TypeError(
        f"{env_class}.get_reward() returned {type(value).__name__} {value!r}; it must return a number (int or float): "
        "fix the env's get_reward."
    )


def _warn_stateless(names: list[str]) -> None:
    new = sorted(set(names) - _warned_stateless)
    if new:
        _warned_stateless.update(new)
        logger.warning(
            f"Tool(s) {new} returned nothing (None or empty text), which tells no state apart: those turns' state is "
            "their episode's history of calls and results instead. Return the state as text for exact step credit."
        )


def _tool_calls(parsed: dict[str, Any]) -> list[dict[str, Any]]:
    """A parsed reply's tool calls as {"name", "arguments"} (TRL nests them under "function")."""
    calls = []
    for call in parsed.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append({"name": function.get("name"), "arguments": function.get("arguments", {})})
    return calls


@dataclass
class ToolEnvSetup:
    """What playing TRL's envs takes of the `GRPOTrainer` whose `__init__` set them up, handed over by
    the trainer as values and bound methods, so the rollout never holds the trainer.

    `user_rewards(rows, prompts, completions, completion_ids, environments)`: the user's
    `reward_funcs` (the first `num_user_reward_funcs` of TRL's), unweighted, (n, k), on this rank's
    rows alone (TRL's `_calculate_rewards` without its cross-rank gather, see
    `ToolEnvAdapter._user_rewards`). `take_reward_logs()`: what reward functions logged through TRL's
    `log_metric` / `log_extra` since the last call, as (metrics, extra) dicts, emptied."""

    environment_factories: dict[Hashable, Callable] | None
    multi_environment: bool
    standalone_tools: list[Callable]
    env_tools: dict[Hashable, list[Callable]]  # per environment name, the tools TRL renders and parses with
    tools: list[Callable] | None  # TRL's `tools`
    tokenizer: Any  # parses replies (TRL's `parse_response`)
    max_tool_calling_iterations: int | None
    num_reward_funcs: int  # TRL's reward columns: the user's, then one `get_reward` per env class
    reward_func_names: list[str]
    reward_weights: Any  # (num_reward_funcs,) tensor
    user_rewards: Callable[..., Any]
    take_reward_logs: Callable[[], tuple[dict[str, list[float]], dict[str, Any]]]
    max_completion_length: int  # TRL's: the budget of an episode's whole completion (replies and tool results)
    tool_suffix_ids: Callable[[list[dict[str, Any]]], list[int]]  # TRL's `_get_tool_suffix_ids`: tokens tool results add
    warned_log_extra: bool = False  # `log_extra` columns are warned about once per run


class ToolEnvAdapter(EnvAdapter):
    """Plays TRL envs in a `run_rollouts` loop; see the module docstring.

    Args:
        setup: what `GRPOTrainer.__init__` set up (`ToolEnvSetup`: its tools per env,
            `max_tool_calling_iterations`, reward functions...).
        num_user_reward_funcs: how many of TRL's reward functions the user passed (TRL
            appends one `get_reward` column per env class after them; those are played by
            the sessions instead, inside the env failure contract).
    """

    uses_tools = True

    def __init__(self, setup: ToolEnvSetup, num_user_reward_funcs: int):
        self.setup = setup
        self.num_user_reward_funcs = num_user_reward_funcs

    # -- per rollout
    def _new_rollout(self, tasks: Sequence[TaskRef]) -> None:
        self.tasks = list(tasks)
        self.rows = [dict(task.inputs or {}) for task in tasks]
        multi = self.setup.multi_environment if self.setup.environment_factories is not None else False
        self.names = [row.get("environment") if multi else None for row in self.rows]
        self.tool_rounds = [0] * len(tasks)
        self.tool_calls = [0] * len(tasks)  # TRL's tools/call_frequency and tools/failure_frequency, per episode
        self.tool_failures = [0] * len(tasks)
        self.history: list[list[Any]] = [[] for _ in tasks]  # (calls, results) per turn: the state of a stateless tool
        self.chats: list[list[dict[str, Any]]] = []
        self.prompts: list[list[dict[str, Any]]] = []
        # TRL's completion budget (`max_completion_length`): each episode's first prompt length, the
        # tokens its completion holds after the last reply, and whether a reply was cut to fit
        self.first_prompt: list[int | None] = [None] * len(tasks)
        self.completion_tokens = [0] * len(tasks)
        self.cut = [False] * len(tasks)

    def start(self, envs, tasks: Sequence[TaskRef]):
        self._new_rollout(tasks)
        results = envs.reset(self.rows) if tasks else []
        for row, result in zip(self.rows, results):
            prompt = list(row.get("prompt") or [{"role": "user", "content": ""}])
            if result is not None and not _is_failure(result) and result.observation:
                # TRL's rule: the observation of reset() is appended to the last prompt message
                prompt = prompt[:-1] + [{**prompt[-1], "content": str(prompt[-1]["content"]) + result.observation}]
            self.prompts.append(prompt)
            self.chats.append(list(prompt))
            if result is not None and not _is_failure(result):
                result.info = {**result.info, "task": _text(prompt[-1]["content"])}
                if not result.anchor:  # an env that owns no observation: the prompt is the state
                    result.anchor = result.observation = _text(prompt[-1]["content"])
        return results

    def messages(self, i, turn):
        return self.chats[i]

    def environment(self, i):
        return self.names[i]

    def _fit_budget(self, i: int, prompt_ids: list[int], completion_ids: list[int]) -> bool:
        """Cut the reply, in place (the step records this very list), to the episode's completion
        budget left (`max_completion_length` minus what the completion already holds: the prompt's
        growth since the first turn); True if it was cut."""
        if self.first_prompt[i] is None:
            self.first_prompt[i] = len(prompt_ids)
        left = max(self.setup.max_completion_length - (len(prompt_ids) - self.first_prompt[i]), 0)
        cut = len(completion_ids) > left
        if cut:
            del completion_ids[left:]
        self.completion_tokens[i] = len(prompt_ids) - self.first_prompt[i] + len(completion_ids)
        self.cut[i] = cut
        return cut

    def act(self, i, text, prompt_ids, completion_ids):
        from trl.chat_template_utils import parse_response

        setup = self.setup
        if self._fit_budget(i, prompt_ids, completion_ids):  # the budget is spent: the episode ends, no call runs
            text = setup.tokenizer.decode(completion_ids, skip_special_tokens=True)
            return Action(None, True, "answer: " + " ".join(text.lower().split()), {"role": "assistant", "content": text})
        tools = setup.env_tools[self.names[i]] if setup.environment_factories is not None else setup.tools
        parsed = parse_response(setup.tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=tools)
        calls = _tool_calls(parsed)
        if not calls:  # an answer: the episode ends here
            return Action(None, True, "answer: " + " ".join(str(parsed.get("content", "")).lower().split()), parsed)
        command = json.dumps(calls, sort_keys=True, default=str)
        return Action(command, True, command, parsed)

    def step(self, envs, actions):
        commands: list[str | None] = [None] * len(actions)
        local: dict[int, StepResult] = {}
        for i, action in enumerate(actions):
            if action is None:
                continue
            self.chats[i].append(action.parsed)
            if action.command is None:
                local[i] = StepResult(observation="", done=True, info={"truncated": "max_completion_length"} if self.cut[i] else {})
            elif self.tool_rounds[i] >= self.setup.max_tool_calling_iterations:
                local[i] = StepResult(observation="", done=True, info={"truncated": "max_tool_calling_iterations"})
            else:
                self.tool_rounds[i] += 1
                commands[i] = action.command
        results = envs.step(commands) if any(c is not None for c in commands) else [None] * len(actions)
        for i, result in local.items():
            results[i] = result
        for i, command in enumerate(commands):
            if command is None:
                continue
            self.tool_calls[i] += len(json.loads(command))
            if _is_failure(results[i]):
                continue
            info = results[i].info
            self.tool_failures[i] += info.get("tool_failures", 0)
            if self._past_budget(i, info.get("tool_messages", [])):  # TRL drops these results and ends the episode
                results[i] = StepResult(observation="", done=True, info={"truncated": "max_completion_length"})
                continue
            self.chats[i].extend(info.get("tool_messages", []))
            self.history[i].append([json.loads(command), results[i].observation])
            if info.get("stateless_tools"):
                # The tools' results tell no state apart ("None" after every call): the history does, and
                # two different histories never share a cell (at worst one state is split in two).
                results[i].anchor = "history: " + json.dumps(self.history[i], sort_keys=True, default=str)
                _warn_stateless(info["stateless_tools"])
        return results

    def _past_budget(self, i: int, messages: list[dict[str, Any]]) -> bool:
        """Whether these tool results, tokenized as TRL appends them, would take the completion past
        `max_completion_length`."""
        if not messages:
            return False
        suffix = self.setup.tool_suffix_ids(messages)
        return self.completion_tokens[i] + len(suffix) > self.setup.max_completion_length

    def finish(self, envs, rollout: Rollout) -> None:
        """Each episode's reward on its last step: `get_reward` (in the session) plus the
        weighted `reward_funcs` (TRL's `_calculate_rewards`)."""
        episodes = rollout.episodes
        last = {}
        for index, step in enumerate(rollout.steps):
            last[step.traj] = index
        for i, episode in enumerate(episodes):
            episode.tool_calls, episode.tool_failures = self.tool_calls[i], self.tool_failures[i]
        scored = [not e.failed and e.traj in last for e in episodes]
        rewards = [0.0] * len(episodes)
        if self.setup.num_reward_funcs > self.num_user_reward_funcs:  # TRL found a get_reward
            results = envs.step([SCORE if ok else None for ok in scored])
            for i, result in enumerate(results):
                if not scored[i]:
                    continue
                if _is_failure(result):  # get_reward raised or hung: the episode failed
                    episodes[i].failed, scored[i] = True, False
                    episodes[i].failure = (result.info or {}).get("env_failure", "get_reward failed")
                else:
                    name = result.info.get("env_class", "get_reward")  # TRL's name for the column: the env's class
                    value = _checked_reward(name, result.info.get("get_reward"))
                    rewards[i] += value
                    episodes[i].reward_terms[name] = value
        if self.num_user_reward_funcs:
            funcs = self._user_rewards(envs, rollout, scored)
            rewards = [r + f for r, f in zip(rewards, funcs)]
        for i, episode in enumerate(episodes):
            if scored[i]:
                rollout.steps[last[episode.traj]].reward += rewards[i]
                episode.reward += rewards[i]
                episode.won = episode.reward > 0

    def _instances(self, envs) -> list[Any]:
        sessions = envs.local_envs() if hasattr(envs, "local_envs") else []
        return [getattr(s, "env", None) for s in sessions] + [None] * (len(self.tasks) - len(sessions))

    def _user_rewards(self, envs, rollout: Rollout, scored: list[bool]) -> list[float]:
        """The user's `reward_funcs`, weighted, by TRL's `_calculate_rewards` on this rank's rows alone.

        TRL's method ends by gathering the rewards over ranks, which assumes every rank scores
        as many rows at the same time. An evaluation's shards differ (3 tasks on 2 ranks) or
        are empty (a rank with none never gets here), so that gather would fail or wait
        forever; each episode's reward needs only its own row, so the gather is left out.

        Only the scored episodes (not failed) are passed: a failed episode has no reward, and its
        env instance may be broken, so a reward function reading it must not stop the run."""
        import torch

        setup, k = self.setup, self.num_user_reward_funcs
        totals = [0.0] * len(self.tasks)
        keep = [i for i, ok in enumerate(scored) if ok]
        if not keep:
            return totals
        completion_ids = [[] for _ in self.tasks]
        for step in rollout.steps:
            completion_ids[step.traj - rollout.episodes[0].traj] += list(step.completion_ids)
        instances = self._instances(envs)
        rows, prompts = [self.rows[i] for i in keep], [self.prompts[i] for i in keep]
        completions = [self._completion(i) for i in keep]
        per_func = setup.user_rewards(rows, prompts, completions, [completion_ids[i] for i in keep], [instances[i] for i in keep])
        self._take_reward_logs(rollout)
        weights = setup.reward_weights[:k].to(per_func.device)
        total = torch.nan_to_num((per_func * weights.unsqueeze(0)).nansum(dim=1), nan=0.0)
        for row, (i, value) in enumerate(zip(keep, total)):
            totals[i] = float(value)
            for name, term in zip(setup.reward_func_names[:k], per_func[row].tolist()):
                rollout.episodes[i].reward_terms[name] = term  # unweighted, as TRL logs rewards/<name>/mean
        return totals

    def _completion(self, i: int) -> Any:
        """What reward functions receive as episode i's completion: the messages after the prompt (TRL's)."""
        return self.chats[i][len(self.prompts[i]):]

    def _take_reward_logs(self, rollout: Rollout) -> None:
        """What the reward functions logged through TRL's `log_metric` (each name's mean goes into
        the rollout's metrics, so a training step logs it) and `log_extra` (TRL's columns are one
        value per episode, the completions table has a row per turn: dropped, with a warning).
        TRL flushes both in the `_generate_and_score_completions` this trainer replaces."""
        pending, extra = self.setup.take_reward_logs()
        rollout.reward_metrics.update({name: sum(values) / len(values) for name, values in pending.items() if values})
        if extra and not self.setup.warned_log_extra:
            self.setup.warned_log_extra = True  # once per run
            logger.warning(f"reward functions logged log_extra columns {sorted(extra)}; BiPACETrainer's completions "
                           "table has one row per turn and does not show them (log_metric values are logged).")


class PromptAdapter(ToolEnvAdapter):
    """Plain GRPO: rows with a "prompt" (text or chat), scored by `reward_funcs`, with no env and no
    tools. Each row is a one-step episode: the model replies once, the reply ends the episode, and
    TRL's `_calculate_rewards` scores it as GRPOTrainer would (text prompts get text completions,
    chat prompts a list holding the assistant message, parsed by `parse_response` where the
    tokenizer has a response schema). Its state, for dumps and the hash partition, is the prompt."""

    uses_tools = False

    def start(self, envs, tasks: Sequence[TaskRef]):
        self._new_rollout(tasks)
        results = envs.reset([{} for _ in tasks]) if tasks else []
        self.prompts = [row["prompt"] for row in self.rows]
        self.replies: list[Any] = [None] * len(tasks)
        for prompt, result in zip(self.prompts, results):
            if result is not None and not _is_failure(result):
                text = prompt if isinstance(prompt, str) else _text(prompt[-1]["content"])
                result.anchor = result.observation = text
                result.info = {**result.info, "task": text}
        return results

    def messages(self, i, turn):
        return self.prompts[i]

    def act(self, i, text, prompt_ids, completion_ids):
        if isinstance(self.prompts[i], str):
            reply: Any = text
        else:
            tokenizer = self.setup.tokenizer
            if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
                from trl.chat_template_utils import parse_response

                reply = [parse_response(tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=None)]
            else:
                reply = [{"role": "assistant", "content": text}]
        return Action(None, True, "answer: " + " ".join(text.lower().split()), reply)

    def step(self, envs, actions):
        results: list[StepResult | None] = [None] * len(actions)
        for i, action in enumerate(actions):
            if action is not None:
                self.replies[i] = action.parsed
                results[i] = StepResult(observation="", done=True)
        return results

    def _completion(self, i: int) -> Any:
        return self.replies[i]
