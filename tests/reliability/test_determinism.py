"""Two runs with the same seed on CPU give identical rollouts, advantages and weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bipace_trainer.models import load_tokenizer

from tests.trainer.tiny_setup import CapturingTrainer, tiny_args


def run(model_dir, output_dir, seed):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
    args = tiny_args(output_dir, preset="bipace_q", max_steps=3, seed=seed, evaluate_before_training=False, eval_tasks=2)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    replies = [[s.reply for s in rollout.steps] for rollout, _, _ in trainer.captured]
    advantages = [a for _, a, _ in trainer.captured]
    return replies, advantages, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
def test_same_seed_same_run(warm_policy_dir, tmp_path):
    first = run(warm_policy_dir, tmp_path / "a", seed=3)
    second = run(warm_policy_dir, tmp_path / "b", seed=3)
    assert first[0] == second[0]  # rollouts, reply by reply
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])
    other = run(warm_policy_dir, tmp_path / "c", seed=4)
    assert other[0] != first[0]  # the seed matters: the test would notice a constant policy


def test_an_evaluation_leaves_the_random_streams_where_it_found_them():
    import random

    import numpy as np

    from bipace_trainer.run.evaluation import untouched_random_streams

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    without = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    with untouched_random_streams():
        sampled = draws()  # what the evaluation sampled, from the same streams
    assert sampled == without and draws() == without  # training then draws as if nothing had run
