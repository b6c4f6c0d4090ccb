"""ALFWorld (Shridhar et al., 2021, https://arxiv.org/abs/2010.03768) on its real text engine.

    pip install alfworld            # brings textworld and fast-downward
    env = make_env("alfworld")      # official games if found, else generated ones
    spec = AlfWorldEnv.tasks("train")[0]
    first = env.reset(spec.task_id) # "You are in the middle of a room. Looking quickly around you, ..."
    result = env.step("go to countertop 1")

Games. With `source="auto"` (default) the env plays the official games when
`data_dir`, `$ALFWORLD_DATA` or `~/.cache/alfworld` (where `alfworld-download` puts them)
holds `json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl`, and
otherwise games generated offline from the material inside the alfworld wheel
(`envs.alfworld_gen`, generated once and cached). `source="official"` or `"generated"`
forces one. `tasks()` prints, once per process, which games it lists and why; a
`$ALFWORLD_DATA` that holds no official games is a logged warning (with what is wrong with the
folder) before falling back to generated games. Games are collected as ALFWorld's
`AlfredTWEnv.collect_game_files` does: every trial folder with `traj_data.json` and a
`game.tw-pddl` marked solvable, skipping sliced-object and movable-receptacle trials. Official
files of every release play: those from before alfworld 0.4.0 (data 2.1.1, "put {o} in/on {r}",
"You arrive at loc N.") and the later ones (data 2.1.2, "move {o} to {r}"); each file carries
its own PDDL domain and grammar, which the engine and the expert use.

Damaged data. A game file that is empty or cut short keeps its task id (so the ids after it do
not move) but is left out of `tasks()`, and the list of such files is logged once; resetting it,
or a game whose JSON, PDDL or grammar does not parse, raises a ValueError naming the file and the
fix (re-run `alfworld-download`, or delete the trial folder).

Splits: "train", "valid_seen" (in-distribution evaluation), "valid_unseen" (out-of-distribution
evaluation); "valid" is an alias of "valid_unseen". Task ids index the games of all splits
(sorted by path), so `reset(task_id)` needs no split. `TaskSpec.attributes` holds `task_type`
(success is reported per task type), `scene`, `object_target`, `parent_target`,
`toggle_target` and `game` (the trial folder, relative to `json_2.1.1`).

Engine. Each game is played by TextWorld's PDDL backend behind ALFWorld's wrappers
(`AlfredDemangler`, `AlfredInfos`), assembled as `textworld.gym.register_games` assembles
them but loading the game `reset` names instead of cycling through a list. Everything the
agent reads and every command it can give is the engine's:
- observation: the engine's text; the first one without the "-= Welcome to TextWorld,
  ALFRED! =-" banner (as verl-agent strips it), `task` = the "Your task is to: ..." sentence;
- anchor: the observation itself (raw current text, no history);
- admissible_actions: the engine's admissible commands without "help" (it prints the
  command list and changes nothing; verl-agent hides it too). Actions are lower-cased and
  whitespace-normalised before they reach the engine, whose commands are all lower case;
  anything else gets the engine's "Nothing happens.";
- reward 1.0 and done when the goal holds (`infos["won"]`), else 0.0; the engine never
  ends an episode otherwise (the trainer imposes the turn budget);
- `invalid_action` is "look", which is always admissible and changes nothing;
- milestones (`milestone_kind = "plan"`, BEACON's): the expert's whole plan from the start
  state (the game's walkthrough, or the planner's plan when the game has none), as BEACON
  lists each ALFWorld trial's expert actions; computed when asked (`milestones()`), so a run
  that does not read milestones never plans at reset.

Expert. `expert_action()` is the next command of the planner expert, the plan
`AlfredExpert(expert_type="planner")` reports in `infos["extra.expert_plan"]`: an optimal plan
from the current state found by TextWorld's fast-downward (a blind uniform-cost search) in the
loaded game's own PDDL domain, written with the game's own grammar. That wrapper replans the
whole state after every step, which takes from 0.01 s to minutes in a kitchen, so it is not in
the stack. Instead the plan is computed when `expert_action()` is asked and kept while the
agent follows it and its next command is admissible (the rest of an optimal plan stays
optimal); it starts as the game's walkthrough when the game file has one (generated games do).
Otherwise the same search runs on the current state without the objects the goal is not about
(`AlfredEngine.expert_plan`), 0.05-1 s, with plans as long as the full search's. In a game not
won, `expert_action()` returns None only as an expert failure: logged with the game file and
the reason, and counted in `env.expert_failures`.

Cost (2 CPU cores, generated games). A reset builds a new PDDL state, translating the game with
fast-downward's Python translator twice (80% of a reset), plus twice more the first time the
engine plays that game; `_MemoTranslation` keeps the translations of the last ~32 games per
process: a new game's reset 0.6 -> 0.3 s of CPU, a replay 0.1-0.45 s -> ~10 ms. TextWorld derives every
admissible command and every observation from the game's grammar at each step, re-parsing the
same grammar strings with TatSu and deep-copying contexts each time: 60-200 ms a step, 90% of
it that re-parsing and copying (the engine's own PDDL work is ~1 ms, the wrappers and this
class well under 0.1 ms). `_MemoGrammar` derives the same text with each string parsed once
per process: 2-10 ms a step. `memo=False` restores TextWorld's own derivation and translation,
for comparison (`bench/envs.py` Part 4). A worker's envs share nothing but these caches, so N
envs in one process step at the rate of the same games stepped one at a time. Calls into the
engine hold a process-wide lock (TextWorld's grammar parsers and fast-downward's translator are
process-global state), so threads do not speed ALFWorld up: run many envs in a process pool
(`VectorEnv(..., backend="process")`). Building an env is cheap (no engine until the first
reset) and picklable by registry name and keyword arguments.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import types
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .alfworld_gen import SPLITS, TASK_TYPES, engine_guard, generated_data_dir, plan_operators
from .base import EnvUnavailableError, StepResult, TaskSpec, TextEnv, normalise_action, register_env

__all__ = ["TASK_TYPES", "AlfWorldEnv", "AlfredEngine"]

INSTALL_HINT = "pip install alfworld"
_SOURCES = ("auto", "official", "generated")
_SPLIT_ALIASES = {"valid": "valid_unseen"}
_WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_PREFIX = "Your task is to: "
# The game file's "solvable" flag, found without parsing ~100 KB of JSON per game.
_SOLVABLE = re.compile(rb'"solvable"\s*:\s*true')

_DOMAIN_NAME = re.compile(r"\(\s*domain\s+([^\s()]+)", re.IGNORECASE)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _GameEntry:
    path: str  # game.tw-pddl
    split: str
    attributes: dict[str, Any]
    damage: str = ""  # why the game file cannot be played ("" when it can)


@dataclass(frozen=True)
class _DataChoice:
    root: Path  # holds json_2.1.1/
    why: str  # which games these are and why they were chosen, for the log
    ignored_setting: bool = False  # the user pointed at official data that is not there


def _attributes(trial_dir: Path, data_root: Path) -> dict[str, Any]:
    """Task attributes from the official folder name `<task>-<Object>-<Mrecep>-<Recep>-<scene>`.

    The folder name says what traj_data.json says (which can be megabytes in the official
    data); look_at_obj_in_light names its lamp where the others name their receptacle.
    """
    try:
        task_type, obj, mrecep, last, scene = trial_dir.parent.name.split("-")
        scene_num = int(scene)
    except ValueError:
        raise ValueError(
            f"ALFWorld task folder {trial_dir.parent} is not named <task_type>-<Object>-<MovableRecep>-"
            "<Receptacle>-<scene number> as ALFWorld names them; rename it or move it out of json_2.1.1/."
        ) from None
    is_look = task_type == "look_at_obj_in_light"
    return {
        "task_type": task_type,
        "scene": scene_num,
        "object_target": obj,
        "parent_target": "" if is_look else last,
        "toggle_target": last if is_look else "",
        "mrecep_target": "" if mrecep == "None" else mrecep,
        "game": str(trial_dir.relative_to(data_root / "json_2.1.1")),
    }


def _damage(data: bytes) -> str:
    """Why the bytes of a game file cannot be a game ("" if they may be): empty or cut short."""
    data = data.strip()
    if not data:
        return "the file is empty"
    if not (data.startswith(b"{") and data.endswith(b"}")):
        return f"the file is cut short: it ends with {data[-20:].decode('utf-8', 'replace')!r}, not with the closing '}}'"
    return ""


@functools.cache
def _games(data_root: str) -> tuple[_GameEntry, ...]:
    """Every game under `data_root/json_2.1.1`, train then valid_seen then valid_unseen.

    As ALFWorld's `AlfredTWEnv.collect_game_files`: trial folders with `traj_data.json` and a
    `game.tw-pddl` marked solvable, without sliced objects or movable receptacles. A game file
    that cannot be read (empty, cut short) keeps its place, with `damage` saying why, so the
    task ids of the games after it do not change when it is repaired.
    """
    root = Path(data_root)
    entries = []
    for split in SPLITS:
        for traj_file in sorted((root / "json_2.1.1" / split).glob("*/*/traj_data.json")):
            trial_dir = traj_file.parent
            game_file = trial_dir / "game.tw-pddl"
            if "movable" in str(trial_dir) or "Sliced" in str(trial_dir) or not game_file.is_file():
                continue
            data = game_file.read_bytes()
            damage = _damage(data)
            if not damage and not _SOLVABLE.search(data):
                continue
            entries.append(_GameEntry(str(game_file), split, _attributes(trial_dir, root), damage))
    return tuple(entries)


@functools.cache
def _report_damaged(data_root: str) -> None:
    """Log, once per process and data root, the game files that cannot be played."""
    damaged = [game for game in _games(data_root) if game.damage]
    if damaged:
        listing = "".join(f"\n  {game.path}: {game.damage}" for game in damaged)
        logger.warning(
            "%d ALFWorld game file(s) under %s cannot be read and are left out of the task lists "
            "(their task ids stay reserved, so the other ids do not move):%s\nRe-run `alfworld-download` "
            "to repair them, or delete their trial folders.",
            len(damaged),
            data_root,
            listing,
        )


@functools.cache
def _announce(choice: _DataChoice) -> None:
    """Say, once per process, which games the env plays and why."""
    if choice.ignored_setting:
        logger.warning("AlfWorldEnv: %s", choice.why)
    else:
        print(f"AlfWorldEnv: {choice.why}", flush=True)


def _official_hint(folder: Path) -> str:
    """What is wrong with an official-data folder that has no json_2.1.1/, and how to point at the right one."""
    if not folder.exists():
        return f"{folder} does not exist"
    if folder.name == "json_2.1.1":
        return f"{folder} is the json_2.1.1 folder itself; point at its parent, {folder.parent}"
    nested = sorted(folder.glob("*/json_2.1.1"))
    if nested:
        return f"{folder} has no json_2.1.1/, but {nested[0].parent} has: point there"
    return f"{folder} holds no json_2.1.1/ folder"


def _data_choice(
    source: str,
    data_dir: str | None,
    seed: int,
    train_games_per_type: int,
    eval_games_per_type: int,
    cache_dir: str | None,
) -> _DataChoice:
    """Where the games for these settings are (generating them if needed), and why."""
    from_env = os.environ.get("ALFWORLD_DATA")
    ignored = ""
    if source != "generated":
        official = Path(data_dir or from_env or "~/.cache/alfworld").expanduser()
        named_by = (
            f"data_dir={data_dir!r}"
            if data_dir
            else f"$ALFWORLD_DATA={from_env!r}"
            if from_env
            else "~/.cache/alfworld, where alfworld-download puts them ($ALFWORLD_DATA is unset)"
        )
        if (official / "json_2.1.1").is_dir():
            return _DataChoice(official, f"playing the official games in {official / 'json_2.1.1'} ({named_by}).")
        if source == "official" or data_dir is not None:
            raise EnvUnavailableError(
                f"AlfWorldEnv found no official games: {_official_hint(official)} (from {named_by}). Download "
                "them with `alfworld-download` (they go to $ALFWORLD_DATA, default ~/.cache/alfworld) and point "
                "data_dir or $ALFWORLD_DATA at the folder holding json_2.1.1/, or use source='generated' for "
                "offline games."
            )
        if from_env:
            ignored = (
                f"$ALFWORLD_DATA={from_env!r} holds no official games ({_official_hint(official)}), so source='auto' "
                "falls back to generated games. Point $ALFWORLD_DATA at the folder holding json_2.1.1/ to play the "
                "official games, or unset it (or pass source='generated') to silence this. "
            )
    root = generated_data_dir(
        seed=seed,
        train_games_per_type=train_games_per_type,
        eval_games_per_type=eval_games_per_type,
        cache_dir=cache_dir,
    )
    sizes = f"seed {seed}, {train_games_per_type} train and {eval_games_per_type}+{eval_games_per_type} eval games per type"
    if source == "generated":
        why = f"playing generated games ({sizes}) in {root} (source='generated')."
    elif ignored:
        why = f"{ignored}Playing generated games ({sizes}) in {root}."
    else:
        why = (
            f"playing generated games ({sizes}) in {root}: no official games in ~/.cache/alfworld and "
            "$ALFWORLD_DATA is unset (run `alfworld-download` for the official ones)."
        )
    return _DataChoice(root, why, ignored_setting=bool(ignored))


def _data_root(*settings) -> Path:
    return _data_choice(*settings).root


def _require_packages() -> None:
    missing = [name for name in ("alfworld", "textworld", "fast_downward") if importlib.util.find_spec(name) is None]
    if missing:
        raise EnvUnavailableError(f"AlfWorldEnv needs {', '.join(missing)}. Install them: {INSTALL_HINT}")


def _check_settings(source: str, data_dir: str | None, task_types: Sequence[str] | None) -> None:
    """Fail early, and with the fix, on a missing package or a bad setting."""
    _require_packages()
    if source not in _SOURCES:
        raise ValueError(f"AlfWorldEnv source={source!r}; use one of {_SOURCES}.")
    if source == "generated" and data_dir is not None:
        raise ValueError(f"AlfWorldEnv data_dir={data_dir!r} names official data but source='generated'; drop one.")
    unknown = sorted(set(task_types or ()) - set(TASK_TYPES))
    if unknown:
        raise ValueError(f"AlfWorldEnv task_types={unknown} are not ALFWorld task types; use a subset of {TASK_TYPES}.")


def _state_problem(state, initial_problem: str, goal_types: Collection[str], domain_name: str) -> str:
    """A PDDL problem of domain `domain_name` starting in `state` (the engine's `PddlState`) without the
    objects of classes outside `goal_types` that the agent does not hold, with the goal of `initial_problem`."""
    facts = list(state.facts)
    keep_types = {f"{cls}Type".lower() for cls in goal_types}  # fast-downward lower-cases names
    held = {fact.arguments[1].name for fact in facts if fact.name == "holds"}
    dropped = {
        fact.arguments[0].name
        for fact in facts
        if fact.name == "objecttype" and fact.arguments[1].name not in keep_types and fact.arguments[0].name not in held
    }
    declarations = [f"{name} - {kind}" for name, kind in sorted(state.name2type.items()) if name not in dropped]
    # Skips the "new-axiom@" atoms fast-downward derives for the domain's disjunctive preconditions.
    init = [
        f"({fact.name} {' '.join(v.name for v in fact.arguments)})"
        for fact in facts
        if not fact.name.startswith("new-axiom@") and not any(v.name in dropped for v in fact.arguments)
    ]
    indent = "\n        "
    return (
        f"(define (problem replan)\n    (:domain {domain_name})\n"
        f"    (:objects{indent}{indent.join(declarations)}\n    )\n"
        f"    (:init{indent}{indent.join(init)}\n    )\n"
        f"{initial_problem[initial_problem.index('(:goal') :]}"
    )


@functools.lru_cache(maxsize=4096)
def _parsed_symbols(text: str) -> tuple:
    """TextWorld's parse of a grammar string into symbols, once per string (the parse is a pure function of it)."""
    from textworld.envs.pddl import textgen

    return tuple(textgen._parse_and_convert(text, rule_name="symbols"))


@functools.lru_cache(maxsize=4096)
def _conjunctive_query(expression: str):
    from textworld.logic import Rule

    return Rule.parse_conjunctive_query(expression)


class _MemoGrammar:
    """TextWorld's `ContextSensitiveGrammar.derive`, giving the same text without its repeated work.

    TextWorld derives every admissible command and every feedback from its grammar on every
    step, and each derivation re-parses the same strings with a TatSu parser (the symbols of
    each template, the conjunctive query of each condition) and deep-copies the context
    (entity infos included) at each symbol: 90% of a step's time. This walks the same symbols
    in the same order with the same rules, parsing each string once per process and keeping
    each symbol's context beside it instead of in a deep copy (no symbol changes a context;
    `query` builds a new one per match as TextWorld's does). `tests/envs/test_alfworld.py` checks
    that observations and admissible commands match TextWorld's own derivation.
    """

    def __init__(self, grammar):
        self._rules = grammar._rules  # the game's ContextSensitiveGrammar, which this replaces

    def derive(self, start: str, context: dict) -> str:
        from textworld.envs.pddl.textgen import (
            ConditionalSymbol,
            EvalSymbol,
            ListSymbol,
            NonterminalSymbol,
            TerminalSymbol,
        )

        stack = [(symbol, context) for symbol in reversed(_parsed_symbols(start))]
        derived = []
        while stack:
            symbol, context = stack.pop()
            if isinstance(symbol, TerminalSymbol):
                derived.append(str(symbol))
            elif isinstance(symbol, NonterminalSymbol):
                stack += [(rhs, context) for rhs in reversed(self._rhs(symbol, context))]
            elif isinstance(symbol, ConditionalSymbol):
                stack += reversed(self._matches(symbol, context))
            elif isinstance(symbol, EvalSymbol):
                stack += [(value, context) for value in reversed(symbol.derive(context))]
            elif isinstance(symbol, ListSymbol):
                stack += reversed(self._listed(symbol, context))
            else:
                raise NotImplementedError(f"Unknown symbol: {type(symbol)}")
        return "".join(derived)

    def _rhs(self, symbol, context) -> list:
        """`ContextSensitiveGrammar.replace`: the right-hand side of the first rule whose condition holds."""
        from textworld.envs.pddl.textgen import CSGUnknownSymbolError

        rules = self._rules.get(str(symbol))
        if not rules:
            raise CSGUnknownSymbolError(symbol)
        for rule in rules:
            if not rule.condition or _holds(_conjunctive_query(rule.condition), context):
                return rule.rhs
        raise IndexError(f"no rule of #{symbol}# applies")  # TextWorld's rules[0] on an empty list

    def _matches(self, symbol, context) -> list:
        """`ConditionalSymbol.derive`: its expression once per match of its condition, with that match's context."""
        if not symbol.given:
            return [(symbol.expression, context)]
        rule = _conjunctive_query(symbol.given)
        matches = []
        for mapping in context["state"].all_assignments(rule, context["mapping"]):
            variables = dict(context["variables"])
            variables.update({ph.name: context["entity_infos"][var.name] for ph, var in mapping.items()})
            matches.append((symbol.expression, dict(context, variables=variables, mapping={**context["mapping"], **mapping})))
        return matches

    def _listed(self, symbol, context) -> list:
        """`ListSymbol.derive`: the items, joined by the grammar's list separators."""
        from textworld.envs.pddl.textgen import ConditionalSymbol, NonterminalSymbol

        inner = symbol.symbol
        if isinstance(inner, ConditionalSymbol):
            items = self._matches(inner, context)
        else:
            items = [(item, context) for item in inner.derive(context)]
        if not items:
            return [(NonterminalSymbol("list_empty"), context)]
        separator, last = (NonterminalSymbol("list_separator"), context), (NonterminalSymbol("list_last_separator"), context)
        joined = [item for pair in zip(items[:-1], [separator] * (len(items) - 2) + [last]) for item in pair]
        return joined + items[-1:]


class _MemoTranslation(types.ModuleType):
    """`fast_downward` as TextWorld's PDDL engine sees it, with `pddl2sas` answered from memory.

    Every reset builds a new `PddlState`, which translates the game's PDDL to SAS twice with
    fast-downward's Python translator (80% of a reset; loading a game does it twice more). The
    translation is a pure function of (domain, problem, options) and `PddlState` only reads the
    task it returns, so the last `_MAX_TRANSLATIONS` are kept, per process. Installed in
    `textworld.envs.pddl.logic` on first use; `used(False)` (an engine with `memo=False`) goes
    to the translator every time. Engine calls hold the engine lock, so the switch is safe.
    """

    enabled = False

    def __init__(self, module):
        super().__init__(module.__name__)
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def pddl2sas(self, domain: str, problem: str, **options):
        if not _MemoTranslation.enabled:
            return self._module.pddl2sas(domain, problem, **options)
        return _translation(domain, problem, tuple(sorted(options.items())))

    @staticmethod
    @contextlib.contextmanager
    def used(enabled: bool):
        from textworld.envs.pddl import logic

        if not isinstance(logic.fast_downward, _MemoTranslation):
            logic.fast_downward = _MemoTranslation(logic.fast_downward)
        previous, _MemoTranslation.enabled = _MemoTranslation.enabled, enabled
        try:
            yield
        finally:
            _MemoTranslation.enabled = previous


_MAX_TRANSLATIONS = 64  # two per game: ~32 games a process replays without translating


@functools.lru_cache(maxsize=_MAX_TRANSLATIONS)
def _translation(domain: str, problem: str, options: tuple):
    import fast_downward

    return fast_downward.pddl2sas(domain, problem, **dict(options))


def _holds(rule, context) -> bool:
    """Whether the conjunctive query `rule` has a match in the context's state."""
    return any(True for _ in context["state"].all_assignments(rule, context["mapping"]))


class AlfredEngine:
    """One ALFWorld game at a time in TextWorld's PDDL engine, behind ALFWorld's wrappers.

    The stack `textworld.gym.register_games` builds for `AlfredTWEnv` (GenericEnvironment ->
    AlfredDemangler -> AlfredInfos -> Filter), requesting `won`, `admissible_commands` and the
    `gamefile` extra. With `memo` (default) the game's grammar derives its text through
    `_MemoGrammar` (the same text, 20-60x faster steps) and the PDDL translations of a reset are
    kept (`_MemoTranslation`); without it, everything runs through TextWorld's own code.
    """

    def __init__(self, memo: bool = True):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs.wrappers import Filter, GenericEnvironment

        request = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        env = GenericEnvironment(request)
        for wrapper in (AlfredDemangler(shuffle=False), AlfredInfos, Filter):
            env = wrapper(env)
        self._env = env
        self._memo = memo
        self._game_file: str | None = None

    def start(self, game_file: str) -> tuple[str, dict[str, Any]]:
        """Start `game_file` from its initial state: (observation, infos)."""
        with engine_guard(), _MemoTranslation.used(self._memo):
            if game_file != self._game_file:  # loading translates the game twice more: skip it on replays
                self._game_file = None
                self._load(game_file)
                self._game_file = game_file
            return self._env.reset()

    def _load(self, game_file: str) -> None:
        """Load the game, or fail naming the file, what is wrong with it and what to do."""
        fix = (
            "The file is damaged or not an ALFWorld game: re-run `alfworld-download` to restore it, or delete "
            f"its trial folder {Path(game_file).parent}."
        )
        try:
            game = json.loads(Path(game_file).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"ALFWorld game file {game_file} is not valid JSON ({error}). {fix}") from error
        missing = [key for key in ("pddl_domain", "grammar", "pddl_problem") if key not in game]
        if missing:
            raise ValueError(f"ALFWorld game file {game_file} has no {', '.join(missing)}. {fix}")
        try:
            self._env.load(game_file)
        except Exception as error:  # the PDDL translator's and TatSu's parse errors have no common base
            raise ValueError(
                f"ALFWorld game file {game_file}: its PDDL domain, problem or grammar does not parse "
                f"({type(error).__name__}: {error}). {fix}"
            ) from error
        if self._memo:
            logic = self._env.unwrapped._logic
            logic.grammar = _MemoGrammar(logic.grammar)

    def step(self, command: str) -> tuple[str, dict[str, Any]]:
        with engine_guard():
            observation, _, _, infos = self._env.step(command)
        return observation, infos

    def walkthrough(self) -> list[str]:
        """The game file's "walkthrough" (commands from the initial state), or [] if it has none."""
        return list(self._env.unwrapped.walkthrough or [])

    def expert_plan(self, goal_types: Collection[str]) -> list[str] | None:
        """The planner expert's plan from the current state, as commands; None if it finds none.

        `AlfredExpert(expert_type="planner")` reports TextWorld's replan (`PddlState.replan`,
        a uniform-cost search) of the whole state, which can take minutes in a kitchen once the
        agent has moved things around. This runs the same search on the current state without
        the objects the goal is not about (classes outside `goal_types`, e.g. {"Apple"}, unless
        held): no action needs another object, so the plan is valid, and optimal, in the game.
        Like TextWorld's replan, it plans in the loaded game's own PDDL domain and writes commands
        with the game's own grammar (`PddlState.plan_to_templated_actions`): official games before
        alfworld 0.4.0 say "put {o} in/on {r}" where later ones say "move {o} to {r}".
        """
        pddl_env = self._env.unwrapped
        with engine_guard():
            domain = pddl_env._game_data["pddl_domain"]
            match = _DOMAIN_NAME.search(domain)
            problem = _state_problem(
                pddl_env._pddl_state, pddl_env._game_data["pddl_problem"], goal_types, match[1] if match else "alfred"
            )
            operators = plan_operators(problem, domain)
            if operators is None:
                return None
            return pddl_env._pddl_state.plan_to_templated_actions(operators, pddl_env._entity_infos)

    def close(self) -> None:
        """Free the planner's memory in this engine's copy of the fast-downward library.

        The copy stays mapped: `dlclose` on one copy while another is loaded (the game
        generator's, `alfworld_gen._planner`) crashes the interpreter at exit, as its C++
        destructors then run from unmapped code. One copy per engine is a few MB.
        """
        pddl_env = self._env.unwrapped
        if pddl_env is not None and getattr(pddl_env, "downward_lib", None) is not None:
            with engine_guard():
                pddl_env.downward_lib.cleanup()
        self._game_file = None


@register_env("alfworld")
class AlfWorldEnv(TextEnv):
    """ALFWorld behind the `TextEnv` interface; see the module docstring for data, splits and text.

    Args:
        source: "auto" (official games if found, else generated), "official" or "generated".
        data_dir: root of the official data (holding `json_2.1.1/`); default `$ALFWORLD_DATA`,
            then `~/.cache/alfworld`.
        seed: seed of the generated games.
        train_games_per_type: generated games per task type in "train".
        eval_games_per_type: generated games per task type in "valid_seen" and in "valid_unseen".
        cache_dir: where generated games are cached; default `$BIPACE_CACHE/alfworld` or
            `~/.cache/bipace_trainer/alfworld`.
        task_types: `tasks()` lists only these types (default: all six); accepted here too so
            that one keyword dict serves `tasks()` and the env.
        memo: derive observations and admissible commands with `_MemoGrammar` and keep PDDL
            translations (`_MemoTranslation`): the same games, 20-60x faster steps, 2x faster
            resets of a new game and ~30x of a replay; False runs TextWorld's own code, for benchmarks.
    """

    instruction = (
        "You are an agent in a household (ALFWorld). Explore the room, pick up, open, clean, heat, "
        "cool, use and place objects with text commands to complete the task."
    )
    invalid_action = "look"
    report_key = "task_type"
    milestone_kind = "plan"

    def __init__(
        self,
        source: str = "auto",
        data_dir: str | None = None,
        seed: int = 0,
        train_games_per_type: int = 12,
        eval_games_per_type: int = 4,
        cache_dir: str | None = None,
        task_types: Sequence[str] | None = None,
        memo: bool = True,
    ):
        _check_settings(source, data_dir, task_types)
        # Only settings here: games are listed (or generated) and the engine built on first use,
        # so an env is cheap to build in every worker of a pool.
        self._data_settings = (source, data_dir, seed, train_games_per_type, eval_games_per_type, cache_dir)
        self._memo = memo
        self._engine: AlfredEngine | None = None
        self._game: _GameEntry | None = None
        self._plan: list[str] | None = None  # rest of the expert's plan, while the agent follows it
        self._milestones: list[str] | None = None  # the expert's plan from the episode's start
        self._started = False  # reset, and no step taken since
        self._admissible: frozenset[str] = frozenset()
        self.expert_failures = 0  # times expert_action() had no command in a game not won (each logged)
        self.done = True

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return (*SPLITS, *_SPLIT_ALIASES)  # "valid" is an alias of "valid_unseen"

    @classmethod
    def tasks(
        cls,
        split: str = "train",
        source: str = "auto",
        data_dir: str | None = None,
        seed: int = 0,
        train_games_per_type: int = 12,
        eval_games_per_type: int = 4,
        cache_dir: str | None = None,
        task_types: Sequence[str] | None = None,
        **_: Any,
    ) -> list[TaskSpec]:
        """The tasks of `split` ("train", "valid_seen", "valid_unseen"; "valid" = "valid_unseen")."""
        _check_settings(source, data_dir, task_types)
        split = _SPLIT_ALIASES.get(split, split)
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not an ALFWorld split; use one of {SPLITS} (or 'valid').")
        settings = (source, data_dir, seed, train_games_per_type, eval_games_per_type, cache_dir)
        _announce(_data_choice(*settings))
        games = _playable_games(settings)
        _report_damaged(str(_data_root(*settings)))
        wanted = set(task_types or TASK_TYPES)
        specs = [
            TaskSpec(task_id, split, dict(game.attributes))
            for task_id, game in enumerate(games)
            if game.split == split and game.attributes["task_type"] in wanted and not game.damage
        ]
        if not specs:
            raise EnvUnavailableError(
                f"No ALFWorld games of types {sorted(wanted)} in split {split!r} under "
                f"{_data_root(*settings) / 'json_2.1.1' / split}."
            )
        return specs

    @classmethod
    def check_available(cls, **env_kwargs: Any) -> None:
        _require_packages()

    def reset(self, task_id: int) -> StepResult:
        games = _playable_games(self._data_settings)
        if not 0 <= task_id < len(games):
            raise ValueError(
                f"AlfWorldEnv task_id={task_id} is out of range; there are {len(games)} games (0..{len(games) - 1})."
            )
        if games[task_id].damage:
            raise ValueError(
                f"AlfWorldEnv task_id={task_id}: game file {games[task_id].path} cannot be read "
                f"({games[task_id].damage}). Re-run `alfworld-download` to restore it, or delete its trial folder."
            )
        if self._engine is None:
            self._engine = AlfredEngine(memo=self._memo)
        self._game = games[task_id]
        observation, infos = self._engine.start(self._game.path)
        observation = observation.removeprefix(_WELCOME).lstrip("\n")
        self.task = observation.rpartition(_TASK_PREFIX)[2].strip()
        self._plan = self._engine.walkthrough() or None
        self._milestones = list(self._plan) if self._plan else None
        self._started = True  # no step yet: a plan computed now starts from the start state
        self.done = False
        return self._result(observation, infos)

    def step(self, action: str) -> StepResult:
        if self._engine is None or self.done:
            return StepResult("The episode is over; call reset().", done=True, anchor="The episode is over.")
        command = normalise_action(action)
        self._started = False
        if self._plan and command == self._plan[0]:
            self._plan = self._plan[1:]
        else:
            self._plan = None  # off the expert's plan: replan when asked
        observation, infos = self._engine.step(command)
        self.done = bool(infos["won"])
        return self._result(observation, infos)

    def expert_action(self) -> str | None:
        """The planner expert's next command; None only when no episode runs, or as a logged, counted failure.

        The plan kept from earlier calls (or the game's walkthrough) is used while its next command
        is admissible; otherwise the expert replans from the current state. When even a fresh plan
        has no admissible next command, the failure is logged with the game and the reason, counted
        in `expert_failures`, and None is returned.
        """
        if self._engine is None or self.done:
            return None
        replanned = False
        if self._plan is None:
            self._plan, replanned = self._expert_plan(), True
        if self._plan and self._plan[0] in self._admissible:
            return self._plan[0]
        if not replanned:  # a walkthrough or kept plan that this state (or this game's grammar) refuses
            self._plan = self._expert_plan()
            if self._plan and self._plan[0] in self._admissible:
                return self._plan[0]
        if self._plan is None:
            reason = "the planner found no plan from this state"
        elif not self._plan:
            reason = "the planner says the goal holds, but the engine does not report the game won"
        else:
            reason = f"the planned command {self._plan[0]!r} is not an admissible command here"
        self._plan = None
        self.expert_failures += 1
        logger.warning(
            "AlfWorldEnv expert failure #%d in %s (%s): %s.",
            self.expert_failures,
            self._game.path,
            self._game.attributes["task_type"],
            reason,
        )
        return None

    def milestones(self) -> list[str] | None:
        """The expert's plan from the episode's start state (module docstring); ask right after a reset."""
        if self._milestones is None and self._engine is not None and self._started:
            self._plan = self._expert_plan()  # the expert starts from it too
            self._milestones = list(self._plan) if self._plan else None
        return self._milestones

    def _expert_plan(self) -> list[str] | None:
        attributes = self._game.attributes
        targets = (attributes["object_target"], attributes["toggle_target"], attributes["mrecep_target"])
        return self._engine.expert_plan([cls for cls in targets if cls])

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self.done = True

    def _result(self, observation: str, infos: dict[str, Any]) -> StepResult:
        won = bool(infos["won"])
        admissible = [c for c in infos["admissible_commands"] if c != "help"]
        self._admissible = frozenset(admissible)
        return StepResult(
            observation=observation,
            reward=1.0 if won else 0.0,
            done=won,
            won=won,
            admissible_actions=admissible,
            anchor=observation,
            info={"task_type": self._game.attributes["task_type"], "game": self._game.attributes["game"]},
        )


def _playable_games(settings: tuple) -> tuple[_GameEntry, ...]:
    """The games for these data settings; a clear error instead of an engine that spins on none."""
    root = _data_root(*settings)
    games = _games(str(root))
    if not games:
        # AlfredTWEnv reports 0 games and its reset then loops forever; fail here instead.
        raise EnvUnavailableError(
            f"No playable ALFWorld games under {root / 'json_2.1.1'} (expected "
            "<split>/<task>/<trial>/game.tw-pddl next to traj_data.json, marked solvable). Re-run "
            "`alfworld-download`, or use source='generated' for offline games."
        )
    return games
