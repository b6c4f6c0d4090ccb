"""Offline ALFWorld games, generated from the material that ships inside the alfworld wheel.

`alfworld-download` needs GitHub, so without it there are no ALFWorld games. This module
writes games in the official layout instead,

    <root>/json_2.1.1/{train,valid_seen,valid_unseen}/<task>-<Object>-None-<Recep>-<scene>/<trial>/
        game.tw-pddl      {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        traj_data.json    {"task_type", "pddl_params", "scene", ...}

and `AlfWorldEnv` plays them exactly like downloaded ones: the same PDDL domain
(`alfworld/data/alfred.pddl`), the same text grammar (`alfred.twl2`, with the task sentence
filled in from `gen/goal_library.py`'s templates as `add_task_to_grammar` does), the same
engine and wrappers. Only the PDDL problem is ours, written the way ALFRED's
`PlannedGameState.state_to_pddl` writes one:

* the room is an AI2-THOR floor plan: receptacle instances and the poses to use them from
  come from `gen/layouts/FloorPlan<N>-openable.json`, the object classes present from
  `-objects.json`, reachable floor positions from `-layout.npy`. Names are mangled ALFRED ids
  (`Cabinet|+00.68|+00.50|-02.20` -> `Cabinet_bar__plus_00_dot_68_...`), which the engine's
  demangler numbers ("cabinet 3") as it does for real games;
* objects sit in receptacles that can hold them (`constants.VAL_RECEPTACLE_OBJECTS`, also
  emitted as `canContain` facts); openable receptacles are `constants.OPENABLE_CLASS_LIST`;
  cleanable/heatable/coolable/sliceable objects follow `constants.VAL_ACTION_OBJECTS`;
* the goal is `goal_library.gdict[task_type]["pddl"]`, only in room types
  `constants.GOALS_VALID` allows, with targets chosen under ALFWorld's
  `TaskGameState.get_filter_crit` filters (a heat task's object is heatable and no instance
  starts in the microwave; no target instance starts in a receptacle of the target type).

Differences from the official games, on purpose:
* fewer objects: the 1-3 target instances plus 3-6 other object classes of the room (one
  instance each, sometimes two), where a real room shows every object it has. The planner
  expert is a blind uniform-cost search whose time grows exponentially with the number of
  movable objects (about 2 s per plan in a kitchen with 10 distractors), and every object
  also adds to reset and step time;
* light sources are desk lamps only (on a desk, side table or dresser): the
  look_at_obj_in_light goal needs the lamp `inReceptacle`, which a floor lamp never is here;
* receptacle classes a floor plan lists without a pose (stove burners, coffee machines,
  toasters, most garbage cans and towel holders) get made-up positions (four stove burners,
  one of anything else);
* no sliced objects, movable-receptacle or human-annotated goals (ALFWorld's text games
  exclude the first two as well).

Every game is checked with the planner the engine's expert uses (TextWorld's fast-downward,
the uniform-cost search behind `AlfredExpert(expert_type="planner")`) and dropped if it finds
no plan; the plan is stored as the game's walkthrough. The planner runs on the game's core
(`_Game.core`: the target objects and lamp, the receptacles holding them and those of the
target and appliance types), which takes a fraction of the search time: no action of the
domain has a precondition that another object or receptacle can falsify (receptacles have no
capacity), so a plan for the core is a plan for the whole game, and an optimal one, since
every "go to" costs the same.

Splits ("held out" means):
* train: floor plans in `constants.TRAIN_SCENE_NUMBERS` (24 per room type);
* valid_seen: the same floor plans, new games whose (floor plan, task type, object, receptacle,
  lamp) never occurs in train (in-distribution evaluation);
* valid_unseen: the floor plans in `constants.TEST_SCENE_NUMBERS` (6 per room type), which no
  train game uses (out-of-distribution evaluation).

Generation is a deterministic function of (`GENERATOR_VERSION`, seed, sizes) and is cached
under `$BIPACE_CACHE/alfworld` (default `~/.cache/bipace_trainer/alfworld`) in a directory named
after them. It is written into a temporary directory that is renamed into place when complete,
under a file lock, so concurrent workers generate once and a killed run leaves no partial set.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "GENERATOR_VERSION",
    "SPLITS",
    "TASK_TYPES",
    "default_cache_dir",
    "generate_games",
    "generated_data_dir",
]

# Bump whenever a change alters the generated games: it is part of the cache key.
GENERATOR_VERSION = 1

# ALFWorld's task types, in the order of their ids 1..6 (alfred_tw_env.TASK_TYPES).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS = ("train", "valid_seen", "valid_unseen")

# The appliance a state-change task uses and the object property it needs (the
# CleanObject/HeatObject/CoolObject preconditions of alfred.pddl).
_STATE_CHANGE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
_LAMP = "DeskLamp"
_LAMP_RECEPTACLES = ("Desk", "SideTable", "Dresser")
_MISSING_INSTANCES = {"StoveBurner": 4}
_DISTRACTOR_CLASSES = (3, 6)  # inclusive range of non-target object classes per game
_MAX_INSTANCES = 3  # constants.MAX_NUM_OF_OBJ_INSTANCES
_GRID = 0.25  # constants.AGENT_STEP_SIZE: `loc|x|z|rotation|horizon` counts in grid steps
_MAX_ATTEMPTS = 5000  # draws per (split, task type) before giving up


def default_cache_dir() -> Path:
    """`$BIPACE_CACHE/alfworld`, or `~/.cache/bipace_trainer/alfworld`."""
    root = os.environ.get("BIPACE_CACHE")
    return Path(root) / "alfworld" if root else Path.home() / ".cache" / "bipace_trainer" / "alfworld"


# TextWorld's PDDL engine and fast-downward keep process-global state: the text grammar's tatsu
# parsers, the translator's module-level options, `sys.argv` (which `pddl2sas` rebinds) and the
# task a library copy holds. Every call into them takes this lock, so envs stepped in threads
# cannot corrupt each other; the engine is pure Python, so they would take turns on the GIL anyway.
_ENGINE_LOCK = threading.RLock()


@contextlib.contextmanager
def engine_guard() -> Iterator[None]:
    """Hold the process-wide engine lock, and restore `sys.argv` afterwards (`pddl2sas` rebinds it)."""
    with _ENGINE_LOCK:
        original = sys.argv
        try:
            yield
        finally:
            sys.argv = original


# --------------------------------------------------------------------------- floor plans


@dataclass(frozen=True)
class _Receptacle:
    alfred_id: str  # e.g. "Sink|-01.90|+00.97|-01.50|SinkBasin"
    cls: str  # e.g. "SinkBasin"
    location: str  # e.g. "loc|-8|-6|2|30"


@dataclass(frozen=True)
class _FloorPlan:
    scene_num: int
    room_type: str
    object_classes: frozenset[str]
    receptacles: tuple[_Receptacle, ...]
    floor_points: tuple[tuple[float, float], ...]  # reachable (x, z) positions


def _constants():
    from alfworld.gen import constants

    return constants


def _location(x: float, z: float, rotation_degrees: float, horizon: float) -> str:
    return f"loc|{round(x / _GRID)}|{round(z / _GRID)}|{round(rotation_degrees / 90) % 4}|{round(horizon)}"


def _coord(value: float) -> str:
    return f"{value:+06.2f}"  # ALFRED's id format: "+00.95", "-02.10"


def _receptacle_id(cls: str, x: float, y: float, z: float) -> str:
    # Basins are named after their sink or bathtub ("Sink|x|y|z|SinkBasin"); the demangler
    # relies on that to print "sinkbasin 1".
    coords = f"{_coord(x)}|{_coord(y)}|{_coord(z)}"
    return f"{cls[: -len('Basin')]}|{coords}|{cls}" if cls.endswith("Basin") else f"{cls}|{coords}"


@functools.cache
def _floor_plans() -> dict[int, _FloorPlan]:
    """Every floor plan of `alfworld/gen/layouts`, keyed by scene number."""
    import alfworld.gen
    import numpy as np

    constants = _constants()
    static_receptacles = set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES)
    layouts = Path(alfworld.gen.__file__).parent / "layouts"
    plans = {}
    for objects_file in sorted(layouts.glob("FloorPlan*-objects.json")):
        scene_name = objects_file.name[: -len("-objects.json")]
        scene_num = int(scene_name[len("FloorPlan") :])
        object_classes = frozenset(json.loads(objects_file.read_text()))
        poses = json.loads((layouts / f"{scene_name}-openable.json").read_text())
        floor_points = tuple(map(tuple, np.load(layouts / f"{scene_name}-layout.npy").tolist()))

        receptacles = []
        for alfred_id, (x, z, rotation, horizon) in sorted(poses.items()):
            parts = alfred_id.split("|")
            cls = parts[-1] if len(parts) == 5 else parts[0]  # "Sink|x|y|z|SinkBasin" is a SinkBasin
            if cls in static_receptacles:
                receptacles.append(_Receptacle(alfred_id, cls, _location(x, z, rotation, horizon)))
        # Made-up positions are part of the room, so they depend on the floor plan only.
        room_rng = random.Random(f"floor-plan:{scene_num}")
        listed = {r.cls for r in receptacles}
        for cls in sorted((object_classes & static_receptacles) - listed):
            for _ in range(_MISSING_INSTANCES.get(cls, 1)):
                x, z = room_rng.choice(floor_points)
                alfred_id = _receptacle_id(cls, x, room_rng.uniform(0.0, 1.0), z)
                receptacles.append(_Receptacle(alfred_id, cls, _location(x, z, 90 * room_rng.randrange(4), 30)))
        room_type = next(room for room, scenes in constants.SCENE_TYPE.items() if scene_num in scenes)
        plans[scene_num] = _FloorPlan(scene_num, room_type, object_classes, tuple(receptacles), floor_points)
    return plans


def _split_floor_plans(split: str) -> list[_FloorPlan]:
    constants = _constants()
    scenes = constants.TEST_SCENE_NUMBERS if split == "valid_unseen" else constants.TRAIN_SCENE_NUMBERS
    plans = _floor_plans()
    return [plans[s] for s in sorted(scenes) if s in plans]


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class _Task:
    task_type: str
    object_target: str
    parent_target: str  # "" for look_at_obj_in_light
    toggle_target: str  # "" unless look_at_obj_in_light


@dataclass(frozen=True)
class _Object:
    alfred_id: str
    cls: str
    receptacle: _Receptacle


@dataclass(frozen=True)
class _Game:
    plan: _FloorPlan
    task: _Task
    agent_location: str
    objects: tuple[_Object, ...]

    @property
    def signature(self) -> tuple:
        """What valid_seen must not share with train."""
        task = self.task
        return (self.plan.scene_num, task.task_type, task.object_target, task.parent_target, task.toggle_target)

    def core(self) -> _Game:
        """The game cut down to what its goal is about, for the planner (see the module docstring).

        Keeps the target objects and the lamp, the receptacles holding them, and every receptacle
        of the target type and of the appliance type.
        """
        task = self.task
        objects = tuple(o for o in self.objects if o.cls in (task.object_target, task.toggle_target))
        holding = {o.receptacle for o in objects}
        needed = {task.parent_target, _STATE_CHANGE.get(task.task_type, ("",))[0]}
        receptacles = tuple(r for r in self.plan.receptacles if r in holding or r.cls in needed)
        return replace(self, plan=replace(self.plan, receptacles=receptacles), objects=objects)


def _holders(plan: _FloorPlan) -> dict[str, list[_Receptacle]]:
    """Object class -> receptacles of the room that can hold it, for every placeable class."""
    constants = _constants()
    static_receptacles = set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES)
    holders = {}
    for cls in sorted(plan.object_classes - static_receptacles):
        fits = [r for r in plan.receptacles if cls in constants.VAL_RECEPTACLE_OBJECTS.get(r.cls, ())]
        if fits:
            holders[cls] = fits
    return holders


def _lamp_holders(plan: _FloorPlan) -> list[_Receptacle]:
    if _LAMP not in plan.object_classes:
        return []
    return [r for r in plan.receptacles if r.cls in _LAMP_RECEPTACLES]


def _candidate_tasks(task_type: str, plan: _FloorPlan) -> list[_Task]:
    """Every valid (object, receptacle, lamp) choice of `task_type` in `plan`."""
    constants = _constants()
    if plan.room_type not in constants.GOALS_VALID[task_type]:
        return []
    holders = _holders(plan)
    if task_type == "look_at_obj_in_light":
        return [_Task(task_type, obj, "", _LAMP) for obj in holders] if _lamp_holders(plan) else []

    appliance, needed = _STATE_CHANGE.get(task_type, (None, None))
    if appliance is not None and all(r.cls != appliance for r in plan.receptacles):
        return []
    tasks = []
    for obj, fits in holders.items():
        if needed is not None and obj not in constants.VAL_ACTION_OBJECTS[needed]:
            continue
        for parent in sorted({r.cls for r in fits} - {appliance}):
            # The targets must be able to start outside the target type and the appliance.
            if any(r.cls not in (parent, appliance) for r in fits):
                tasks.append(_Task(task_type, obj, parent, ""))
    return tasks


def _sample_game(rng: random.Random, task_type: str, plans: Sequence[_FloorPlan]) -> _Game | None:
    """A random game of `task_type` in one of `plans`, or None when the drawn room has no valid task."""
    plan = rng.choice(plans)
    candidates = _candidate_tasks(task_type, plan)
    if not candidates:
        return None
    task = rng.choice(candidates)
    appliance = _STATE_CHANGE.get(task_type, (None,))[0]
    holders = _holders(plan)
    taken_ids: set[str] = set()
    objects = []

    target_fits = [r for r in holders[task.object_target] if r.cls not in (task.parent_target, appliance)]
    for _ in range(rng.randint(2 if task_type == "pick_two_obj_and_place" else 1, _MAX_INSTANCES)):
        objects.append(_place(rng, task.object_target, rng.choice(target_fits), taken_ids))
    others = sorted(set(holders) - {task.object_target})
    for cls in rng.sample(others, min(len(others), rng.randint(*_DISTRACTOR_CLASSES))):
        for _ in range(rng.choices((1, 2), weights=(4, 1))[0]):
            objects.append(_place(rng, cls, rng.choice(holders[cls]), taken_ids))
    lamp_holders = _lamp_holders(plan)
    if lamp_holders:  # a desk lamp is furniture: present whenever the room has one
        objects.append(_place(rng, _LAMP, rng.choice(lamp_holders), taken_ids))

    # The agent starts "in the middle of a room", at a position no receptacle is used from.
    receptacle_locations = {r.location for r in plan.receptacles}
    while True:
        x, z = rng.choice(plan.floor_points)
        agent_location = _location(x, z, 90 * rng.randrange(4), 30)
        if agent_location not in receptacle_locations:
            return _Game(plan, task, agent_location, tuple(objects))


def _place(rng: random.Random, cls: str, receptacle: _Receptacle, taken_ids: set[str]) -> _Object:
    """An object of class `cls` in `receptacle`, with an unused ALFRED-style id near it."""
    x, y, z = (float(v) for v in receptacle.alfred_id.split("|")[1:4])
    while True:
        alfred_id = "|".join([cls] + [_coord(v + rng.uniform(-0.3, 0.3)) for v in (x, y, z)])
        if alfred_id not in taken_ids:
            taken_ids.add(alfred_id)
            return _Object(alfred_id, cls, receptacle)


# --------------------------------------------------------------------------- PDDL and game files


def _pddl_name(alfred_id: str) -> str:
    """ALFRED's id mangling (`PlannedGameState.fix_pddl_str_chars`), which the demangler undoes."""
    for char, word in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        alfred_id = alfred_id.replace(char, word)
    return alfred_id


def _problem_pddl(game: _Game, problem_name: str) -> str:
    """The PDDL problem of `game` for ALFWorld's `alfred` domain."""
    from alfworld.gen import goal_library

    constants = _constants()
    receptacle_types = sorted(set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES))
    object_types = sorted(set(constants.OBJECTS_SET) - set(receptacle_types))
    receptacles = game.plan.receptacles
    locations = sorted({r.location for r in receptacles} | {game.agent_location})

    declarations = ["agent1 - agent"]
    declarations += [f"{t}Type - otype" for t in object_types]
    declarations += [f"{t}Type - rtype" for t in receptacle_types]
    declarations += [f"{_pddl_name(o.alfred_id)} - object" for o in game.objects]
    declarations += [f"{_pddl_name(r.alfred_id)} - receptacle" for r in receptacles]
    declarations += [f"{_pddl_name(loc)} - location" for loc in locations]

    init = [f"(atLocation agent1 {_pddl_name(game.agent_location)})"]
    init += [
        f"(canContain {r}Type {o}Type)"
        for r in sorted({r.cls for r in receptacles})
        for o in sorted({o.cls for o in game.objects})
        if o in constants.VAL_RECEPTACLE_OBJECTS.get(r, ())
    ]
    for r in receptacles:
        name = _pddl_name(r.alfred_id)
        init.append(f"(receptacleType {name} {r.cls}Type)")
        init.append(f"(receptacleAtLocation {name} {_pddl_name(r.location)})")
        if r.cls in constants.OPENABLE_CLASS_SET:
            init.append(f"(openable {name})")
    properties = {"cleanable": "Cleanable", "heatable": "Heatable", "coolable": "Coolable", "sliceable": "Sliceable"}
    for o in game.objects:
        name = _pddl_name(o.alfred_id)
        init.append(f"(objectType {name} {o.cls}Type)")
        init.append(f"(inReceptacle {name} {_pddl_name(o.receptacle.alfred_id)})")
        init.append(f"(objectAtLocation {name} {_pddl_name(o.receptacle.location)})")
        init.append(f"(toggleable {name})" if o.cls == _LAMP else f"(pickupable {name})")
        if o.cls in constants.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {name})")
        init += [f"({p} {name})" for p, key in properties.items() if o.cls in constants.VAL_ACTION_OBJECTS[key]]

    task = game.task
    goal = goal_library.gdict[task.task_type]["pddl"].format(
        obj=task.object_target, recep=task.parent_target, toggle=task.toggle_target, mrecep=""
    )
    # ALFRED mangles every "-" of its PDDL text (names hold them) and then turns "#" into "-", so
    # the library writes "?r # receptacle"; goals hold no names, so only the last step applies.
    # The template also closes the "(define" opened here.
    goal = goal.replace("#", "-")
    indent = "\n        "
    return (
        f"(define (problem {problem_name})\n"
        f"    (:domain alfred)\n"
        f"    (:objects{indent}{indent.join(declarations)}\n    )\n"
        f"    (:init{indent}{indent.join(init)}\n    )\n"
        f"{goal}"
    )


def _traj_data(game: _Game, seed: int) -> dict:
    """The fields of ALFRED's traj_data.json that ALFWorld reads, and where the game came from."""
    task = game.task
    return {
        "task_type": task.task_type,
        "pddl_params": {
            "object_target": task.object_target,
            "parent_target": task.parent_target,
            "toggle_target": task.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"floor_plan": f"FloorPlan{game.plan.scene_num}", "scene_num": game.plan.scene_num},
        "generator": {"name": "bipace_trainer", "version": GENERATOR_VERSION, "seed": seed},
    }


def _task_sentence(rng: random.Random, traj_data: dict) -> str:
    """`alfworld.agents.utils.misc.get_templated_task_desc`, drawing from `rng`, not the global RNG."""
    from alfworld.gen import goal_library

    params = traj_data["pddl_params"]
    template = rng.choice(goal_library.gdict[traj_data["task_type"]]["templates"])
    return template.format(
        obj=params["object_target"].lower(),
        recep=params["parent_target"].lower(),
        toggle=params["toggle_target"].lower(),
        mrecep=params["mrecep_target"].lower(),
    )


def _game_dir_name(game: _Game) -> str:
    """The official naming: <task>-<Object>-<MovableRecep>-<Receptacle or Lamp>-<scene>."""
    task = game.task
    last = task.toggle_target or task.parent_target
    return f"{task.task_type}-{task.object_target}-None-{last}-{game.plan.scene_num}"


def _write_game(game_dir: Path, game: _Game, walkthrough: list[str], seed: int, rng: random.Random) -> None:
    """Write `game.tw-pddl` and `traj_data.json` into `game_dir`."""
    import alfworld.info

    traj_data = _traj_data(game, seed)
    grammar = Path(alfworld.info.ALFRED_TWL2_PATH).read_text()
    game_data = {
        "pddl_domain": Path(alfworld.info.ALFRED_PDDL_PATH).read_text(),
        "grammar": grammar.replace("UNKNOWN GOAL", _task_sentence(rng, traj_data)),
        "pddl_problem": _problem_pddl(game, game_dir.name),
        "solvable": True,
        # TextWorld's PddlEnv serves this as the walkthrough; AlfWorldEnv's expert follows it.
        "walkthrough": walkthrough,
    }
    game_dir.mkdir(parents=True)
    (game_dir / "traj_data.json").write_text(json.dumps(traj_data, indent=2))
    (game_dir / "game.tw-pddl").write_text(json.dumps(game_data))


@functools.cache
def _planner():
    """TextWorld's fast-downward library (one copy per process, kept loaded), ALFWorld's domain,
    and the command template of each domain action (from ALFWorld's grammar)."""
    import alfworld.info
    import fast_downward
    from textworld.envs.pddl.logic import GameLogic

    domain = Path(alfworld.info.ALFRED_PDDL_PATH).read_text()
    logic = GameLogic(domain=domain, grammar=Path(alfworld.info.ALFRED_TWL2_PATH).read_text())
    templates = {name: action.template for name, action in logic.actions.items()}
    return fast_downward.load_lib(), domain, templates


def _display_names(game: _Game) -> dict[str, str]:
    """PDDL name -> what the engine prints ("cabinet 3"), numbered by ALFWorld's demangler.

    The engine names every entity of the problem's facts (lower-cased by fast-downward) with
    `AlfredDemangler`; this builds the same entity set and asks the same `Demangler`.
    """
    from alfworld.agents.utils.misc import Demangler
    from textworld.generator.game import EntityInfo

    ids = [o.alfred_id for o in game.objects] + [r.alfred_id for r in game.plan.receptacles]
    ids += [r.location for r in game.plan.receptacles] + [game.agent_location, "agent1"]
    ids += [f"{cls}Type" for cls in _constants().OBJECTS_SET]  # arguments of PutObject
    infos = {name: EntityInfo(name, "") for name in {_pddl_name(i).lower() for i in ids}}
    demangler = Demangler(game_infos=infos)
    return {name: demangler.demangle_alfred_name(name) for name in infos}


def _solve(problem: str, domain: str):
    """(fast-downward's translated task, the plan's operator names or None when it finds no plan)."""
    import fast_downward

    with engine_guard():
        lib = _planner()[0]
        task, sas = fast_downward.pddl2sas(domain, problem, optimize=True)
        if not lib.solve_sas(sas.encode("utf-8"), False):
            return task, None
        operators = (fast_downward.Operator * lib.get_last_plan_length())()
        lib.get_last_plan(operators)
    return task, [operator.name for operator in operators]


def plan_operators(problem: str, domain: str) -> list[str] | None:
    """The planner expert's plan for `problem` in `domain`, as operator names ("gotolocation agent1 ...").

    None if it finds no plan; [] if the goal already holds. The search is the uniform-cost
    search `PddlState.replan` runs for `AlfredExpert(expert_type="planner")`, on the same
    translation (`optimize=True`), with this process's own copy of the library.
    """
    return _solve(problem, domain)[1]


def plan_commands(problem: str, names: Mapping[str, str]) -> list[str]:
    """The planner expert's plan for `problem` in the wheel's domain, as commands of the wheel's grammar.

    [] if it finds none or the goal holds. Operators become commands as in
    `PddlState.plan_to_templated_actions`, naming entities with `names` (PDDL name -> "cabinet 3").
    """
    _, domain, templates = _planner()
    task, plan = _solve(problem, domain)
    parameters = {a.name: [p.name.lstrip("?") for p in a.parameters] for a in task.actions}
    commands = []
    for operator in plan or []:
        action, *arguments = operator.split()
        # TextWorld's replan special-cases go-to: its grammar template lists receptacles by location.
        template = "go to {r}" if action == "gotolocation" else templates[action]
        commands.append(template.format(**{p: names[a] for p, a in zip(parameters[action], arguments)}))
    return commands


# --------------------------------------------------------------------------- generation


def _draws(
    seed: int, split: str, task_type: str, excluded_signatures: set
) -> Iterator[tuple[str, _Game, random.Random]]:
    """(trial name, game, its RNG) for every feasible draw of `task_type` in `split`, in order."""
    plans = _split_floor_plans(split)
    for attempt in range(_MAX_ATTEMPTS):
        # One RNG per attempt, so a game does not depend on how many draws came before it.
        rng = random.Random(f"{GENERATOR_VERSION}:{seed}:{split}:{task_type}:{attempt}")
        game = _sample_game(rng, task_type, plans)
        if game is not None and game.signature not in excluded_signatures:
            yield f"trial_s{seed}_{attempt:05d}", game, rng


def generate_games(
    root: str | os.PathLike, *, seed: int = 0, train_games_per_type: int = 12, eval_games_per_type: int = 4
) -> dict[str, int]:
    """Write solvable games into `root/json_2.1.1/<split>/` (the official layout), without caching.

    Args:
        root: directory to write into (created if missing).
        seed: the games are a deterministic function of (GENERATOR_VERSION, seed, sizes).
        train_games_per_type: games per task type in "train".
        eval_games_per_type: games per task type in each of "valid_seen" and "valid_unseen".

    Returns:
        The number of games written per split.
    """
    if train_games_per_type < 1 or eval_games_per_type < 1:
        raise ValueError(
            f"train_games_per_type={train_games_per_type}, eval_games_per_type={eval_games_per_type}: "
            "every split needs at least one game per task type; set both >= 1."
        )
    sizes = {"train": train_games_per_type, "valid_seen": eval_games_per_type, "valid_unseen": eval_games_per_type}
    train_signatures: set[tuple] = set()
    counts = {split: 0 for split in SPLITS}
    for split in SPLITS:
        split_dir = Path(root) / "json_2.1.1" / split
        split_dir.mkdir(parents=True, exist_ok=True)
        excluded = train_signatures if split == "valid_seen" else set()
        for task_type in TASK_TYPES:
            written = 0
            for trial, game, rng in _draws(seed, split, task_type, excluded):
                walkthrough = plan_commands(_problem_pddl(game.core(), trial), _display_names(game))
                if not walkthrough:  # no plan, or the goal already holds
                    continue
                _write_game(split_dir / _game_dir_name(game) / trial, game, walkthrough, seed, rng)
                if split == "train":
                    train_signatures.add(game.signature)
                written += 1
                if written == sizes[split]:
                    break
            else:
                raise RuntimeError(
                    f"Only {written} of {sizes[split]} {task_type} games could be generated for "
                    f"split={split!r} in {_MAX_ATTEMPTS} draws; ask for fewer games per type."
                )
            counts[split] += written
    return counts


def generated_data_dir(
    *,
    seed: int = 0,
    train_games_per_type: int = 12,
    eval_games_per_type: int = 4,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The root (holding `json_2.1.1/`) of a generated game set, generating it on first use.

    The set lives in `cache_dir` (default `default_cache_dir()`) in a directory named after the
    generator version, seed and sizes, and is complete iff it holds `manifest.json`.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = f"v{GENERATOR_VERSION}-seed{seed}-train{train_games_per_type}-eval{eval_games_per_type}"
    final = cache / key
    if (final / "manifest.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if we are killed
        if (final / "manifest.json").is_file():  # another process generated it while we waited
            return final
        for stale in cache.glob(f".{key}.*"):  # staging left by a killed run (we hold the lock)
            if stale.is_dir():
                shutil.rmtree(stale)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
        try:
            start = time.perf_counter()
            counts = generate_games(
                staging,
                seed=seed,
                train_games_per_type=train_games_per_type,
                eval_games_per_type=eval_games_per_type,
            )
            manifest = {
                "generator_version": GENERATOR_VERSION,
                "seed": seed,
                "train_games_per_type": train_games_per_type,
                "eval_games_per_type": eval_games_per_type,
                "games": counts,
                "seconds": round(time.perf_counter() - start, 1),
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
            if final.exists():  # an incomplete copy (no manifest) left by hand: replace it
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final
