"""TRL's environments (`environment_factory`) played turn by turn by `run_rollouts` with `ToolEnvAdapter`.

The replies are scripted per episode and parsed by TRL's own `parse_response` with the
Qwen2.5 response template TRL sets (`add_response_schema`); the envs are stepped by a
real `VectorEnv`. What the adapter needs of the trainer (the tool schema per env, the
tokenizer, TRL's bound on tool rounds, the reward columns) is given as TRL's
`GRPOTrainer.__init__` would set it.
"""

from __future__ import annotations

import json
import re
import types

import pytest
from trl import GRPOTrainer
from trl.chat_template_utils import add_response_schema

from bipace_trainer.rollout.loop import Generation, RolloutSettings, TaskRef, run_rollouts
from bipace_trainer.rollout.tool_envs import ToolEnvAdapter, ToolEnvSetup, ToolSession, tool_methods
from envs import as_trl_environment
from envs.vector import VectorEnv

from tests.trainer.tool_setup import PROMPT, Lamps, make_tokenizer


class BrokenLamps(Lamps):
    """Lamps whose switch B is broken: flipping it raises, as a tool calling a dead server would."""

    def flip_b(self) -> str:
        """
        Flip the switch of lamp B.

        Returns:
            The state of both lamps.
        """
        raise ConnectionError("lamp B's server refused the connection")


@pytest.fixture(scope="module")
def tokenizer():
    return add_response_schema(make_tokenizer())


def call(*names: str) -> str:
    return "".join("<tool_call>\n" + json.dumps({"name": n, "arguments": {}}) + "\n</tool_call>" for n in names)


def fake_setup(tokenizer, factories, max_tool_calling_iterations=10, max_completion_length=4096):
    """What `GRPOTrainer.__init__` sets up for `environment_factory=factories`, as the trainer hands it over,
    with TRL's own `_get_tool_suffix_ids` (the tokens a tool result adds to the completion) bound."""
    multi = isinstance(factories, dict)
    factories = factories if multi else {None: factories}
    trl_side = types.SimpleNamespace(  # what TRL's `_get_tool_suffix_ids` reads of the trainer
        _tokenizer=tokenizer, processing_class=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
    )
    return ToolEnvSetup(
        environment_factories=factories,
        multi_environment=multi,
        standalone_tools=[],
        env_tools={name: tool_methods(factory()) for name, factory in factories.items()},
        tools=[],
        tokenizer=tokenizer,
        max_tool_calling_iterations=max_tool_calling_iterations,
        num_reward_funcs=1,  # TRL appended one get_reward column; no user reward_funcs
        reward_func_names=["get_reward"],
        reward_weights=None,
        user_rewards=None,
        take_reward_logs=lambda: ({}, {}),
        max_completion_length=max_completion_length,
        tool_suffix_ids=types.MethodType(GRPOTrainer._get_tool_suffix_ids, trl_side),
    )


def scripted(tokenizer, trainer, scripts):
    """A generator replying scripts[episode][turn]; the episode is named in its prompt."""

    def generate(messages, environments):
        prompt_ids, completion_ids, texts = [], [], []
        for chat, name in zip(messages, environments):
            episode = int(re.search(r"episode (\d+)", chat[1]["content"]).group(1))
            turn = sum(m["role"] == "assistant" for m in chat)
            text = scripts[episode][turn] + "<|im_end|>"
            ids = tokenizer.apply_chat_template(chat, tools=trainer.env_tools[name], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
            prompt_ids.append(list(ids))
            completion_ids.append(tokenizer(text)["input_ids"])
            texts.append(text)
        return Generation(prompt_ids, completion_ids, texts)

    return generate


# Episodes of unequal length (one to three tool calls, a call of two tools, none): the scripts the
# lockstep-versus-continuous tests play in both modes.
UNEQUAL_EPISODES = [[call("flip_a"), call("flip_b"), "Done."], [call("flip_b"), "Done."], [call("flip_a", "flip_b"), "Done."],
                    [call("flip_a"), call("flip_a"), call("flip_b"), "Done."], ["Done."]]


def rows(count, environment=None):
    out = []
    for i in range(count):
        prompt = [PROMPT[0], {"role": "user", "content": f"episode {i}. Light both lamps. "}]
        out.append({"prompt": prompt} | ({"environment": environment[i]} if environment else {}))
    return out


def play(tokenizer, factories, scripts, max_turns=5, environment=None, data=None, tool_errors="observe", **trainer_kwargs):
    trainer = fake_setup(tokenizer, factories, **trainer_kwargs)
    data = data or rows(len(scripts), environment)
    tasks = [TaskRef(0, group=0, inputs=row) for row in data]
    session = __import__("functools").partial(
        ToolSession, trainer.environment_factories, [], trainer.multi_environment, tool_errors
    )
    with VectorEnv(session, len(tasks)) as envs:
        rollout = run_rollouts(envs, tasks, scripted(tokenizer, trainer, scripts), RolloutSettings(max_turns=max_turns),
                               adapter=ToolEnvAdapter(trainer, num_user_reward_funcs=0))
        metrics = envs.metrics()
    return rollout, metrics


def test_each_turn_is_one_step_tool_results_are_the_next_state_and_get_reward_scores_the_end(tokenizer):
    scripts = [
        [call("flip_a"), call("flip_b"), "Done."],  # A then B: both on
        [call("flip_b"), call("flip_a"), "Done."],  # B then A: the same state by another path
        [call("flip_a"), "Done."],  # stops with B off: half the reward
        [call("flip_a", "flip_b"), "Done."],  # two calls in one turn: one step, both on
    ]
    rollout, metrics = play(tokenizer, Lamps, scripts)
    by_traj = {}
    for step in rollout.steps:
        by_traj.setdefault(step.traj, []).append(step)
    both_on = "Lamp A is on. Lamp B is on."
    start = "Lamp A is off. Lamp B is off."
    assert [s.anchor for s in by_traj[0]] == [start, "Lamp A is on. Lamp B is off.", both_on]
    assert [s.anchor for s in by_traj[1]] == [start, "Lamp A is off. Lamp B is on.", both_on]
    assert [s.anchor for s in by_traj[3]] == [start, "Lamp A is on. Lamp B is off.\n" + both_on]
    # the reward sits on the last step only: get_reward() once the model answers
    assert [[s.reward for s in by_traj[t]] for t in range(4)] == [[0, 0, 1], [0, 0, 1], [0, 0.5], [0, 1]]
    assert [e.won for e in rollout.episodes] == [True, True, True, True]  # a positive reward
    assert [e.length for e in rollout.episodes] == [3, 3, 2, 2]
    assert not any(e.failed or e.truncated for e in rollout.episodes)
    # PACE keys: the same tool call is the same action, whatever the path; an answer is its own key
    assert by_traj[0][0].action_key == by_traj[2][0].action_key != by_traj[1][0].action_key
    assert by_traj[0][2].action_key.startswith("answer:")
    # the chat grew with TRL's messages: the prompt of turn 2 holds both tool results
    assert metrics["env/failures"] == 0.0 and metrics["env/steps"] == 4 + 2 + 4  # 6 tool turns, 4 get_reward calls


def test_a_raising_or_unknown_tool_returns_trls_error_text_and_the_episode_goes_on(tokenizer):
    # TRL's _tool_call_loop: the exception's text is the tool's result ({'error': ...}), counted as a tool failure
    scripts = [[call("flip_a"), call("flip_b"), "Done."], [call("flip_a"), "Done."], [call("nope"), "Done."]]
    rollout, metrics = play(tokenizer, BrokenLamps, scripts)
    first, second, third = rollout.episodes
    by_traj = {}
    for step in rollout.steps:
        by_traj.setdefault(step.traj, []).append(step)
    assert not any(e.failed for e in rollout.episodes) and [e.length for e in rollout.episodes] == [3, 2, 2]
    assert by_traj[first.traj][2].observation == "{'error': \"lamp B's server refused the connection\"}"
    assert by_traj[third.traj][1].observation == "{'error': 'Tool nope not found.'}"  # TRL's words
    assert first.reward == 0.5 and third.reward == 0.0  # scored by get_reward as played: A on, B still off
    assert [(e.tool_calls, e.tool_failures) for e in rollout.episodes] == [(2, 1), (1, 0), (1, 1)]
    assert metrics["env/failures"] == 0.0


def test_tool_errors_fail_ends_the_episode_as_a_counted_env_failure(tokenizer):
    scripts = [[call("flip_a"), call("flip_b"), "Done."], [call("flip_a"), "Done."], [call("nope")]]
    rollout, metrics = play(tokenizer, BrokenLamps, scripts, tool_errors="fail")
    first, second, third = rollout.episodes
    assert first.failed and "ConnectionError" in first.failure and first.length == 2 and first.reward == 0
    assert not second.failed and second.length == 2  # the other episodes play on
    assert third.failed and "nope" in third.failure  # a call to a tool the env does not have
    assert metrics["env/failures"] == 2.0


def test_max_tool_calling_iterations_ends_the_episode_as_truncated(tokenizer):
    scripts = [[call("flip_a")] * 5]
    rollout, _ = play(tokenizer, Lamps, scripts, max_turns=5, max_tool_calling_iterations=2)
    (episode,) = rollout.episodes
    assert episode.truncated and not episode.failed and episode.length == 3  # 2 rounds ran, the third was refused
    assert [s.anchor for s in rollout.steps][-1] == "Lamp A is off. Lamp B is off."  # A flipped twice
    rollout, _ = play(tokenizer, Lamps, scripts, max_turns=2)
    assert rollout.episodes[0].truncated and rollout.episodes[0].length == 2  # the turn budget


def test_a_dict_of_factories_routes_each_row_by_its_environment_column(tokenizer):
    scripts = [[call("flip_b"), "Done."], [call("flip_b"), "Done."]]
    rollout, metrics = play(tokenizer, {"good": Lamps, "broken": BrokenLamps}, scripts, environment=["good", "broken"])
    good, broken = rollout.episodes
    assert (good.reward, broken.reward) == (0.5, 0.0) and (good.tool_failures, broken.tool_failures) == (0, 1)
    assert good.reward_terms == {"Lamps": 0.5} and broken.reward_terms == {"BrokenLamps": 0.0}  # TRL's column names


def test_an_unset_env_name_is_checked_only_when_a_trainer_plays_it(monkeypatch, tmp_path):
    from bipace_trainer import config

    monkeypatch.setattr(config, "DEFAULT_ENV", "no_such_env")
    args = config.BiPACEConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)  # TRL's envs need none
    with pytest.raises(ValueError, match="env_name='no_such_env'"):
        args.require_env()  # what BiPACETrainer calls without environment_factory or tools
    with pytest.raises(ValueError, match="env_name='no_such_env'"):
        config.BiPACEConfig(output_dir=str(tmp_path), env_name="no_such_env", report_to="none", use_cpu=True)


def test_a_failed_reset_of_our_trl_class_ends_its_episode_as_a_counted_failure_without_any_tool_call(tokenizer):
    # Our TRL classes raise EnvironmentFailure in a reset that fails (as a local env would): the
    # episode is over before the model's first turn, and no answer turns it into a played one.
    faulty = as_trl_environment("tests.reliability.faulty_envs:FaultyTinyEnv", step_timeout=None)
    data = [{**row, "task_id": task_id} for row, task_id in zip(rows(2), [1, 0])]  # task 1's engine crashes in reset
    rollout, metrics = play(tokenizer, faulty, [["Done."], ["Done."]], data=data)
    failed, healthy = rollout.episodes
    assert failed.failed and "engine crashed during reset" in failed.failure and failed.length == 0
    assert not healthy.failed and healthy.length == 1  # the other episode plays its answer
    assert [step.traj for step in rollout.steps] == [healthy.traj]  # no sample of the failed episode
    assert metrics["env/failures"] == 1.0


def test_trls_reward_calculation_still_ends_in_the_module_gather_the_adapter_leaves_out():
    # ToolEnvAdapter._user_rewards scores each rank's rows alone by swapping this name for the
    # identity during the call (evaluation shards differ in size; tests/trl/test_tool_path.py
    # runs it on 2 processes). A TRL that gathers otherwise must fail here, not hang a run.
    import inspect

    import trl.trainer.grpo_trainer as grpo_module

    source = inspect.getsource(grpo_module.GRPOTrainer._calculate_rewards)
    assert callable(grpo_module.gather) and "gather(rewards_per_func)" in source
    assert "self.accelerator.gather" not in source and "gather_object" not in source
