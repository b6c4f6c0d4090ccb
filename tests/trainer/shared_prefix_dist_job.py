"""One optimizer step of the tiny setup with `shared_prefix` on, then the same step with it off, run by
test_shared_prefix_distributed.py under `accelerate launch` (DDP or DeepSpeed ZeRO-2, 2 CPU processes).

The optimizer is plain SGD at learning rate 1 without clipping, so each LoRA weight's change is the
(rank-averaged) gradient: <out>/rank<k>_<on|off>.pt holds the changes, the logged loss and the
shared-prefix forward's counters. Both runs play the same episodes (same seed, same weights).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from bipace_trainer import BiPACETrainer  # noqa: E402
from tests.trainer.tiny_setup import lora_state, make_model, make_tokenizer, tiny_args  # noqa: E402


class FixedAdvantageTrainer(BiPACETrainer):
    """Gives each row a fixed, non-zero advantage: the tiny untrained policy wins no episode, so the
    estimator's advantages would all be 0 and the step would move nothing."""

    def on_scored(self, scored):
        advantages = scored.batch["advantages"]
        scored.batch["advantages"] = torch.linspace(-1.0, 1.0, advantages.numel()).to(advantages.device)
        return scored._replace(signal=True)


def run(out: str, shared: bool, tokenizer) -> dict:
    model = make_model(tokenizer, seed=0)
    args = tiny_args(
        out, max_steps=1, num_generations=4, tasks_per_iteration=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, max_completion_length=8, eval_tasks=2, evaluate_before_training=False,
        shuffle_dataset=False, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=1e9,
        shared_prefix=shared, temperature=1.0,
    )
    trainer = FixedAdvantageTrainer(
        model, args=args, processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False),
    )
    before = lora_state(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train()
    after = lora_state(trainer.accelerator.unwrap_model(trainer.model))
    trainer.close_envs()
    forward = trainer.shared_prefix
    return {
        "delta": {name: after[name] - before[name] for name in before},
        "loss": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "stats": dict(forward.stats) if forward is not None else None,
        "enabled": forward is not None and forward.enabled,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rank": trainer.accelerator.process_index,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    tokenizer = make_tokenizer()
    for shared in (True, False):
        result = run(cli.out, shared, tokenizer)
        torch.save(result, Path(cli.out, f"rank{result['rank']}_{'on' if shared else 'off'}.pt"))
    os._exit(0)  # skip slow interpreter teardown of gloo/DeepSpeed groups


if __name__ == "__main__":
    main()
