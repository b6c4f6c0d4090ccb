"""A tiny, offline, randomly initialised policy for the tiny env, its warm start, and the
trainer settings the end-to-end tests share.

The tokenizer is a byte-level BPE trained here on the tiny env's own text, and the
model a 2-layer Qwen2 built from its config: nothing is downloaded. `warm_start`
fine-tunes it with TRL's SFTTrainer on demonstrations of uniformly random admissible
moves, so it replies in the `<think></think><action>…</action>` format but walks
at random: success is then partial, and only RL can raise it.
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.run.demonstrations import collect_demonstrations
from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from envs.tiny import TinyEnv

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TINY_ENV_KWARGS = {"size": 4}
HISTORY_LENGTH = 1  # the warm start and the RL runs must build the same prompts


def make_tokenizer() -> PreTrainedTokenizerFast:
    rows = collect_demonstrations(
        "tiny", range(12), env_kwargs=TINY_ENV_KWARGS, expert_prob=0.5, max_turns=4, history_length=HISTORY_LENGTH
    )
    corpus = [r["prompt"][0]["content"] + r["completion"][0]["content"] for r in rows]
    corpus.append("Nothing happens. You moved left. You moved right. You reached the goal! stay")
    return bpe_chat_tokenizer(corpus, vocab_size=1500)


def make_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 2, **heads) -> Qwen2ForCausalLM:
    return tiny_qwen2(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed, **heads)


def warm_start(model, tokenizer, output_dir: str, *, expert_prob: float = 0.0, max_steps: int = 60, seed: int = 0):
    """SFT on perturbed-expert demonstrations of the tiny env; returns the model."""
    from trl import SFTConfig, SFTTrainer

    rows = collect_demonstrations(
        "tiny", range(len(TinyEnv.tasks("train", **TINY_ENV_KWARGS)) + 2), env_kwargs=TINY_ENV_KWARGS,
        expert_prob=expert_prob, episodes_per_task=6, max_turns=4, history_length=HISTORY_LENGTH, seed=seed,
    )
    dataset = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    args = SFTConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=8, learning_rate=5e-3,
        logging_steps=20, save_strategy="no", report_to="none", use_cpu=True, seed=seed, lr_scheduler_type="constant",
        disable_tqdm=True,
    )
    SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    return model


class StopAfter(TrainerCallback):
    """Stops training once `step` optimizer steps are done (an interrupted run, for resume tests)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


class CapturingTrainer(BiPACETrainer):
    """Keeps each generation's rollout, advantages and training batch in `captured`, whether its
    update was skipped in `skipped_updates`, and the hidden states of the estimator's input (None
    when nothing was captured: the rollout's steps carry those of prefill capture, not those of
    TRL's old-logprob pass under vLLM) in `captured_hidden`, for inspection."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skipped_updates, self.captured_hidden = [], []
        estimate = self.estimator.estimate

        def recorded(batch, **kwargs):
            self._estimated_hidden = batch.hidden
            return estimate(batch, **kwargs)

        self.estimator.estimate = recorded

    def on_rollout(self, rollout, advantages, diagnostics):
        self._seen = (rollout, advantages.clone())

    def generate_and_score(self, inputs):
        output = super().generate_and_score(inputs)
        self.captured.append((*self._seen, dict(output)))
        self.skipped_updates.append(self._skip_update)
        self.captured_hidden.append(getattr(self, "_estimated_hidden", None))
        return output


def tiny_args(output_dir, **overrides) -> BiPACEConfig:
    values = dict(
        output_dir=str(output_dir),
        env_name="tiny",
        env_kwargs=TINY_ENV_KWARGS,
        max_steps=2,
        tasks_per_iteration=2,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_turns=4,
        history_length=HISTORY_LENGTH,
        max_completion_length=16,
        eval_tasks=4,
        cluster_layer=-1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # float32 on the CPU (GRPOConfig's default would autocast to bf16 there)
        learning_rate=5e-3,
        seed=0,
    )
    values.update(overrides)
    return BiPACEConfig(**values)


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
