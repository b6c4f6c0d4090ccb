"""Training with `rollout_mode="continuous"`: the same records and logs as lockstep, and a
repeatable run under a seed."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from bipace_trainer.advantages import compute_advantages
from bipace_trainer.models import load_tokenizer

from .tiny_setup import LORA, CapturingTrainer, lora_state, tiny_args


def train(model_and_tokenizer, output_dir, **overrides):
    model, tokenizer = model_and_tokenizer
    args = tiny_args(output_dir, preset="bipace_q", rollout_mode="continuous", rollout_batch_size=3,
                     evaluate_before_training=False, **overrides)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    initial = lora_state(trainer.model)
    trainer.train()
    trainer.close_envs()
    return trainer, args, initial


@pytest.mark.slow
def test_two_training_steps_with_continuous_rollouts(warm_policy, tmp_path):
    trainer, args, initial = train(warm_policy, tmp_path / "run")
    assert trainer.collector.settings.mode == "continuous"
    assert len(trainer.captured) == 2
    for rollout, advantages, batch in trainer.captured:
        steps = len(rollout.steps)
        assert steps == sum(e.length for e in rollout.episodes) > 0
        assert len(rollout.episodes) == args.tasks_per_iteration * args.num_generations
        assert [(s.t, s.traj) for s in rollout.steps] == sorted((s.t, s.traj) for s in rollout.steps)  # lockstep's order
        assert rollout.steps[0].hidden is not None  # hidden states captured in prefill, per call
        assert torch.equal(batch["advantages"][:steps].cpu(), advantages)
        expected, _ = compute_advantages(rollout.step_batch(), args.estimator, cluster_eps=trainer.estimator.cluster_eps)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
    final = lora_state(trainer.model)
    assert any(not torch.equal(initial[n], final[n]) for n in initial)
    logged = {k for entry in trainer.state.log_history for k in entry}
    for key in ("rollout/engine_idle_share", "rollout/env_wait_share", "rollout/prompt_tokens",
                "rollout/prompt_tokens_shared", "eval/success_rate"):
        assert key in logged, key
    # HF generate prefills every prompt token: all encoded, none reused
    for entry in trainer.state.log_history:
        if "rollout/prompt_tokens" in entry:
            assert entry["rollout/prompt_tokens_encoded"] == entry["rollout/prompt_tokens"] > 0
            assert entry["rollout/prompt_tokens_reused"] == 0 and entry["rollout/prefix_cache_hit_rate"] == 0


@pytest.mark.slow
def test_a_seed_repeats_a_continuous_training_run(warm_policy_dir, tmp_path):
    def replies(name):
        policy = (AutoModelForCausalLM.from_pretrained(warm_policy_dir), load_tokenizer(warm_policy_dir))
        trainer, _, _ = train(policy, tmp_path / name, max_steps=1)
        return [(s.traj, s.t, s.completion_ids, s.reward) for rollout, _, _ in trainer.captured for s in rollout.steps]

    assert replies("a") == replies("b")
