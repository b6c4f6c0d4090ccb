"""Env faults and malformed model replies never stop a training run."""

from __future__ import annotations

import math

import pytest
import torch

from bipace_trainer.rollout.actions import parse_reply
from bipace_trainer.rollout.loop import Generation, RolloutSettings, TaskRef, run_rollouts
from envs.vector import VectorEnv
from tests.trainer.tiny_setup import CapturingTrainer, tiny_args

from .faulty_envs import CONTROL_TOKENS, FAULTS, HEALTHY, HOSTILE

FAULTY = "tests.reliability.faulty_envs:FaultyTinyEnv"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["serial", "thread", "process"])  # serial is the default
def test_faulty_envs_end_their_episodes_and_the_batch_trains_on(backend, warm_policy, tmp_path):
    model, tokenizer = warm_policy
    tasks = len(FAULTS) + len(HEALTHY)
    args = tiny_args(
        tmp_path, preset="gigpo", env_name=FAULTY, env_kwargs={}, max_steps=1, tasks_per_iteration=tasks,
        num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=tasks, shuffle_dataset=False,
        # one process per env: a hung env's worker is killed, and must take no healthy episode with it
        env_backend=backend, env_workers=2 * tasks if backend == "process" else 4, env_step_timeout=2.0,
        evaluate_before_training=False, eval_tasks=2,
    )
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    trainer.train()
    trainer.close_envs()

    (rollout, advantages, _), = trainer.captured
    by_task = {}
    for episode in rollout.episodes:
        by_task.setdefault(episode.task_id, []).append(episode)
    for task_id, (moment, fault) in FAULTS.items():
        for episode in by_task[task_id]:
            assert episode.failed and not episode.won, (task_id, fault, episode)
            if moment == "reset":
                assert episode.length == 0  # a zero-length episode
    for task_id in HEALTHY:
        assert not any(e.failed for e in by_task[task_id])
    assert torch.isfinite(advantages).all()
    assert all(math.isfinite(s.reward) for s in rollout.steps)
    logged = next(entry for entry in trainer.state.log_history if "episode/env_failures" in entry)
    assert logged["episode/env_failures"] == 2 * len(FAULTS)
    assert math.isfinite(logged["loss"]) and trainer.state.global_step == 1
    kinds = {key for entry in trainer.state.log_history for key in entry if key.startswith("env/failures/")}
    assert {"env/failures/exception", "env/failures/timeout", "env/failures/bad_result"} <= kinds


REPLIES = {
    "empty": "",
    "no_tags": "I will go right.",
    "nested": "<action>left<action>right</action></action>",
    "repeated": "<action>left</action><action>right</action>",
    "unterminated": "<think>hmm</think><action>right",
    "huge": "<action>" + "right " * 2000 + "</action>",
    "invalid_unicode": "<action>ri\ud800ght</action>",
    "not_admissible": "<think></think><action>fly to the moon</action>",
    "valid": "<think>go</think><action> RIGHT </action>",
}


def test_every_malformed_reply_is_parsed_deterministically():
    for name, reply in REPLIES.items():
        first, second = parse_reply(reply), parse_reply(reply)
        assert first == second, name
    # well-formed tags are valid even when the body is not an admissible action: the env
    # answers "Nothing happens." and the step earns nothing, as in GiGPO's projection
    valid = [name for name, reply in REPLIES.items() if parse_reply(reply).valid]
    assert valid == ["invalid_unicode", "not_admissible", "valid"]
    assert parse_reply(REPLIES["invalid_unicode"]).action == "ri?ght"  # the lone surrogate is replaced
    assert parse_reply(REPLIES["valid"]).key == "right"


def test_malformed_replies_reach_the_env_as_its_harmless_action():
    """A scripted policy answers each malformed reply in turn; the env never crashes,
    invalid steps are flagged (and later penalised), and the env receives "stay"."""
    names = list(REPLIES)
    sent = []

    def scripted(messages):
        replies = [REPLIES[names[len(sent) + i]] for i in range(len(messages))]
        sent.extend(replies)
        return Generation([[1]] * len(messages), [[2]] * len(messages), replies)

    tasks = [TaskRef(task_id=2, group=0)] * 1
    settings = RolloutSettings(max_turns=len(names), history_length=1, invalid_action="stay")
    with VectorEnv("tiny", 1) as envs:
        rollout = run_rollouts(envs, tasks, scripted, settings)
    assert [s.reply for s in rollout.steps] == [REPLIES[n] for n in names[: len(rollout.steps)]]
    for step in rollout.steps:
        assert step.valid == parse_reply(step.reply).valid
        if not step.valid:
            assert step.action == "stay"
    assert rollout.episodes[0].invalid_steps == sum(not s.valid for s in rollout.steps) == 6
    assert len(rollout.steps) == len(REPLIES)  # every reply reached the env
    assert not rollout.episodes[0].failed


@pytest.mark.slow
def test_hostile_env_text_reaches_the_model_as_bounded_plain_text(warm_policy, tmp_path):
    """Lone surrogates, chat control tokens, a 200,000-character task and 60 admissible
    actions of 4,000 characters: every episode trains, and every prompt fits the context."""
    model, tokenizer = warm_policy
    model.config.max_position_embeddings = 400  # a small context, so the token bound is what keeps prompts in it
    args = tiny_args(
        tmp_path, preset="gigpo", env_name="tests.reliability.faulty_envs:HostileTextEnv", env_kwargs={}, max_steps=1,
        tasks_per_iteration=len(HOSTILE), num_generations=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=len(HOSTILE), shuffle_dataset=False, evaluate_before_training=False, eval_tasks=1,
    )
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 1
    (rollout, advantages, _), = trainer.captured
    assert not any(e.failed for e in rollout.episodes) and len(rollout.steps) >= len(rollout.episodes)
    limit = 400 - args.max_completion_length
    assert all(len(s.prompt_ids) <= limit for s in rollout.steps)
    assert max(len(s.prompt_ids) for s in rollout.steps) == limit  # the huge task was cut to fit, not dropped
    # the env's "<|im_end|>" and "<|im_start|>" are text, not control tokens: each prompt holds the template's own
    control = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    template = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    expected = template.count("<|im_start|>") + template.count("<|im_end|>")
    for step in rollout.steps:
        assert sum(t in control for t in step.prompt_ids) == expected
    assert CONTROL_TOKENS not in tokenizer.decode(rollout.steps[0].prompt_ids)


def test_an_env_won_at_reset_counts_as_a_success():
    def never_called(messages):
        raise AssertionError("a finished episode needs no generation")

    with VectorEnv("tests.reliability.faulty_envs:WonAtResetEnv", 2) as envs:
        rollout = run_rollouts(envs, [TaskRef(0, 0), TaskRef(1, 0)], never_called, RolloutSettings(max_turns=3))
    assert [e.won for e in rollout.episodes] == [True, True] and not rollout.steps
    assert rollout.metrics()["episode/success_rate"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("max_steps,when", [(2, "all 2 generations of the run"), (6, "the last 3 generations")])
def test_a_run_whose_every_env_fails_stops_with_the_env_error(max_steps, when, warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path, env_name="tests.reliability.faulty_envs:AlwaysFailingEnv", env_kwargs={}, preset="grpo",
                     max_steps=max_steps, evaluate_before_training=False, eval_tasks=1)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    with pytest.raises(RuntimeError, match=f"Every episode of {when} failed.*engine is down.*env_kwargs") as error:
        trainer.train()
    trainer.close_envs()
    assert "AlwaysFailingEnv" in str(error.value)
    assert trainer.state.global_step == 2  # the 6-step run stops in its third failed generation in a row


def test_safe_text_and_fit_prompt_ids_on_hand_made_cases():
    from bipace_trainer.rollout.prompting import fit_prompt_ids, safe_text

    assert safe_text("a\ud800b") == "a?b"
    assert safe_text("x<|im_end|>y</s>[INST]<<SYS>><end_of_turn>") == "x< |im_end|>y< /s>[ INST]< <SYS>>< end_of_turn>"
    assert safe_text("if a < b | c > d: <action>go</action>") == "if a < b | c > d: <action>go</action>"  # not markup
    assert safe_text("abcdef", 3) == "abc [... 3 more characters cut]"
    assert fit_prompt_ids(range(10), 10) == list(range(10))
    # 12 ids into 9 with a 1-id marker: the first quarter of the 8 kept ids, the marker, the last 6
    assert fit_prompt_ids(range(12), 9, [99]) == [0, 1, 99, 6, 7, 8, 9, 10, 11]
