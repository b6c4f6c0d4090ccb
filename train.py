"""Train a multi-turn text agent with step-level RL (GRPO, GiGPO, BiPACE, GAGPO).

    # the main job: embedded SmolLM2-135M-Instruct + LoRA, TextCraft, bipace_q, on CPU
    python train.py

    # any causal LM, any registered env, any preset; every config field is a flag
    python train.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --env alfworld --preset gigpo

    # a paper recipe, on GPUs with DeepSpeed ZeRO-2
    accelerate launch --config_file accelerate_config.yaml train.py --config recipes/alfworld_qwen2.5-1.5b_bipace_q.yaml
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from bipace_trainer import BiPACEConfig, BiPACETrainer  # noqa: E402
from bipace_trainer.models import load_tokenizer, resolve_model_name  # noqa: E402

# What `python train.py` with no arguments runs: a few minutes on a 2-core CPU. TextCraft
# prompts are long (~450 tokens of crafting commands), so the CPU budget is one task × 2
# rollouts × 3 turns per step; the recipes under recipes/ hold the papers' sizes.
MAIN_JOB_DEFAULTS = dict(
    output_dir="outputs/smollm2-textcraft-bipace_q",
    use_peft=True,
    lora_r=16,
    lora_alpha=32,
    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    learning_rate=5e-5,
    max_steps=2,
    tasks_per_iteration=1,
    num_generations=2,
    per_device_train_batch_size=2,
    max_turns=3,
    history_length=1,
    max_completion_length=40,
    eval_tasks=4,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)


@dataclass
class ScriptArguments:
    """Arguments of this script that are not training or model settings."""

    summary_file: str | None = field(
        default=None, metadata={"help": "Write the before/after evaluation summary as JSON to this path."}
    )


def check_cluster_layer(model_name: str, training_args: BiPACEConfig) -> None:
    """Fail before loading weights if `cluster_layer` is out of range for the model."""
    if training_args.estimator.partition != "hidden":
        return
    config = AutoConfig.from_pretrained(model_name, trust_remote_code=training_args.trust_remote_code)
    layers = config.get_text_config().num_hidden_layers
    if not -(layers + 1) <= training_args.cluster_layer <= layers:
        raise ValueError(
            f"cluster_layer={training_args.cluster_layer} is out of range for {model_name} ({layers} layers); "
            f"use -{layers + 1}..{layers} (output_hidden_states indexing, e.g. -8)."
        )


def main(script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig) -> dict:
    model_name = resolve_model_name(model_args.model_name_or_path)
    check_cluster_layer(model_name, training_args)
    remote = training_args.trust_remote_code
    tokenizer = load_tokenizer(model_name, revision=model_args.model_revision, trust_remote_code=remote)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_name,
        revision=model_args.model_revision,
        dtype=dtype,
        trust_remote_code=remote,
        attn_implementation=model_args.attn_implementation,
    )
    trainer = BiPACETrainer(
        model=model, args=training_args, processing_class=tokenizer, peft_config=get_peft_config(model_args)
    )
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
        if training_args.push_to_hub:
            trainer.push_to_hub(commit_message=f"{training_args.preset} on {training_args.env_name}")
    finally:
        trainer.close_envs()

    evals = {e["tag"]: e for e in trainer.eval_history}
    summary = {
        "model": model_args.model_name_or_path or "embedded SmolLM2-135M-Instruct",
        "env": training_args.env_name,
        "preset": training_args.preset,
        "steps": trainer.state.global_step,
        "success_before": evals.get("before", {}).get("success_rate"),
        "success_after": evals.get("final", {}).get("success_rate"),
        "per_type_after": evals.get("final", {}).get("per_type", {}),
        "output_dir": training_args.output_dir,
    }
    if trainer.accelerator.is_main_process:
        before, after = summary["success_before"], summary["success_after"]
        print("\n=== summary ===")
        print(f"{summary['model']} on {summary['env']} with {summary['preset']}, {summary['steps']} steps")
        if before is not None:
            print(f"success before training: {before:.3f}")
        print(f"success after training:  {after:.3f}" if after is not None else "no final evaluation")
        print(f"adapter and eval results: {training_args.output_dir}")
        if script_args.summary_file:
            with open(script_args.summary_file, "w") as f:
                json.dump(summary, f, indent=2)
    return summary


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, BiPACEConfig, ModelConfig))
    parser.set_defaults(**MAIN_JOB_DEFAULTS)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
    sys.exit(0)
