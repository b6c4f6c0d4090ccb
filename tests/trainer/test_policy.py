"""The rollout's `Policy`: a plain model (`ModelPolicy`, what `bipace-eval` plays with) generates what
TRL's generation inside the trainer (`TRLPolicy`) generates, and `bipace-eval` builds no trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import set_seed
from trl import GRPOTrainer

from bipace_trainer import BiPACETrainer
from bipace_trainer.cli import evaluate
from bipace_trainer.rollout.loop import TaskRef
from bipace_trainer.rollout.policy import ModelPolicy

FLAGS = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--split", "valid", "--max_turns", "3", "--history_length", "1",
         "--max_completion_length", "12", "--seeds", "1", "--episodes_per_task", "2", "--chunk_size", "4",
         "--no_progress", "--use_cpu", "--temperature", "1.0"]  # fmt: skip


def _panel(settings) -> list[TaskRef]:
    from envs.base import resolve_env_class

    specs = resolve_env_class("tiny").tasks("valid", **settings.env_kwargs)[:2]
    return [TaskRef(spec.task_id, group=i, attributes=spec.attributes) for i, spec in enumerate(specs) for _ in range(2)]


def _played(collector, panel, temperature: float):
    set_seed(11)
    with collector.sampling_temperature(temperature):
        rollout = collector.collect("eval", panel)
    return [(s.traj, s.t, s.prompt_ids, s.completion_ids, s.reply) for s in rollout.steps]


def _trainer_config(settings, output_dir: Path):
    """A training run's config with the evaluation's values (`bipace-eval` itself builds none)."""
    from bipace_trainer import BiPACEConfig

    return BiPACEConfig(
        output_dir=str(output_dir), env_name=settings.env, env_kwargs=settings.env_kwargs, max_turns=settings.max_turns,
        history_length=settings.history_length, max_completion_length=settings.max_completion_length,
        eval_split="valid", rollout_batch_size=settings.rollout_batch_size, preset="grpo", num_generations=2,
        per_device_train_batch_size=2, max_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=settings.seeds[0], use_cpu=True, bf16=False,
    )  # fmt: skip


def test_a_plain_models_policy_plays_what_the_trainers_policy_plays(raw_tiny_dir, tmp_path):
    settings = evaluate.parse_args([str(raw_tiny_dir), *FLAGS, "--output_dir", str(tmp_path)])
    trainer = BiPACETrainer(model=str(raw_tiny_dir), args=_trainer_config(settings, tmp_path / "trainer"))
    plain = evaluate.ModelEvaluation(evaluate.resolve_model(str(raw_tiny_dir)), settings, tmp_path / "plain", "valid")
    try:
        assert isinstance(plain.policy, ModelPolicy) and not isinstance(plain.policy, type(trainer.policy))
        assert plain.policy.eos_token_ids == trainer.eos_token_ids
        panel = _panel(settings)
        trainer.model.eval()
        for temperature in (0.0, 1.0):  # greedy, then sampled from the same seed
            by_trainer = _played(trainer.collector, panel, temperature)
            by_plain = _played(plain.collector, panel, temperature)
            assert by_trainer and by_plain == by_trainer
    finally:
        trainer.close_envs()
        plain.close()


def test_bipace_eval_builds_no_trainer_and_no_config(raw_tiny_dir, tmp_path, monkeypatch):
    from trl import GRPOConfig

    def refuse(what):
        def refused(self, *args, **kwargs):
            raise AssertionError(f"bipace-eval built a {what}")

        return refused

    monkeypatch.setattr(GRPOTrainer, "__init__", refuse("trainer"))
    monkeypatch.setattr(GRPOConfig, "__post_init__", refuse("training config"))  # BiPACEConfig's runs through it
    settings = evaluate.parse_args([str(raw_tiny_dir), *FLAGS, "--output_dir", str(tmp_path)])
    result = evaluate.run(settings, progress=lambda line: None)
    overall = result["models"][0]["splits"]["valid"]["overall"]
    assert overall["episodes"] == 4  # 2 tasks x 2 episodes, one seed
    assert (Path(tmp_path) / result["models"][0]["label"] / evaluate.EPISODES_FILE).is_file()


def test_the_plain_policy_fits_long_prompts_to_the_context(raw_tiny_dir):
    from bipace_trainer.models import load_tokenizer
    from bipace_trainer.rollout.policy import generation_config_for
    from transformers import AutoModelForCausalLM

    model, tokenizer = AutoModelForCausalLM.from_pretrained(raw_tiny_dir), load_tokenizer(raw_tiny_dir)
    context = model.config.max_position_embeddings
    settings = evaluate.parse_args([str(raw_tiny_dir), *FLAGS])
    config = generation_config_for(evaluate.run_values(settings), tokenizer, [tokenizer.eos_token_id], max_new_tokens=12)
    policy = ModelPolicy(model, tokenizer, config, 12)
    long = [[{"role": "user", "content": "go left " * context}]]
    (ids,) = policy.tokenize(long)
    whole = tokenizer.apply_chat_template(long[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) <= context - 12 < len(whole)
    out = policy.generate([ids])
    assert len(out.completion_ids) == 1 and out.logprobs is None and out.hidden is None
    assert torch.is_tensor(policy.forward_hidden([ids], -1)) and policy.forward_hidden([ids], -1).shape[0] == 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sampling_settings_are_restored_after_the_block(raw_tiny_dir, temperature):
    from bipace_trainer.models import load_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    model, tokenizer = AutoModelForCausalLM.from_pretrained(raw_tiny_dir), load_tokenizer(raw_tiny_dir)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.3)
    policy = ModelPolicy(model, tokenizer, config)
    with policy.sampling(temperature):
        assert policy.generation_config.do_sample is (temperature > 0)
    assert policy.generation_config is config and config.temperature == 1.3 and config.do_sample
