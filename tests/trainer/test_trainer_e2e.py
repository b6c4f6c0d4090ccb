"""End to end on the tiny env and a tiny warm-started model: two training steps per preset."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from bipace_trainer import BiPACETrainer
from bipace_trainer.advantages import PRESETS, compute_advantages

from .tiny_setup import LORA, CapturingTrainer, lora_state, tiny_args

@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_two_training_steps(preset, warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path / "run", preset=preset)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    initial = lora_state(trainer.model)
    trainer.train()

    assert len(trainer.captured) == 2  # one generation per optimizer step (GA = steps_per_generation)
    for rollout, advantages, batch in trainer.captured:
        steps = len(rollout.steps)
        # one training sample per env step, padded rows carry no loss
        assert steps == sum(e.length for e in rollout.episodes) > 0
        rows = batch["advantages"].shape[0]
        assert rows % args.steps_per_generation == 0 and rows >= steps
        assert batch["completion_mask"][steps:].sum() == 0
        assert torch.equal(batch["advantages"][:steps].cpu(), advantages)
        # finite, and what the estimator module gives on the same records
        assert torch.isfinite(advantages).all()
        eps = trainer.estimator.cluster_eps
        expected, _ = compute_advantages(rollout.step_batch(), args.estimator, cluster_eps=eps)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
    assert any(advantages.abs().sum() > 0 for _, advantages, _ in trainer.captured)

    final = lora_state(trainer.model)
    assert any(not torch.equal(initial[n], final[n]) for n in initial), "LoRA weights did not change"

    logged = {k for entry in trainer.state.log_history for k in entry}
    for key in ("episode/success_rate", "episode/invalid_action_rate", "episode/env_failures", "time/rollout_s",
                "time/generate_s", "time/estimator_s", "advantage/std", "eval/success_rate"):
        assert key in logged, key
    if args.estimator.step_partition != "none":
        assert "estimator/singleton_rate" in logged
    if args.estimator.step_partition == "hidden":
        assert "estimator/cluster_eps" in logged
    if args.estimator.uses_milestones:  # the tiny env's milestone flags reached the estimator (BEACON)
        assert {"milestone/per_episode", "milestone/step_frac"} <= logged
    if args.estimator.step_baseline == "hierarchy":  # HGPO's per-level diagnostics reach the logs
        assert {"hierarchy/level0/cell_size_mean", "hierarchy/deepest_level0_frac", "hierarchy/no_level_frac"} <= logged

    trainer.close_envs()


@pytest.mark.slow
def test_saved_adapter_reloads_with_the_trained_weights(warm_policy, warm_policy_dir, tmp_path):
    model, tokenizer = warm_policy
    trainer = BiPACETrainer(model, args=tiny_args(tmp_path / "run", preset="gigpo"), processing_class=tokenizer,
                            peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    trainer.close_envs()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_policy_dir), tmp_path / "adapter")
    trained = {n.replace(".default", ""): p for n, p in lora_state(trainer.model).items()}
    restored = {n.replace(".default", ""): p for n, p in lora_state(reloaded).items()}
    assert trained.keys() == restored.keys() and trained
    for name in trained:
        torch.testing.assert_close(restored[name], trained[name])
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


@pytest.mark.slow
def test_kl_reference_and_off_policy_ratios(warm_policy, tmp_path):
    """beta > 0 needs ref_per_token_logps (LoRA: the base model with the adapter off);
    gradient_accumulation_steps < steps_per_generation needs old_per_token_logps."""
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path / "run", preset="bipace_q", beta=0.04, gradient_accumulation_steps=1, max_steps=2)
    assert args.steps_per_generation == 2
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    (rollout, _, batch), = trainer.captured  # two optimizer steps on one generation
    rows = len(rollout.steps)
    mask = batch["completion_mask"][:rows].bool()
    # before any update the adapter is a no-op: policy, old and reference log-probs agree
    torch.testing.assert_close(batch["old_per_token_logps"][:rows][mask], batch["ref_per_token_logps"][:rows][mask])
    logged = [entry for entry in trainer.state.log_history if "kl" in entry]
    assert len(logged) == 2 and logged[0]["kl"] == pytest.approx(0.0, abs=1e-6) and logged[1]["kl"] > 0


def test_train_tasks_trains_on_the_first_tasks_of_the_split(raw_tiny_dir, tmp_path):
    from bipace_trainer.models import load_tokenizer
    from envs.base import resolve_env_class

    # which tasks are played needs no skill: the model as initialised (the warm policy's SFT stays out of the fast subset)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(raw_tiny_dir), load_tokenizer(raw_tiny_dir)
    args = tiny_args(tmp_path / "run", train_tasks=3, max_steps=1)
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    trainer.train()
    first = [spec.task_id for spec in resolve_env_class("tiny").tasks("train", **args.env_kwargs)][:3]
    assert trainer.train_dataset["task_id"] == first
    rollout = trainer.captured[0][0]
    assert {episode.task_id for episode in rollout.episodes} <= set(first)
    trainer.close_envs()
