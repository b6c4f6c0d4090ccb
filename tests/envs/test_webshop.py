"""WebShop: the generated shop, its pages and reward rules, the adapter for a real install, the expert."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("bm25s", reason="pip install -e '.[webshop]'")
pytest.importorskip("rapidfuzz", reason="pip install -e '.[webshop]'")

import envs.webshop as webshop  # noqa: E402
from envs import EnvUnavailableError, VectorEnv, make_env  # noqa: E402
from envs.webshop import WebShopEnv, search_keywords, split_of  # noqa: E402
from envs.webshop_gen import GENERATOR_VERSION, generate_catalog, load_catalog  # noqa: E402
from envs.webshop_site import webshop_reward  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("webshop_cache"))


@pytest.fixture(scope="module")
def catalog(cache_dir):
    return load_catalog(cache_dir=cache_dir)


@pytest.fixture
def env(cache_dir):
    env = WebShopEnv(cache_dir=cache_dir)
    yield env
    env.close()


def _tasks(split, cache_dir):
    return WebShopEnv.tasks(split, cache_dir=cache_dir)


def _goal(env, task_id):
    return env._engine.server.goals[task_id]


def _play_expert(env, task_id, max_steps=30):
    result = env.reset(task_id)
    steps = 0
    while not result.done and steps < max_steps:
        result = env.step(env.expert_action())
        steps += 1
    return result, steps


# -- the catalogue ---------------------------------------------------------------------------


def test_catalogue_is_deterministic_cached_and_webshop_shaped(catalog, cache_dir):
    assert catalog == generate_catalog(seed=0, num_products=1000)
    cached = Path(cache_dir) / f"v{GENERATOR_VERSION}-seed0-products1000.json"
    assert json.loads(cached.read_text()) == catalog
    assert generate_catalog(seed=1, num_products=1000)["products"] != catalog["products"]
    products, goals = catalog["products"], catalog["goals"]
    assert len(products) == 1000 and len({p["asin"] for p in products}) == 1000
    assert {p["category"] for p in products} == {"beauty", "electronics", "fashion", "food", "furniture"}
    by_asin = {p["asin"]: p for p in products}
    for goal in goals[:200]:
        product = by_asin[goal["asin"]]
        assert set(goal["attributes"]) <= set(product["Attributes"])
        assert all(product["options"][name].count(value) == 1 for name, value in goal["goal_options"].items())
        assert set(goal["goal_options"]) == set(product["options"])  # one goal per option combination
        assert goal["price_upper"] > product["price"] and goal["price_upper"] % 10 == 0
        assert goal["price_upper"] - product["price"] < 40
        assert goal["instruction_text"].endswith(f", and price lower than {goal['price_upper']:.2f} dollars")
        for name, value in goal["goal_options"].items():
            assert f"{name}: {value}" in goal["instruction_text"]


def test_splits_are_webshops_and_partition_the_goals(catalog, cache_dir):
    specs = {split: _tasks(split, cache_dir) for split in WebShopEnv.splits()}
    assert [s.task_id for s in specs["test"]] == list(range(500))
    assert [s.task_id for s in specs["valid"]] == list(range(500, 1500))
    assert [s.task_id for s in specs["train"]] == list(range(1500, len(catalog["goals"])))
    spec = specs["train"][0]
    goal = catalog["goals"][spec.task_id]
    assert spec.attributes == {"category": goal["category"], "asin": goal["asin"], "query": goal["query"]}
    assert WebShopEnv.report_key == "category"
    assert [split_of(i, 600) for i in (0, 99, 100, 299, 300)] == ["test", "test", "valid", "valid", "train"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"source": "amazon"}, "source='amazon'"),
        ({"reward": "dense"}, "reward='dense'"),
        ({"num_products": 10}, "num_products=10"),
        ({"source": "webshop", "num_products": 500}, "num_products=500"),
    ],
)
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WebShopEnv(**kwargs)


def test_unknown_split_is_rejected(cache_dir):
    with pytest.raises(ValueError, match="split='dev'"):
        WebShopEnv.tasks("dev", cache_dir=cache_dir)


def test_an_env_keeps_one_session_on_the_shared_server(cache_dir):
    first, second = WebShopEnv(cache_dir=cache_dir), WebShopEnv(cache_dir=cache_dir)
    for task_id in range(20):
        first.reset(task_id)
        second.reset(task_id)  # same goal, own session
    server = first._engine.server
    prefixes = (first._engine.session_prefix, second._engine.session_prefix)

    def live():
        return sorted(session for session in server.user_sessions if session.startswith(prefixes))

    assert server is second._engine.server and live() == sorted(f"{prefix}19" for prefix in prefixes)
    first.close()
    assert live() == [f"{prefixes[1]}19"]
    second.close()


def test_task_id_out_of_range_names_the_range(env, catalog):
    with pytest.raises(ValueError, match=f"task_id={len(catalog['goals'])} is out of range"):
        env.reset(len(catalog["goals"]))


def test_registered_under_webshop(cache_dir):
    assert isinstance(make_env("webshop", cache_dir=cache_dir), WebShopEnv)


# -- pages, actions, anchors -----------------------------------------------------------------


def test_search_page_then_results_in_webshops_text_mode(env, cache_dir):
    task_id = _tasks("train", cache_dir)[0].task_id
    first = env.reset(task_id)
    assert env.task == _goal(env, task_id)["instruction_text"]
    assert first.observation == first.anchor == "'Search'"
    assert first.admissible_actions == ["search[<your query>]"]
    assert not first.done and first.reward == 0.0

    results = env.step("search[black size]")  # words of many products: the top 50 of them
    parts = results.observation.split(" [SEP] ")
    assert parts[:3] == ["'Back to Search'", "'Page 1 (Total results: 50)'", "'Next >'"]
    listed = parts[3:]
    assert len(listed) == 30 and all(asin.startswith("'B0") for asin in listed[::3])
    assert all(price.startswith("'$") for price in listed[2::3])
    assert env.task not in results.observation
    ids = [asin.strip("'").lower() for asin in listed[::3]]
    assert results.admissible_actions == ["click[back to search]", "click[next >]"] + [f"click[{i}]" for i in ids]

    second = env.step("click[next >]")
    assert second.observation.split(" [SEP] ")[:4] == ["'Back to Search'", "'Page 2 (Total results: 50)'", "'< Prev'", "'Next >'"]
    assert env.step("click[< prev]").anchor == results.anchor


def test_item_page_options_sub_pages_and_navigation(env, catalog, cache_dir):
    task_id = next(s.task_id for s in _tasks("train", cache_dir) if len(catalog["goals"][s.task_id]["goal_options"]) == 2)
    env.reset(task_id)
    results = env.step(f"search[{search_keywords(env.task)}]")
    asin = _goal(env, task_id)["asin"]
    item = env.step(f"click[{asin.lower()}]")
    product = next(p for p in catalog["products"] if p["asin"] == asin)
    expected = ["Back to Search", "< Prev"]
    for name, values in product["options"].items():
        expected += [name, *values]
    expected += [product["Title"], f"Price: {product['Price']}", "Rating: N.A.", "Description", "Features", "Reviews", "Buy Now"]
    assert item.observation == " [SEP] ".join(f"'{part}'" for part in expected)
    values = [v for vs in product["options"].values() for v in vs]
    assert item.admissible_actions == [
        f"click[{b}]" for b in ("back to search", "< prev", "description", "features", "reviews", "buy now", *values)
    ]
    chosen = env.step(f"click[{values[0]}]")
    assert chosen.anchor == item.anchor  # WebShop's text mode does not show the chosen options

    description = env.step("click[description]")
    assert description.observation == f"'Back to Search' [SEP] '< Prev' [SEP] '{product['Description']}'"
    assert env.step("click[< prev]").anchor == item.anchor
    features = env.step("click[features]")
    assert features.observation.split(" [SEP] ")[2:] == [f"'{b}'" for b in product["BulletPoints"]]
    env.step("click[< prev]")
    assert env.step("click[< prev]").anchor == results.anchor  # item page -> its results page
    assert env.step("click[back to search]").anchor == "'Search'"
    assert env._session()["options"] == {}  # leaving the item page dropped the choice


def test_same_page_same_anchor_across_envs(cache_dir):
    task_id = _tasks("valid", cache_dir)[3].task_id
    anchors = []
    for _ in range(2):
        env = WebShopEnv(cache_dir=cache_dir)
        env.reset(task_id)
        anchors.append([env.step(a).anchor for a in ("search[shampoo]", "click[next >]", "click[< prev]")])
        env.close()
    assert anchors[0] == anchors[1] and anchors[0][0] == anchors[0][2] != anchors[0][1]


def test_garbled_and_inadmissible_actions_change_nothing(env, cache_dir):
    env.reset(_tasks("train", cache_dir)[5].task_id)
    results = env.step("search[lamp]")
    for action in ("wait", "click[buy now]", "click[search]", "click[b000000000]", "search[]", "<action>x</action>", ""):
        after = env.step(action)
        assert after.anchor == results.anchor and not after.done and after.reward == 0.0, action


def test_actions_tolerate_case_and_white_space(env, cache_dir):
    task_id = _tasks("train", cache_dir)[0].task_id
    env.reset(task_id)
    env.step(f"  Search [ {search_keywords(env.task)} ] ")
    asin = _goal(env, task_id)["asin"]
    item = env.step(f"CLICK[{asin}]")  # WebShop lower-cases the argument
    assert "'Buy Now'" in item.observation
    bought = env.step(" click [ Buy   Now ] ")
    assert bought.done


# -- reward ----------------------------------------------------------------------------------


def _product(**overrides):
    product = {
        "asin": "B000000001",
        "query": "shampoo",
        "product_category": "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
        "Title": "Zova Shampoo",
        "title_nouns": ["zova", "shampoo"],
        "Description": "A shampoo.",
        "BulletPoints": ["Gentle."],
        "Attributes": ["sulfate free", "paraben free"],
    }
    return product | overrides


GOAL = {
    "query": "shampoo",
    "product_category": "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
    "name_nouns": ["zova", "shampoo"],
    "attributes": ["sulfate free", "long lasting"],
    "goal_options": {"color": "navy blue", "size": "large"},
    "price_upper": 30.0,
}


def test_reward_counts_attributes_options_and_price():
    # 1 of 2 attributes, 2 of 2 options, price within bound: (1 + 2 + 1) / (2 + 2 + 1)
    reward, info = webshop_reward(_product(), GOAL, 20.0, {"color": "navy blue", "size": "large"})
    assert reward == pytest.approx(4 / 5)
    assert (info["r_att"], info["r_option"], info["r_price"], info["r_type"]) == (0.5, 1.0, True, 1.0)
    # over the price bound, one option wrong
    assert webshop_reward(_product(), GOAL, 31.0, {"color": "navy blue", "size": "small"})[0] == pytest.approx(2 / 5)
    # an attribute written in the features counts; near spellings match (token-set ratio > 85)
    product = _product(BulletPoints=["Long lasting hold."], Attributes=["sulfate-free"])
    assert webshop_reward(product, GOAL, 20.0, {"color": "navy blue", "size": "large"})[0] == 1.0


def test_reward_colours_are_reduced_to_their_base_colour():
    # WebShop reduces a value to the first base colour (alphabetically) inside it: "light blue"
    # and "navy blue" both become "blue" and match, while "navy" stays "navy" and does not.
    assert webshop_reward(_product(), GOAL, 20.0, {"color": "light blue", "size": "large"})[1]["r_option"] == 1.0
    assert webshop_reward(_product(), GOAL, 20.0, {"color": "navy", "size": "large"})[1]["r_option"] == 0.5
    assert webshop_reward(_product(), GOAL, 20.0, {"color": "dark red", "size": "large"})[1]["r_option"] == 0.5


def test_type_reward_follows_query_category_and_title_nouns():
    other_category = "Electronics › Cell Phones & Accessories › Cases"
    lamp = _product(query="table lamp", product_category=other_category, title_nouns=["lumo", "lamp"])
    assert webshop_reward(lamp, GOAL, 20.0, {})[1]["r_type"] == 0.0  # no noun in common
    # one noun of two in common (title score 0.5 > 0.2): full type reward even in another category
    brand_lamp = _product(query="table lamp", product_category=other_category, title_nouns=["zova", "lamp"])
    assert webshop_reward(brand_lamp, GOAL, 20.0, {})[1]["r_type"] == 1.0
    # one noun of ten (0.1, not > 0.2), no query or category match: halved
    goal = GOAL | {"name_nouns": ["zova"] + [f"noun{i}" for i in range(9)]}
    assert webshop_reward(brand_lamp, goal, 20.0, {})[1]["r_type"] == 0.5


def test_buying_ends_the_episode_with_score_and_success(env, cache_dir):
    task_id = next(s.task_id for s in _tasks("train", cache_dir) if s.attributes["category"] == "fashion")
    env.reset(task_id)
    goal_options = _goal(env, task_id)["goal_options"]
    env.step(f"search[{search_keywords(env.task)}]")
    env.step(f"click[{_goal(env, task_id)['asin'].lower()}]")
    bought = env.step("click[buy now]")  # no option chosen
    expected = (len(_goal(env, task_id)["attributes"]) + 1) / (len(_goal(env, task_id)["attributes"]) + len(goal_options) + 1)
    assert bought.done and not bought.won and bought.reward == pytest.approx(expected) and expected < 1
    assert bought.info["score"] == bought.reward and bought.info["score_components"]["r_option"] == 0.0
    assert bought.admissible_actions is None
    after = env.step("click[buy now]")
    assert after.done and after.reward == 0.0 and not after.won


def test_success_reward_pays_only_a_full_match(catalog, cache_dir):
    env = WebShopEnv(cache_dir=cache_dir, reward="success")
    task_id = next(s.task_id for s in _tasks("test", cache_dir) if catalog["goals"][s.task_id]["goal_options"])
    won, _ = _play_expert(env, task_id)
    assert won.won and won.reward == 1.0 and won.info["score"] == 1.0
    env.reset(task_id)
    env.step(f"search[{search_keywords(env.task)}]")
    env.step(f"click[{_goal(env, task_id)['asin'].lower()}]")
    partial = env.step("click[buy now]")  # no option chosen
    assert partial.done and not partial.won and partial.reward == 0.0 and 0 < partial.info["score"] < 1


# -- expert ----------------------------------------------------------------------------------


def test_search_keywords_drop_the_opening_and_the_price():
    text = "i am looking for a sulfate free shampoo with scent: mint, and price lower than 40.00 dollars"
    assert search_keywords(text) == "sulfate free shampoo with scent: mint"


@pytest.mark.parametrize("split, every", [("train", 30), ("valid", 10), ("test", 5)])
def test_expert_wins_at_least_95_percent_of_a_sample(env, cache_dir, split, every):
    specs = _tasks(split, cache_dir)[::every]
    results = [_play_expert(env, spec.task_id) for spec in specs]
    wins = sum(result.won for result, _ in results)
    assert wins >= 0.95 * len(specs), (wins, len(specs))
    assert all(result.done and steps <= 10 for result, steps in results)
    assert env.expert_action() is None


def test_expert_recovers_after_detours(env, cache_dir):
    task_id = _tasks("train", cache_dir)[42].task_id
    env.reset(task_id)
    for action in ("search[office chair]", "click[next >]", "click[back to search]", "search[coffee]"):
        env.step(action)
    first = next(a for a in env.step("click[next >]").admissible_actions if a.startswith("click[b0"))
    env.step(first)
    env.step("click[features]")
    result, _ = None, 0
    for _ in range(30):
        result = env.step(env.expert_action())
        if result.done:
            break
    assert result.won


def test_expert_searches_the_title_past_the_end_of_its_results_then_buys_what_is_shown(env, catalog, cache_dir):
    task_id = _tasks("train", cache_dir)[7].task_id
    goal = catalog["goals"][task_id]
    env.reset(task_id)
    env.step(f"search[{search_keywords(env.task)}]")
    for _ in range(5):
        env.step("click[next >]")  # page 6: past the 50 results, as if the target were not among them
    assert env.expert_action() == env.expert_action() == "click[back to search]"  # asking twice changes nothing
    env.step("click[back to search]")
    assert env.expert_action() == f"search[{goal['name'].lower()}]"
    titled = env.step(env.expert_action())
    assert f"click[{goal['asin'].lower()}]" in titled.admissible_actions
    for _ in range(5):
        env.step("click[next >]")
    assert env.expert_action() == "click[< prev]"  # stage 2: buy the first product shown
    env.step("click[< prev]")
    shown = next(a for a in env.step("click[< prev]").admissible_actions if a.startswith("click[b0"))
    assert env.expert_action() in (shown, f"click[{goal['asin'].lower()}]")


# -- through VectorEnv and against WebShop's own interface -----------------------------------


@pytest.mark.parametrize("backend", ["serial", "process"])  # process: built in a worker by name and kwargs
def test_vector_env_cuts_long_pages_and_keeps_anchors_exact(cache_dir, backend):
    task_ids = [s.task_id for s in _tasks("test", cache_dir)[:2]]
    kwargs = {"cache_dir": cache_dir}
    with VectorEnv("webshop", 2, env_kwargs=kwargs, backend=backend, num_workers=1, max_observation_chars=200) as vec:
        first = vec.reset(task_ids)
        assert all(r.observation == "'Search'" for r in first)
        pages = vec.step(["search[shoes]", "search[shoes running men]"])
        assert all("more characters cut" in r.observation and len(r.anchor) < 300 for r in pages)
        assert pages[0].anchor != pages[1].anchor  # cut anchors keep a hash of the whole page
        assert vec.num_failures == 0


def _fake_webshop_install(root, *, data=True, index=True):
    """A `web_agent_site` package with WebShop's module layout and class signatures, serving the
    generated catalogue: what `source="webshop"` imports, without WebShop's data."""
    package = root / "web_agent_site"
    (package / "envs").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "envs" / "__init__.py").write_text("")
    (package / "utils.py").write_text(
        textwrap.dedent(
            """
            from os.path import abspath, dirname, join
            BASE_DIR = dirname(abspath(__file__))
            DEFAULT_ATTR_PATH = join(BASE_DIR, '../data/items_ins_v2_1000.json')
            DEFAULT_FILE_PATH = join(BASE_DIR, '../data/items_shuffle_1000.json')
            HUMAN_ATTR_PATH = join(BASE_DIR, '../data/items_human_ins.json')
            """
        )
    )
    (package / "envs" / "web_agent_text_env.py").write_text(
        textwrap.dedent(
            """
            import os
            import random
            from envs.webshop_gen import load_catalog
            from envs.webshop_site import GeneratedServer, GeneratedTextEnv

            class SimServer(GeneratedServer):
                def __init__(self, base_url, file_path, filter_goals=None, limit_goals=-1, num_products=None,
                             human_goals=0, show_attrs=False):
                    random.random()  # as WebShop's: prices of ranges drawn, then random.seed(233)
                    random.seed(233)
                    super().__init__(load_catalog(num_products=num_products, cache_dir=os.environ['FAKE_WEBSHOP_CACHE']))

            class WebAgentTextEnv(GeneratedTextEnv):
                def __init__(self, observation_mode='html', file_path=None, server=None, **kwargs):
                    assert observation_mode == 'text' and server is not None
                    super().__init__(server, session_prefix=kwargs.get('session_prefix') or '')
            """
        )
    )
    if data:
        (root / "data").mkdir()
        for name in ("items_ins_v2_1000.json", "items_shuffle_1000.json", "items_human_ins.json"):
            (root / "data" / name).write_text("[]")
    if index:
        (root / "search_engine" / "indexes_1k").mkdir(parents=True)


@pytest.fixture
def fake_install(tmp_path, monkeypatch, cache_dir):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FAKE_WEBSHOP_CACHE", cache_dir)
    # The real engine also imports spaCy, pyserini, thefuzz...: the stand-in needs only itself.
    monkeypatch.setattr(webshop, "WEBSHOP_MODULES", ("web_agent_site",))
    webshop._webshop_server.cache_clear()
    yield tmp_path
    webshop._webshop_server.cache_clear()
    for name in [m for m in sys.modules if m.startswith("web_agent_site")]:
        del sys.modules[name]


def test_webshop_source_names_what_is_missing():
    if importlib.util.find_spec("web_agent_site") is not None:
        pytest.skip("a WebShop install is importable here")
    with pytest.raises(EnvUnavailableError, match="source='webshop' is missing module web_agent_site.*setup.sh"):
        WebShopEnv(source="webshop")


def test_webshop_source_names_missing_data_and_index(tmp_path, monkeypatch):
    _fake_webshop_install(tmp_path, data=False, index=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(webshop, "WEBSHOP_MODULES", ("web_agent_site",))
    try:
        with pytest.raises(EnvUnavailableError, match=r"items_shuffle_1000\.json \(DEFAULT_FILE_PATH\).*indexes_1k"):
            WebShopEnv(source="webshop")
    finally:
        for name in [m for m in sys.modules if m.startswith("web_agent_site")]:
            del sys.modules[name]


def test_webshop_source_plays_through_webshops_interface(fake_install, cache_dir):
    """The adapter on WebShop's class names and signatures reads the same pages as the generated backend."""
    _fake_webshop_install(fake_install)
    random.seed(5)
    expected = random.random()
    random.seed(5)
    real = WebShopEnv(source="webshop")
    real.reset(0)  # loads the server, which reseeds the global random
    assert random.random() == expected  # the trainer's draws are left alone
    generated = WebShopEnv(cache_dir=cache_dir)
    task_ids = [s.task_id for s in WebShopEnv.tasks("test", source="webshop")[:20]]
    assert task_ids == [s.task_id for s in _tasks("test", cache_dir)[:20]]
    for task_id in task_ids:
        a, b = real.reset(task_id), generated.reset(task_id)
        assert real.task == generated.task
        steps = 0
        while not a.done and steps < 30:
            action = real.expert_action()
            assert action == generated.expert_action()
            a, b = real.step(action), generated.step(action)
            assert (a.observation, a.anchor, a.admissible_actions) == (b.observation, b.anchor, b.admissible_actions)
            assert a.reward == b.reward
            steps += 1
        assert a.won
    real.close()
    generated.close()


@pytest.mark.slow
def test_expert_wins_at_least_95_percent_of_every_third_goal(env, catalog):
    task_ids = range(0, len(catalog["goals"]), 3)  # all goals take ~1 min on 2 busy cores; bench/envs.py runs them
    lost = [task_id for task_id in task_ids if not _play_expert(env, task_id)[0].won]
    assert len(lost) <= 0.05 * len(task_ids), len(lost)


@pytest.mark.slow
def test_trainer_runs_a_gigpo_step_on_the_generated_shop(tmp_path, cache_dir):
    """The env in the trainer: rollouts read WebShop pages and GiGPO groups their first steps."""
    from peft import LoraConfig

    from tests.trainer.tiny_setup import LORA, CapturingTrainer, make_model, make_tokenizer, tiny_args

    tokenizer = make_tokenizer()
    args = tiny_args(
        tmp_path / "run", preset="gigpo", env_name="webshop", env_kwargs={"cache_dir": cache_dir}, max_steps=1,
        max_turns=3, eval_tasks=2, eval_split="test",
    )
    trainer = CapturingTrainer(make_model(tokenizer), args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    (rollout, advantages, _), = trainer.captured
    first_steps = [s for s in rollout.steps if s.t == 0]
    assert len(first_steps) == args.tasks_per_iteration * args.num_generations
    assert {s.anchor for s in first_steps} == {"'Search'"}  # one cell per task group
    assert all(0 <= e.reward <= 1 and e.length <= 3 for e in rollout.episodes)
    assert advantages.shape[0] == len(rollout.steps)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"episode/success_rate", "episode/reward", "eval/success_rate", "eval/score"} <= logged
    assert any(key.startswith("eval/success_rate/category=") for key in logged)  # reported per category
    bought = [e for e in rollout.episodes if e.score is not None]
    assert all(e.won == (e.score == 1.0) for e in bought)


def test_the_score_is_averaged_over_every_episode_with_no_purchase_at_zero():
    from bipace_trainer.rollout.loop import Episode, Rollout
    from bipace_trainer.run.evaluation import summarise_evaluation

    episodes = [Episode(0, 0, 0, {}, score=1.0, won=True), Episode(1, 0, 0, {}, score=0.5), Episode(2, 0, 0, {})]
    assert Rollout([], episodes, {}).metrics()["episode/score"] == pytest.approx(0.5)
    assert "episode/score" not in Rollout([], episodes[2:], {}).metrics()  # an env that never scores
    records = [{"won": e.won, "length": 1, "failed": False, "score": e.score or 0.0} for e in episodes]
    assert summarise_evaluation(records, None)["score"] == pytest.approx(0.5)
    assert "score" not in summarise_evaluation([{"won": True, "length": 1, "failed": False}], None)
