"""ALFWorld on its real engine: offline generation, the official layout, text, commands and the expert.

Generated games are made once per session in a temporary cache (2 train games per task type, 1
per type in each evaluation split) and shared by every test here.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="ALFWorld is optional: pip install alfworld")
pytest.importorskip("textworld", reason="ALFWorld is optional: pip install alfworld")
pytest.importorskip("fast_downward", reason="ALFWorld is optional: pip install alfworld")

import alfworld.info  # noqa: E402
from alfworld.gen import constants, goal_library  # noqa: E402

from envs import EnvUnavailableError, alfworld_gen, make_env  # noqa: E402
from envs.alfworld import AlfWorldEnv  # noqa: E402
from envs.alfworld_gen import SPLITS, TASK_TYPES, generate_games, generated_data_dir  # noqa: E402

SIZES = {"train_games_per_type": 2, "eval_games_per_type": 1}


@pytest.fixture(scope="session")
def alfworld_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("alfworld_cache")


@pytest.fixture(scope="session")
def generated(alfworld_cache) -> dict:
    """Keyword arguments of an env on the session's generated games, and the games' root."""
    root = generated_data_dir(seed=0, cache_dir=alfworld_cache, **SIZES)
    return {"root": root, "kwargs": {"source": "generated", "cache_dir": str(alfworld_cache), "seed": 0, **SIZES}}


@pytest.fixture(scope="module")
def env(generated):
    instance = AlfWorldEnv(**generated["kwargs"])
    yield instance
    instance.close()


def _first(specs, task_type):
    return next(spec for spec in specs if spec.attributes["task_type"] == task_type)


def _play_expert(env, task_id, max_steps=50):
    result = env.reset(task_id)
    steps = 0
    while not result.done and steps < max_steps:
        action = env.expert_action()
        assert action in result.admissible_actions
        result = env.step(action)
        steps += 1
    return result


# --------------------------------------------------------------------------- settings, no games needed


def test_construction_is_cheap_picklable_and_registered(tmp_path):
    env = make_env("alfworld", source="generated", cache_dir=str(tmp_path))
    assert isinstance(env, AlfWorldEnv)
    assert list(tmp_path.iterdir()) == []  # nothing generated or loaded before the first reset
    assert isinstance(pickle.loads(pickle.dumps(env)), AlfWorldEnv)
    assert AlfWorldEnv.report_key == "task_type"
    assert AlfWorldEnv.splits() == ("train", "valid_seen", "valid_unseen", "valid")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "download"}, "source='download'"),
        ({"task_types": ["pick_and_place", "look_at_obj_in_light"]}, "pick_and_place"),
        ({"source": "generated", "data_dir": "/data"}, "source='generated'"),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlfWorldEnv(**kwargs)


def test_empty_data_dir_fails_fast_instead_of_spinning(tmp_path):
    for split in SPLITS:
        (tmp_path / "json_2.1.1" / split).mkdir(parents=True)
    start = time.perf_counter()
    with pytest.raises(EnvUnavailableError, match="No playable ALFWorld games"):
        AlfWorldEnv.tasks("train", data_dir=str(tmp_path))
    with pytest.raises(EnvUnavailableError, match="No playable ALFWorld games"):
        AlfWorldEnv(data_dir=str(tmp_path)).reset(0)
    assert time.perf_counter() - start < 60.0  # the unguarded engine spins forever here


def test_missing_official_data_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(EnvUnavailableError, match="alfworld-download"):
        AlfWorldEnv.tasks("train", data_dir=str(tmp_path / "nowhere"))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(EnvUnavailableError, match="source='generated'"):
        AlfWorldEnv.tasks("train", source="official")


# --------------------------------------------------------------------------- generation


@pytest.mark.slow
def test_generation_covers_every_task_type_with_disjoint_splits(generated):
    specs = {split: AlfWorldEnv.tasks(split, **generated["kwargs"]) for split in SPLITS}
    for split, per_type in (("train", 2), ("valid_seen", 1), ("valid_unseen", 1)):
        types = [spec.attributes["task_type"] for spec in specs[split]]
        assert sorted(types) == sorted(TASK_TYPES * per_type)
        assert all(spec.split == split for spec in specs[split])
    ids = [spec.task_id for split in SPLITS for spec in specs[split]]
    assert sorted(ids) == list(range(len(ids)))

    scenes = {split: {spec.attributes["scene"] for spec in specs[split]} for split in SPLITS}
    assert scenes["train"] | scenes["valid_seen"] <= set(constants.TRAIN_SCENE_NUMBERS)
    assert scenes["valid_unseen"] <= set(constants.TEST_SCENE_NUMBERS)  # rooms no train game uses

    def signature(spec):
        a = spec.attributes
        return (a["scene"], a["task_type"], a["object_target"], a["parent_target"], a["toggle_target"])

    assert not {signature(s) for s in specs["valid_seen"]} & {signature(s) for s in specs["train"]}
    assert AlfWorldEnv.tasks("valid", **generated["kwargs"]) == specs["valid_unseen"]
    looks = AlfWorldEnv.tasks("train", task_types=["look_at_obj_in_light"], **generated["kwargs"])
    assert {s.attributes["task_type"] for s in looks} == {"look_at_obj_in_light"} and len(looks) == 2


@pytest.mark.slow
def test_generated_games_are_official_alfworld_games(generated):
    """ALFWorld's own loader accepts them, and their goals and text come from ALFWorld's files."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": str(generated["root"] / "json_2.1.1" / "train"), "num_train_games": -1},
    }
    assert len(AlfredTWEnv(config, train_eval="train").game_files) == len(TASK_TYPES) * 2

    domain = Path(alfworld.info.ALFRED_PDDL_PATH).read_text()
    grammar = Path(alfworld.info.ALFRED_TWL2_PATH).read_text()
    for game_file in sorted(generated["root"].glob("json_2.1.1/*/*/*/game.tw-pddl")):
        game = json.loads(game_file.read_text())
        traj_data = json.loads((game_file.parent / "traj_data.json").read_text())
        params = traj_data["pddl_params"]
        assert game["solvable"] and game["walkthrough"] and game["pddl_domain"] == domain
        sentence = game["grammar"].split("Your task is to: ")[1].split(".")[0]
        assert game["grammar"] == grammar.replace("UNKNOWN GOAL", sentence)
        templates = goal_library.gdict[traj_data["task_type"]]["templates"]
        obj, recep, toggle = (params[k].lower() for k in ("object_target", "parent_target", "toggle_target"))
        assert sentence in {t.format(obj=obj, recep=recep, toggle=toggle, mrecep="") for t in templates}


@pytest.mark.slow
def test_generation_is_cached_deterministic_and_atomic(generated, alfworld_cache, tmp_path, monkeypatch):
    manifest = json.loads((generated["root"] / "manifest.json").read_text())
    assert manifest["games"] == {"train": 12, "valid_seen": 6, "valid_unseen": 6}

    # Cached: a second call finds the set and does not generate.
    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of using the cache")

    with monkeypatch.context() as patch:
        patch.setattr(alfworld_gen, "generate_games", no_generation)
        assert generated_data_dir(seed=0, cache_dir=alfworld_cache, **SIZES) == generated["root"]

    # Deterministic: the same seed and sizes give byte-identical games.
    generate_games(tmp_path / "again", seed=0, **SIZES)
    files = sorted(p.relative_to(generated["root"]) for p in generated["root"].rglob("*") if p.is_file())
    files.remove(Path("manifest.json"))
    assert files == sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file())
    for relative in files:
        assert (generated["root"] / relative).read_bytes() == (tmp_path / "again" / relative).read_bytes()

    # Atomic: an interrupted generation leaves nothing that looks complete, and the staging
    # directory a killed one leaves behind is removed by the next generation.
    cache = tmp_path / "cache"

    def interrupted(root, **kwargs):
        (Path(root) / "json_2.1.1" / "train").mkdir(parents=True)
        raise KeyboardInterrupt

    key = f"v{alfworld_gen.GENERATOR_VERSION}-seed7-train2-eval1"
    with monkeypatch.context() as patch:
        patch.setattr(alfworld_gen, "generate_games", interrupted)
        with pytest.raises(KeyboardInterrupt):
            generated_data_dir(seed=7, cache_dir=cache, **SIZES)
    assert [p.name for p in cache.iterdir()] == [f".{key}.lock"]
    (cache / f".{key}.killed").mkdir()  # what SIGKILL during generation leaves

    def tiny(root, **kwargs):
        (Path(root) / "json_2.1.1").mkdir()
        return {}

    with monkeypatch.context() as patch:
        patch.setattr(alfworld_gen, "generate_games", tiny)
        root = generated_data_dir(seed=7, cache_dir=cache, **SIZES)
    assert sorted(p.name for p in cache.iterdir()) == [f".{key}.lock", key]
    assert (root / "manifest.json").is_file()


# --------------------------------------------------------------------------- playing


@pytest.mark.slow
def test_reset_and_step_give_alfworld_text_and_commands(env, generated):
    spec = _first(AlfWorldEnv.tasks("train", **generated["kwargs"]), "look_at_obj_in_light")
    argv = sys.argv
    first = env.reset(spec.task_id)
    assert sys.argv is argv  # fast-downward rebinds sys.argv while translating

    assert first.observation.startswith("You are in the middle of a room. Looking quickly around you, you see a ")
    assert "Welcome to TextWorld" not in first.observation
    assert first.observation.endswith(f"Your task is to: {env.task}")
    assert env.task.endswith(".") and "desklamp" in env.task
    assert first.anchor == first.observation
    assert (first.reward, first.done, first.won) == (0.0, False, False)
    assert first.info["task_type"] == "look_at_obj_in_light"
    commands = first.admissible_actions
    assert {"look", "inventory"} <= set(commands) and "help" not in commands
    go_to = [c for c in commands if c.startswith("go to ")]
    assert go_to and all(c[len("go to ") :] in first.observation for c in go_to)

    target = go_to[0][len("go to ") :]
    arrived = env.step(go_to[0].upper() + "  ")  # case and spacing are normalised
    assert arrived.observation.startswith(f"You arrive at {target}.")
    assert arrived.anchor == arrived.observation and arrived.reward == 0.0 and not arrived.done

    nothing = env.step("fly to the moon")
    assert nothing.observation == "Nothing happens."
    assert (nothing.reward, nothing.done) == (0.0, False)
    look = env.step(env.invalid_action).observation
    assert look.startswith("You are facing the ") and target in look
    inventory = env.step("inventory")
    assert inventory.observation == "You are not carrying anything."


@pytest.mark.slow
def test_expert_wins_every_task_type(env, generated):
    for split in ("train", "valid_unseen"):
        specs = AlfWorldEnv.tasks(split, **generated["kwargs"])
        for task_type in TASK_TYPES:
            result = _play_expert(env, _first(specs, task_type).task_id)
            assert result.won and result.done and result.reward == 1.0, (split, task_type)
            assert env.expert_action() is None
            assert env.step("look").done


@pytest.mark.slow
def test_expert_replans_after_the_agent_leaves_its_plan(env, generated):
    spec = _first(AlfWorldEnv.tasks("valid_seen", **generated["kwargs"]), "pick_two_obj_and_place")
    result = env.reset(spec.task_id)
    planned = env.expert_action()
    detours = [c for c in result.admissible_actions if c.startswith("go to ") and c != planned]
    result = env.step(detours[-1])
    takes = [c for c in result.admissible_actions if c.startswith(("take ", "open "))]
    if takes:  # moving things around is what makes a full replan slow
        env.step(takes[0])

    replanned = env.expert_action()
    assert replanned is not None
    # As long as the plan of ALFWorld's own expert (TextWorld's replan of the full state): both optimal.
    pddl_env = env._engine._env.unwrapped
    assert len(env._plan) == len(pddl_env._pddl_state.replan(pddl_env._entity_infos))
    for _ in range(50):
        result = env.step(env.expert_action())
        if result.done:
            break
    assert result.won


@pytest.mark.slow
def test_envs_in_threads_do_not_corrupt_each_other(generated):
    """TextWorld's grammar parsers are process-global; unguarded, two stepping threads crash it."""
    specs = AlfWorldEnv.tasks(
        "train", task_types=["look_at_obj_in_light", "pick_two_obj_and_place"], **generated["kwargs"]
    )
    pair = [AlfWorldEnv(**generated["kwargs"]) for _ in range(2)]
    errors = []

    def play(env, task_id):
        try:
            go_to = [c for c in env.reset(task_id).admissible_actions if c.startswith("go to ")]
            for turn in range(10):
                assert env.step("inventory").observation == "You are not carrying anything."
                assert env.step(go_to[turn % 2]).observation.startswith("You arrive at ")
        except Exception as error:  # reported below, with the thread's traceback lost
            errors.append(repr(error))

    threads = [threading.Thread(target=play, args=(env, spec.task_id)) for env, spec in zip(pair, specs[::2])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for env in pair:
        env.close()
    assert errors == []


@pytest.mark.slow
def test_official_layout_loads(generated, tmp_path, monkeypatch):
    """A directory laid out like $ALFWORLD_DATA, built from generated games plus what ALFWorld skips."""
    source = generated["root"] / "json_2.1.1"
    official = tmp_path / "alfworld_data"
    for split in SPLITS:
        shutil.copytree(source / split, official / "json_2.1.1" / split)
    train = official / "json_2.1.1" / "train"
    kept = sorted(train.glob("*/*/game.tw-pddl"))
    # What AlfredTWEnv.collect_game_files skips: sliced objects, unsolvable games, no game file.
    sliced = train / "pick_clean_then_place_in_recep-AppleSliced-None-Fridge-11" / "trial_T1"
    shutil.copytree(kept[0].parent, sliced)
    unsolvable = train / "pick_and_place_simple-Mug-None-Desk-311" / "trial_T2"
    shutil.copytree(kept[0].parent, unsolvable)
    game = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps(dict(game, solvable=False)))
    no_game = train / "pick_and_place_simple-Mug-None-Desk-312" / "trial_T3"
    shutil.copytree(kept[0].parent, no_game)
    (no_game / "game.tw-pddl").unlink()

    monkeypatch.setenv("ALFWORLD_DATA", str(official))  # what alfworld-download users have
    specs = AlfWorldEnv.tasks("train")
    assert [spec.attributes["game"] for spec in specs] == [
        str(path.parent.relative_to(official / "json_2.1.1")) for path in kept
    ]
    assert AlfWorldEnv.tasks("train", data_dir=str(official)) == specs
    assert len(AlfWorldEnv.tasks("valid_seen", source="official")) == len(TASK_TYPES)

    env = AlfWorldEnv(data_dir=str(official))
    try:
        spec = _first(specs, "pick_two_obj_and_place")
        assert spec.attributes["parent_target"] and not spec.attributes["toggle_target"]
        assert _play_expert(env, spec.task_id).won
    finally:
        env.close()


# --------------------------------------------------------------------------- official games of every release


def _pre_040(game: dict) -> dict:
    """A game file as official games before alfworld 0.4.0 (`json_2.1.1`) have it.

    The reverse of ALFWorld's own 2.1.1 -> 2.1.2 patch: no "help" action in the domain or the
    grammar, "put {o} in/on {r}" for "move {o} to {r}", and "You arrive at loc N." (the location)
    for "You arrive at <receptacle>.". Official files have no walkthrough.
    """
    domain, grammar = game["pddl_domain"], game["grammar"]
    start = domain.index("(:action help")
    domain = domain[:start] + domain[domain.index("\n)\n", start) + 3 :]
    start = grammar.index("\naction help {")
    grammar = grammar[:start] + grammar[grammar.index("\n}\n", start) + 3 :]
    for new, old in (
        ("You arrive at {r.name}.", "You arrive at {lend.name}."),
        ("move {o} to {r}", "put {o} in/on {r}"),
        ("You move the {o.name} to the {r.name}.", "You put the {o.name} in/on the {r.name}."),
    ):
        assert new in grammar, new
        grammar = grammar.replace(new, old)
    old_game = {key: value for key, value in game.items() if key != "walkthrough"}
    return dict(old_game, pddl_domain=domain, grammar=grammar)


@pytest.fixture(scope="module")
def pre_040_data(generated, tmp_path_factory) -> Path:
    """The session's generated games, rewritten in the grammar of the official games before alfworld 0.4.0."""
    root = tmp_path_factory.mktemp("alfworld_2.1.1")
    shutil.copytree(generated["root"] / "json_2.1.1", root / "json_2.1.1")
    for game_file in root.glob("json_2.1.1/*/*/*/game.tw-pddl"):
        game_file.write_text(json.dumps(_pre_040(json.loads(game_file.read_text()))))
    return root


def _play_to_win(env, result, max_steps=60):
    """Follow the expert from `result`: (the last result, the expert's commands)."""
    actions = []
    while not result.done and len(actions) < max_steps:
        actions.append(env.expert_action())
        assert actions[-1] in result.admissible_actions, (actions[-1], env._game.path)
        result = env.step(actions[-1])
    return result, actions


@pytest.mark.slow
def test_expert_wins_games_of_the_pre_040_grammar(pre_040_data, caplog):
    """The expert plans with the loaded game's own domain and grammar, not the installed wheel's."""
    env = AlfWorldEnv(data_dir=str(pre_040_data))
    try:
        for spec in AlfWorldEnv.tasks("valid_unseen", data_dir=str(pre_040_data)):  # one game per task type
            first = env.reset(spec.task_id)
            assert not any(c.startswith("move ") for c in first.admissible_actions)
            go_to = next(c for c in first.admissible_actions if c.startswith("go to "))
            assert env.step(go_to).observation.startswith("You arrive at loc ")  # the old go-to text
            result, actions = _play_to_win(env, env.reset(spec.task_id))
            assert result.won, spec.attributes["task_type"]
            if spec.attributes["task_type"] != "look_at_obj_in_light":  # the others end by putting the object
                assert re.fullmatch(r"put .+ in/on .+", actions[-1]), actions
        assert env.expert_failures == 0 and "expert failure" not in caplog.text
    finally:
        env.close()


@pytest.mark.slow
def test_expert_wins_pre_040_games_from_mid_game(pre_040_data):
    import random

    env = AlfWorldEnv(data_dir=str(pre_040_data))
    try:
        for spec in AlfWorldEnv.tasks("valid_seen", data_dir=str(pre_040_data)):
            rng = random.Random(spec.task_id)
            result = env.reset(spec.task_id)
            for _ in range(8):  # the agent wanders first: take, open, move things
                if result.done:
                    break
                result = env.step(rng.choice(result.admissible_actions))
            assert _play_to_win(env, result)[0].won, spec.attributes["task_type"]
        assert env.expert_failures == 0
    finally:
        env.close()


@pytest.mark.slow
def test_expert_failure_is_logged_and_counted(generated, tmp_path, caplog):
    """A game whose grammar words go-to as "walk to": the plan's "go to ..." is refused, and the expert says so."""
    root = tmp_path / "data"
    shutil.copytree(generated["root"] / "json_2.1.1", root / "json_2.1.1")
    spec = _first(AlfWorldEnv.tasks("valid_unseen", data_dir=str(root)), "pick_and_place_simple")
    game_file = root / "json_2.1.1" / spec.attributes["game"] / "game.tw-pddl"
    game = json.loads(game_file.read_text())
    assert 'template :: "go to [' in game["grammar"]
    game_file.write_text(
        json.dumps(dict(game, grammar=game["grammar"].replace('template :: "go to [', 'template :: "walk to [')))
    )

    env = AlfWorldEnv(data_dir=str(root))
    try:
        result = env.reset(spec.task_id)
        assert any(c.startswith("walk to ") for c in result.admissible_actions)
        assert env.expert_action() is None and not env.done
        assert env.expert_failures == 1
        assert "expert failure #1" in caplog.text and str(game_file) in caplog.text
        assert "planned command 'go to " in caplog.text and "is not an admissible command here" in caplog.text
    finally:
        env.close()


@pytest.mark.slow
def test_memo_plays_exactly_as_textworld(generated):
    """With `memo` (`_MemoGrammar`, `_MemoTranslation`) the same observations and admissible commands as
    TextWorld's own derivation and translation, replays included."""
    import random

    specs = AlfWorldEnv.tasks("valid_unseen", **generated["kwargs"])[::2]  # TextWorld's own text costs ~0.1 s a step
    plays = {}
    for memo in (False, True):
        env = AlfWorldEnv(memo=memo, **generated["kwargs"])
        rng, seen = random.Random(0), []
        try:
            for spec in specs:
                result = env.reset(spec.task_id)
                seen.append((result.observation, result.admissible_actions))
                for _ in range(5):
                    result = env.step(rng.choice(result.admissible_actions))
                    seen.append((result.observation, result.admissible_actions))
            result = env.reset(specs[0].task_id)  # a replay: no load, and with memo no translation
            seen.append((result.observation, result.admissible_actions))
        finally:
            env.close()
        plays[memo] = seen
    assert plays[True] == plays[False]
    assert len({observation for observation, _ in plays[True]}) > len(specs) * 3  # the walk saw many states


# --------------------------------------------------------------------------- damaged data, and which data is played


def _trial(root: Path, split: str, folder: str, trial: str, content: str) -> Path:
    trial_dir = root / "json_2.1.1" / split / folder / trial
    trial_dir.mkdir(parents=True)
    (trial_dir / "traj_data.json").write_text("{}")
    (trial_dir / "game.tw-pddl").write_text(content)
    return trial_dir / "game.tw-pddl"


def test_cut_short_game_is_listed_once_and_keeps_its_task_id(tmp_path, caplog):
    folder = "pick_and_place_simple-Mug-None-Desk-311"
    _trial(tmp_path, "valid_seen", folder, "trial_A", '{"solvable": true}')
    cut = _trial(tmp_path, "valid_seen", folder, "trial_B", '{"pddl_domain": "(define (domain alfred)')
    _trial(tmp_path, "valid_seen", folder, "trial_C", '{"solvable": true}')
    for _ in range(2):
        specs = AlfWorldEnv.tasks("valid_seen", data_dir=str(tmp_path))
    assert [spec.task_id for spec in specs] == [0, 2]  # trial_C keeps id 2 whether B is readable or not
    assert caplog.text.count(str(cut)) == 1 and "cut short" in caplog.text and "alfworld-download" in caplog.text
    with pytest.raises(ValueError, match=f"task_id=1: game file {cut}.*cut short.*alfworld-download"):
        AlfWorldEnv(data_dir=str(tmp_path)).reset(1)


def test_corrupt_game_file_errors_name_the_file_and_the_fix(tmp_path):
    domain = Path(alfworld.info.ALFRED_PDDL_PATH).read_text()
    grammar = Path(alfworld.info.ALFRED_TWL2_PATH).read_text()
    folder = "pick_and_place_simple-Mug-None-Desk-311"
    bad_json = _trial(tmp_path, "valid_seen", folder, "trial_A", '{"solvable": true, "pddl_domain": }')
    bad_pddl = _trial(
        tmp_path,
        "valid_seen",
        folder,
        "trial_B",
        json.dumps({"pddl_domain": domain, "grammar": grammar, "pddl_problem": "(define (problem p", "solvable": True}),
    )
    env = AlfWorldEnv(data_dir=str(tmp_path))
    try:
        with pytest.raises(ValueError, match=f"{bad_json} is not valid JSON.*alfworld-download"):
            env.reset(0)
        with pytest.raises(ValueError, match=f"{bad_pddl}: its PDDL domain, problem or grammar does not parse"):
            env.reset(1)
    finally:
        env.close()


@pytest.mark.slow
def test_auto_says_why_it_ignores_a_mistyped_alfworld_data(generated, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "alfworld_dta"))
    kwargs = {key: value for key, value in generated["kwargs"].items() if key != "source"}
    assert len(AlfWorldEnv.tasks("valid_seen", **kwargs)) == len(TASK_TYPES)  # source="auto": generated games
    assert f"$ALFWORLD_DATA='{tmp_path / 'alfworld_dta'}'" in caplog.text
    assert "does not exist" in caplog.text and "falls back to generated games" in caplog.text


def test_official_data_errors_say_where_json_2_1_1_is(tmp_path):
    (tmp_path / "data" / "json_2.1.1").mkdir(parents=True)
    with pytest.raises(EnvUnavailableError, match="is the json_2.1.1 folder itself; point at its parent"):
        AlfWorldEnv.tasks("train", data_dir=str(tmp_path / "data" / "json_2.1.1"))
    with pytest.raises(EnvUnavailableError, match=f"{tmp_path / 'data'} has: point there"):
        AlfWorldEnv.tasks("train", data_dir=str(tmp_path))


@pytest.mark.slow
def test_milestones_are_the_experts_plan_from_the_start_and_the_expert_reaches_them_all(env, generated):
    """BEACON's ALFWorld milestones: the expert's whole plan from the start state (the walkthrough of a
    generated game), which the expert's own episode matches step for step."""
    from bipace_trainer.advantages.milestones import match_milestones

    for task_type in ("pick_and_place_simple", "pick_heat_then_place_in_recep"):
        task_id = _first(AlfWorldEnv.tasks("train", **generated["kwargs"]), task_type).task_id
        env.reset(task_id)
        plan = env.milestones()
        actions = []
        result = None
        while result is None or not result.done:
            actions.append(env.expert_action())
            result = env.step(actions[-1])
        assert plan == actions and all(match_milestones(actions, plan, 0.95))
        assert env.milestones() == plan  # asked again after the episode: the same list, not a new plan
