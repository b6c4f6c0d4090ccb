"""Surface variation: the same env state rendered in varying text, with a knob from 0 to 1.

    env = SurfaceVariation(make_env("textcraft"), level=0.5, seed=0)
    make_env("textcraft", surface_variation=0.5, surface_seed=0)        # the same, by env_kwargs
    python train.py --env textcraft --env_kwargs '{"surface_variation": 0.5}'

Real agent environments vary their text while the state does not change (paraphrased
feedback, result lists in another order, timestamps and counters). Exact-match grouping
(GiGPO's anchor hash) splits such steps into different cells; BiPACE's hidden-state
clusters claim to merge them again. This wrapper builds that condition on purpose, on any
`TextEnv`, without touching the state:

- **paraphrase**: each sentence of the feedback that matches a rule of the env's fixed
  table (`TABLES`, by env name) is replaced, with probability `level`, by one of the
  rule's other wordings, drawn uniformly;
- **shuffle**: each list a rule names (inventory items, "you see a, b, and c") is put in
  a random order with probability `level`; in the task text, the lines listed under a
  header ending in ":" (TextCraft's crafting commands) are shuffled once per episode with
  probability `level`;
- **distractor**: with probability `level` a step's text gets one irrelevant line drawn
  from `DISTRACTORS`, holding a random counter (a clock, a turn counter, a temperature).

At level 0 every result is returned as the engine gave it (byte-identical); at level 1
every rule fires on every step, and the counter line makes almost every rendering of a
state unique. Admissible actions, rewards, `done`, `won`, `info` and the expert are the
inner env's. The anchor follows the rendered text, as a real env's would: an env whose
anchor is its observation (ALFWorld) gets the rendered observation; an env whose anchor
is a state string (TextCraft's "goal: ...; inventory: ...") gets that string rendered by
the same rules and the same step's distractor. The true state is the inner env's:
`unwrap(env)` returns it, and `last_unvaried` holds the inner env's latest result.

Determinism: each draw comes from `random.Random` seeded by the string
"seed/stream/episode/step/part" (stable across processes and `PYTHONHASHSEED`), where
`episode` counts this wrapper's resets and `stream` numbers wrapper instances (by default
in the order a process builds them, so the G rollouts of one task group, played by G env
instances, render one state differently, and a rerun renders everything the same).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .base import StepResult, TaskSpec, TextEnv

__all__ = [
    "SurfaceVariation",
    "Rule",
    "TABLES",
    "DISTRACTORS",
    "SURFACE_KWARGS",
    "check_level",
    "split_surface_kwargs",
    "unwrap",
]

# env_kwargs keys the wrapper takes (they never reach the engine's constructor)
SURFACE_KWARGS = {"surface_variation": "level", "surface_seed": "seed"}


@dataclass(frozen=True)
class Rule:
    """One sentence form and its wordings.

    `pattern` matches a whole sentence with named groups; `wordings` are format strings
    over those groups, the first being the engine's own. `lists` names the groups that
    hold a comma list ("a, b, and c") or a bracket list ("[a] (1) [b] (2)"), shuffled
    as units.
    """

    pattern: str
    wordings: tuple[str, ...]
    lists: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "regex", re.compile(self.pattern))


_TEXTCRAFT = (
    Rule(r"^goal: (?P<goal>[^;]*); inventory: (?P<items>.*)$",
         ("goal: {goal}; inventory: {items}", "target {goal} | carrying {items}", "Goal = {goal}. Held: {items}.",
          "[{goal}] inventory -> {items}"), lists=("items",)),
    Rule(r"^You have just started\. Your inventory is empty\.$",
         ("You have just started. Your inventory is empty.", "A new game begins with an empty inventory.",
          "You start out carrying nothing.", "Fresh start: nothing in your bag yet.")),
    Rule(r"^Crafted (?P<n>\d+) (?P<item>\S+)$",
         ("Crafted {n} {item}", "You crafted {n} {item}.", "Crafting done: {n} x {item}.",
          "{n} {item} made and added to your inventory.", "Success! You now have {n} more {item}.")),
    Rule(r"^Got (?P<n>\d+) (?P<item>.+)$",
         ("Got {n} {item}", "You got {n} {item}.", "Fetched {n} {item}.", "{n} {item} added to your inventory.",
          "Picked up {n} {item}.")),
    Rule(r"^Inventory: You are not carrying anything\.$",
         ("Inventory: You are not carrying anything.", "Your inventory is empty.", "You carry nothing.",
          "Inventory: (empty)")),
    Rule(r"^Inventory: (?P<items>(?:\[[^\]]+\] \(\d+\) ?)+)$",
         ("Inventory: {items}", "You are carrying: {items}", "Your bag holds {items}", "Items on hand: {items}"),
         lists=("items",)),
    Rule(r"^Could not find enough items to craft (?P<x>.+)$",
         ("Could not find enough items to craft {x}", "You lack the ingredients to craft {x}.",
          "Not enough items for {x}.", "Crafting {x} failed: missing ingredients.")),
    Rule(r"^Could not find a valid recipe for (?P<x>.+)$",
         ("Could not find a valid recipe for {x}", "No recipe matches {x}.", "That recipe for {x} does not exist.")),
    Rule(r"^Could not find (?P<x>.+)$",
         ("Could not find {x}", "There is no {x} to get.", "{x} is not available.", "You search for {x} in vain.")),
    Rule(r"^Could not execute (?P<x>.+)$",
         ("Could not execute {x}", "The command {x} did nothing.", "Unknown command: {x}",
          "I do not understand: {x}")),
    Rule(r"^The episode is over\.$", ("The episode is over.", "The game has ended.", "Nothing more to do.")),
)

_ALFWORLD = (
    Rule(r"^You are in the middle of a room\.$",
         ("You are in the middle of a room.", "You stand in the middle of a room.", "You find yourself in a room.",
          "You are standing in a room.")),
    Rule(r"^Looking quickly around you, you see (?P<items>.+)\.$",
         ("Looking quickly around you, you see {items}.", "Around you are {items}.",
          "Glancing around, you spot {items}.", "The room contains {items}."), lists=("items",)),
    Rule(r"^Your task is to: (?P<task>.+)$",
         ("Your task is to: {task}", "Your goal: {task}", "Task: {task}", "You must {task}")),
    Rule(r"^You arrive at (?P<loc>[^.]+)\.$",
         ("You arrive at {loc}.", "You reach {loc}.", "You are now at {loc}.", "You walk over to {loc}.")),
    Rule(r"^On the (?P<r>[^,]+), you see (?P<items>.+)\.$",
         ("On the {r}, you see {items}.", "The {r} holds {items}.", "You notice {items} on the {r}.",
          "Lying on the {r}: {items}."), lists=("items",)),
    Rule(r"^In it, you see (?P<items>.+)\.$",
         ("In it, you see {items}.", "Inside: {items}.", "It contains {items}.", "Within it lies {items}."),
         lists=("items",)),
    Rule(r"^The (?P<r>.+) is closed\.$", ("The {r} is closed.", "The {r} is shut.", "You find the {r} closed.")),
    Rule(r"^The (?P<r>.+) is open\.$", ("The {r} is open.", "The {r} stands open.", "You find the {r} open.")),
    Rule(r"^You open the (?P<r>.+)\.$", ("You open the {r}.", "You pull the {r} open.", "The {r} swings open.")),
    Rule(r"^You close the (?P<r>.+)\.$", ("You close the {r}.", "You shut the {r}.", "The {r} is now closed.")),
    Rule(r"^You pick up the (?P<o>.+) from the (?P<r>.+)\.$",
         ("You pick up the {o} from the {r}.", "You take the {o} from the {r}.", "You grab the {o} off the {r}.",
          "The {o} from the {r} is now in your hands.")),
    Rule(r"^You (?P<verb>put|move) the (?P<o>.+?) (?P<prep>in/on|to) the (?P<r>.+)\.$",
         ("You {verb} the {o} {prep} the {r}.", "You place the {o} {prep} the {r}.",
          "The {o} now rests {prep} the {r}.")),
    Rule(r"^Nothing happens\.$", ("Nothing happens.", "Nothing changes.", "That has no effect.",
                                   "Nothing seems to happen.")),
    Rule(r"^You turn on the (?P<o>.+)\.$", ("You turn on the {o}.", "You switch on the {o}.", "The {o} is now on.")),
    Rule(r"^You (?P<verb>heat|cool|clean) the (?P<o>.+?) using the (?P<r>.+)\.$",
         ("You {verb} the {o} using the {r}.", "With the {r}, you {verb} the {o}.", "You {verb} the {o} with the {r}.")),
    Rule(r"^You are carrying: (?P<items>.+)\.$",
         ("You are carrying: {items}.", "In your hands: {items}.", "You hold {items}."), lists=("items",)),
    Rule(r"^You are not carrying anything\.$",
         ("You are not carrying anything.", "Your hands are empty.", "You hold nothing.")),
)

_TINY = (
    Rule(r"^You are at cell (?P<c>\d+)\.$", ("You are at cell {c}.", "You stand on cell {c}.", "Position: cell {c}.")),
    Rule(r"^The goal is cell (?P<g>\d+), (?P<side>.+)\.$",
         ("The goal is cell {g}, {side}.", "Cell {g} is the goal, {side}.", "Target: cell {g} ({side}).")),
    Rule(r"^You moved (?P<d>left|right)\.$", ("You moved {d}.", "You step {d}.", "One cell {d}.")),
    Rule(r"^Nothing happens\.$", ("Nothing happens.", "You stay where you are.", "That move is not possible.")),
)

# Per env name (`TextEnv.name`). An env without a table gets the shuffles of no list and the
# distractor line only; register a table here (or pass `rules=`) for paraphrases.
TABLES: dict[str, tuple[Rule, ...]] = {"textcraft": _TEXTCRAFT, "alfworld": _ALFWORLD, "tiny": _TINY}

# Irrelevant lines; `{n}` is a counter 1..999, `{h}:{m}` a clock.
DISTRACTORS = (
    "The clock on the wall reads {h:02d}:{m:02d}.",
    "Turn counter: {n}.",
    "Ambient temperature: {t} degrees.",
    "Notification #{n}: nothing new.",
    "A distant bell has rung {n} times today.",
    "Server tick {n} processed.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[])")
_BRACKET_ITEM = re.compile(r"\[[^\]]+\] \(\d+\)")
_streams = itertools.count()


def check_level(level: Any, name: str = "level") -> float:
    """`level` as a float in [0, 1]; a one-line error naming `name` otherwise."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level) or not 0 <= level <= 1:
        raise ValueError(
            f"{name}={level!r}: surface variation is a number from 0 (the engine's own text) to 1 "
            "(every paraphrase, shuffle and distractor on every step), e.g. 0.5."
        )
    return float(level)


def split_surface_kwargs(env_kwargs: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine's kwargs, the wrapper's kwargs) of an `env_kwargs` dict.

    {"size": 4, "surface_variation": 0.5, "surface_seed": 1} -> ({"size": 4}, {"level": 0.5, "seed": 1}).
    The wrapper's dict is empty when no surface key is given.
    """
    engine = {k: v for k, v in (env_kwargs or {}).items() if k not in SURFACE_KWARGS}
    surface = {SURFACE_KWARGS[k]: v for k, v in (env_kwargs or {}).items() if k in SURFACE_KWARGS}
    if surface and "level" not in surface:
        raise ValueError("env_kwargs has surface_seed without surface_variation; add e.g. \"surface_variation\": 0.5.")
    if surface:
        check_level(surface["level"], "surface_variation")
        seed = surface.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"surface_seed={seed!r}: use an integer.")
    return engine, surface


def unwrap(env: TextEnv) -> TextEnv:
    """The engine behind any number of `SurfaceVariation` wrappers (the env itself otherwise)."""
    while isinstance(env, SurfaceVariation):
        env = env.env
    return env


# ---------------------------------------------------------------------- rendering (pure)


def _split_list(text: str) -> tuple[list[str], Callable[[list[str]], str]] | None:
    """Items of a list and the function that joins items back in the same style, or None for one item."""
    brackets = _BRACKET_ITEM.findall(text)
    if len(brackets) > 1:
        trailing = text[len(text.rstrip()):]
        return brackets, lambda items: " ".join(items) + trailing
    parts = text.split(", ")
    if len(parts) < 2:
        return None
    anded = parts[-1].startswith("and ")
    if anded:
        parts[-1] = parts[-1][4:]
    return parts, lambda items: ", ".join(items[:-1]) + (", and " if anded else ", ") + items[-1]


def shuffle_list(text: str, rng: random.Random) -> str:
    """`text` as a list ("a, b, and c", "a, b", "[a] (1) [b] (2)") with its items in a random order."""
    split = _split_list(text)
    if split is None:
        return text
    items, join = split
    rng.shuffle(items)
    return join(items)


def render_sentence(sentence: str, rules: Sequence[Rule], level: float, rng: random.Random) -> str:
    """One sentence through the first rule that matches it: lists shuffled and a wording drawn,
    each with probability `level`. Sentences no rule matches are returned unchanged."""
    for rule in rules:
        match = rule.regex.match(sentence)
        if match is None:
            continue
        groups = match.groupdict()
        for name in rule.lists:
            if rng.random() < level:
                groups[name] = shuffle_list(groups[name], rng)
        wording = rule.wordings[0]
        if len(rule.wordings) > 1 and rng.random() < level:
            wording = rng.choice(rule.wordings[1:])
        return wording.format(**groups)
    return sentence


def render_text(text: str, rules: Sequence[Rule], level: float, rng: random.Random) -> str:
    """Every sentence of every line of `text` through `render_sentence`; line breaks and blank lines kept."""
    lines = []
    for line in text.split("\n"):
        sentences = _SENTENCE_END.split(line) if line.strip() else [line]
        lines.append(" ".join(render_sentence(s, rules, level, rng) for s in sentences))
    return "\n".join(lines)


def draw_distractor(rng: random.Random) -> str:
    """One irrelevant line with its counters drawn."""
    template = rng.choice(DISTRACTORS)
    return template.format(n=rng.randint(1, 999), h=rng.randint(0, 23), m=rng.randint(0, 59), t=rng.randint(-20, 45))


def shuffle_listed_lines(text: str, rng: random.Random) -> str:
    """The lines listed under each header line ending in ":" (up to a blank line) in a random order."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].rstrip().endswith(":"):
            j = i + 1
            while j < len(lines) and lines[j].strip():
                j += 1
            block = lines[i + 1 : j]
            rng.shuffle(block)
            lines[i + 1 : j] = block
            i = j
        else:
            i += 1
    return "\n".join(lines)


# ---------------------------------------------------------------------- the wrapper


class SurfaceVariation(TextEnv):
    """Any `TextEnv` with its text varied at `level` (0: unchanged, 1: every variation on every step).

    Args:
        env: the env to wrap (an instance).
        level: probability of each paraphrase, list shuffle and distractor line, in [0, 1].
        seed: the variation's seed (independent of the task's).
        stream: number of this instance among those sharing a seed; None takes the next of a
            process-wide counter (the G envs of a task group then render differently).
        rules: the paraphrase table; None takes `TABLES[env.name]` (no paraphrases if absent).

    See the module docstring for what varies and what does not.
    """

    def __init__(self, env: TextEnv, level: float = 0.5, seed: int = 0, stream: int | None = None,
                 rules: Sequence[Rule] | None = None):
        if not isinstance(env, TextEnv):
            raise ValueError(f"SurfaceVariation env={env!r}: wrap a TextEnv instance (e.g. make_env('textcraft')).")
        self.env = env
        self.level = check_level(level)
        self.seed = int(seed)
        self.stream = next(_streams) if stream is None else int(stream)
        self.rules = tuple(TABLES.get(env.name, ()) if rules is None else rules)
        self.name, self.instruction = env.name, env.instruction
        self.invalid_action, self.report_key = env.invalid_action, env.report_key
        self.milestone_kind = env.milestone_kind  # milestones are the state's, not the text's
        self.episode = -1
        self.turn = 0
        self.task = ""
        self.last_unvaried: StepResult | None = None

    def __getattr__(self, name: str) -> Any:
        # engine attributes (done, _engine, ...) read through; only reached for names not set here
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    @classmethod
    def tasks(cls, split: str = "train", **env_kwargs: Any) -> list[TaskSpec]:
        raise TypeError("SurfaceVariation has no task list of its own; ask the wrapped env's class (unwrap(env)).")

    def _rng(self, part: str) -> random.Random:
        return random.Random(f"{self.seed}/{self.stream}/{self.episode}/{self.turn}/{part}")

    def _render(self, result: StepResult) -> StepResult:
        self.last_unvaried = result
        if self.level == 0:
            return result
        distractor = draw_distractor(self._rng("distractor")) if self._rng("draw").random() < self.level else None

        def render(text: str, part: str) -> str:
            rendered = render_text(text, self.rules, self.level, self._rng(part))
            return f"{rendered}\n{distractor}" if distractor else rendered

        observation = render(result.observation, "observation")
        anchor = observation if result.anchor == result.observation else render(result.anchor, "anchor")
        return StepResult(
            observation=observation,
            reward=result.reward,
            done=result.done,
            won=result.won,
            admissible_actions=result.admissible_actions,
            anchor=anchor,
            info=result.info,
        )

    def reset(self, task_id: int) -> StepResult:
        result = self.env.reset(task_id)
        self.episode += 1
        self.turn = 0
        task = self.env.task
        if self.level > 0 and self._rng("task").random() < self.level:
            task = shuffle_listed_lines(task, self._rng("task-order"))
        self.task = task
        return self._render(result)

    def step(self, action: str) -> StepResult:
        result = self.env.step(action)
        self.turn += 1
        return self._render(result)

    def expert_action(self) -> str | None:
        return self.env.expert_action()

    def milestones(self) -> list[str] | None:
        return self.env.milestones()

    def close(self) -> None:
        self.env.close()
