"""A real run records what the agent did: rollout dumps (training and evaluation) and TRL's
completions table, GAGPO's GAE terms in its dumps, and a dump that cannot be written never
stops training."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
from peft import LoraConfig

from bipace_trainer import BiPACETrainer
from bipace_trainer.rollout.trajectories import GAE_FIELDS

from .tiny_setup import LORA, tiny_args


def read_dump(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_dumps_and_completion_tables_show_every_step(warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path / "run", preset="bipace_q", rollout_dump_steps=1, log_completions=True,
                     num_completions_to_print=1)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.close_envs()
    run = tmp_path / "run"
    names = sorted(p.name for p in (run / "rollouts").iterdir())
    assert names == ["eval-before-step-000000.jsonl", "eval-final-step-000002.jsonl", "step-000001.jsonl", "step-000002.jsonl"]

    episodes = read_dump(run / "rollouts" / "step-000002.jsonl")
    assert len(episodes) == args.tasks_per_iteration * args.num_generations  # one line per episode
    gamma, penalty = args.estimator.step_gamma, args.estimator.invalid_action_penalty
    for episode in episodes:
        turns = episode["turns"]
        assert [t["turn"] for t in turns] == list(range(episode["turns_taken"])) and turns
        assert episode["invalid_steps"] == sum(not t["valid"] for t in turns)
        assert episode["won"] == (turns[-1]["reward"] > 0)  # the tiny env pays only on reaching the goal
        assert all(t["observation"] and t["branch"] in ("pace", "loo", "singleton") for t in turns)
        # R_t + p·invalid_t = r_t + γ (R_{t+1} + p·invalid_{t+1}): the penalty is not discounted back
        # (docs/concepts/math.md#step-returns)
        raw = [t["return"] + penalty * (not t["valid"]) for t in turns]
        for t in range(len(turns)):
            following = raw[t + 1] if t + 1 < len(turns) else 0.0
            assert raw[t] == pytest.approx(turns[t]["reward"] + gamma * following)

    # TRL's completions table of the same step holds the same steps, through TRL's own logging path
    # TRL's columns only (readable in a terminal); the rest of each step is in the dump
    table = pd.read_parquet(run / "completions" / "completions_00002.parquet")
    assert len(table) == sum(e["turns_taken"] for e in episodes)
    assert set(table.columns) == {"step", "prompt", "completion", "reward", "advantage"}
    dumped = sorted((t["prompt_tail"], t["reply"], round(t["advantage"], 5)) for e in episodes for t in e["turns"])
    assert sorted((row.prompt, row.completion, round(row.advantage, 5)) for row in table.itertuples()) == dumped
    assert all(row.prompt.strip() for row in table.itertuples())

    evaluation = read_dump(run / "rollouts" / "eval-final-step-000002.jsonl")
    final = trainer.eval_history[-1]
    assert len(evaluation) == final["num_tasks"] and {e["split"] for e in evaluation} == {"eval"}
    assert sum(e["won"] for e in evaluation) / len(evaluation) == final["success_rate"]
    assert all(t["advantage"] is None and t["return"] is not None for e in evaluation for t in e["turns"])


@pytest.mark.slow
def test_a_gagpo_run_dumps_the_gae_terms_that_redo_each_advantage(warm_policy, tmp_path):
    model, tokenizer = warm_policy
    run = tmp_path / "run"
    args = tiny_args(run, preset="gagpo", rollout_dump_steps=1, max_steps=1, evaluate_before_training=False, eval_tasks=2)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.close_envs()
    episodes = read_dump(run / "rollouts" / "step-000001.jsonl")
    discount = args.estimator.step_gamma * args.estimator.gae_lambda
    shared = 0
    for episode in episodes:
        turns = episode["turns"]
        for t, turn in enumerate(turns):
            gae = turn["gae"]
            assert list(gae) == list(GAE_FIELDS)
            # V̄(s_{t+1}) is the next turn's V̄, 0 after the last (no bootstrap by default)
            assert gae["next_value"] == (turns[t + 1]["gae"]["value"] if t + 1 < len(turns) else 0.0)
            assert gae["delta"] == pytest.approx(turn["reward"] + args.estimator.step_gamma * gae["next_value"] - gae["value"])
            discounted = sum(discount**k * later["gae"]["delta"] for k, later in enumerate(turns[t:]))
            assert gae["discounted_sum"] == pytest.approx(discounted, abs=1e-9)
            redone = (discounted - gae["penalty"] - gae["group_mean"]) / (gae["group_std"] + 1e-6) if gae["shared"] else 0.0
            assert turn["advantage"] == pytest.approx(redone, abs=1e-6)  # w_ep = 0, w_step = 1
            shared += gae["shared"]
    assert shared, "the tiny env's anchors repeat within a task group"
    evaluation = read_dump(run / "rollouts" / "eval-final-step-000001.jsonl")
    assert all(turn["gae"] is None for e in evaluation for turn in e["turns"])  # not trained on: no advantage


@pytest.mark.slow
def test_a_failing_dump_never_stops_training(warm_policy, tmp_path, caplog):
    model, tokenizer = warm_policy
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollouts").write_text("a file where the dump folder should be")
    args = tiny_args(run, preset="gigpo", rollout_dump_steps=1, max_steps=2, evaluate_before_training=False)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    with caplog.at_level(logging.WARNING, logger="bipace_trainer.rollout.trajectories"):
        trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 2 and trainer.eval_history[-1]["tag"] == "final"
    failures = [r.getMessage() for r in caplog.records if "Rollout dump" in r.getMessage()]
    assert len(failures) == 3  # steps 1 and 2 and the final evaluation, each skipped with a warning
    assert "training continues" in failures[0]
