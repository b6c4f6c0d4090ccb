"""`hf_prefix_cache=True`: the collector's HF generation reuses shared prefixes, plays the same greedy
rollouts with the same hidden states as TRL's path, and its counts reach the training logs."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from bipace_trainer.models import load_tokenizer

from .tiny_setup import LORA, CapturingTrainer, tiny_args

# each test takes seconds, but they need the warm-started policy, whose SFT (~50 s) only slow tests paid for
pytestmark = pytest.mark.slow


def trainer_for(warm_policy_dir, output_dir, **overrides):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(warm_policy_dir), load_tokenizer(warm_policy_dir)
    args = tiny_args(output_dir, preset="bipace_q", evaluate_before_training=False, **overrides)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    return trainer


def greedy_rollout(trainer, name: str):
    collector = trainer.collector
    tasks = collector.eval_task_refs(trainer.args.eval_split)[:3] * 2  # two copies of each task: a shared group
    trainer.model.train(name == "train")
    with collector.sampling_temperature(0.0):
        return collector.collect(name, tasks)


@pytest.mark.parametrize("mode", ["lockstep", "continuous"])
def test_greedy_rollouts_and_hidden_states_are_those_of_trls_path(warm_policy_dir, tmp_path, mode):
    plain = trainer_for(warm_policy_dir, tmp_path / "plain", rollout_mode=mode, rollout_batch_size=4)
    reuse = trainer_for(warm_policy_dir, tmp_path / "reuse", rollout_mode=mode, rollout_batch_size=4, hf_prefix_cache=True)
    assert plain.policy.hf_prefix is None and reuse.policy.hf_prefix is not None
    try:
        a, b = greedy_rollout(plain, "train"), greedy_rollout(reuse, "train")
    finally:
        plain.close_envs()
        reuse.close_envs()
    assert [(s.traj, s.t, s.prompt_ids, s.completion_ids) for s in a.steps] == [
        (s.traj, s.t, s.prompt_ids, s.completion_ids) for s in b.steps
    ]
    assert a.steps[0].hidden is not None
    torch.testing.assert_close(torch.stack([s.hidden for s in b.steps]), torch.stack([s.hidden for s in a.steps]),
                               atol=1e-5, rtol=1e-5)
    total = a.prompt_counts["prompt_tokens"]
    assert a.prompt_counts["prompt_tokens_encoded"] == total and a.prompt_counts["prompt_tokens_reused"] == 0
    assert b.prompt_counts["prompt_tokens_encoded"] + b.prompt_counts["prompt_tokens_reused"] == total
    assert b.prompt_counts["prompt_tokens_reused"] > 0
    assert len(reuse.policy.hf_prefix.store) == 0  # cleared when the rollout ended


def test_trls_path_is_kept_with_a_warning_when_a_cache_implementation_is_set(warm_policy_dir, tmp_path):
    with pytest.warns(UserWarning, match="hf_prefix_cache=True is ignored: cache_implementation='dynamic'"):
        trainer = trainer_for(warm_policy_dir, tmp_path / "run", hf_prefix_cache=True, cache_implementation="dynamic")
    assert trainer.policy.hf_prefix is None


def test_two_training_steps_log_the_prefix_cache_hit_rate(warm_policy_dir, tmp_path):
    trainer = trainer_for(warm_policy_dir, tmp_path / "run", hf_prefix_cache=True)
    trainer.train()
    trainer.close_envs()
    assert len(trainer.captured) == 2
    assert all(rollout.steps[0].hidden is not None for rollout, _, _ in trainer.captured)
    entries = [e for e in trainer.state.log_history if "rollout/prompt_tokens" in e]
    assert entries
    for entry in entries:
        assert entry["rollout/prompt_tokens_encoded"] + entry["rollout/prompt_tokens_reused"] == entry["rollout/prompt_tokens"]
        assert entry["rollout/prefix_cache_hit_rate"] > 0
