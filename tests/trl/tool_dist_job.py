"""One training step and a final evaluation of TRL's envs on two processes, run by
tests/trl/test_tool_path.py under `accelerate launch` (DDP with gloo, or ZeRO-3; CPU).

The policy is the session's tool-calling tiny model (`--model`, the `tool_policy_dir`
fixture's directory); the env is `as_trl_environment("tiny")`, and a user reward function
rides along with its `get_reward`. The evaluation has 3 tasks, so the ranks' shards differ
(2 and 1), and a second one has 1 (rank 1 plays none): TRL's reward calculation gathers
over ranks, which such shards would break.
Each rank writes <out>/rank<k>.json: its optimizer steps, the task groups and generate calls
of its training rollout, and the evaluation summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import AutoModelForCausalLM  # noqa: E402

from bipace_trainer import BiPACEConfig, BiPACETrainer  # noqa: E402
from bipace_trainer.models import load_tokenizer  # noqa: E402
from bipace_trainer.run.evaluation import play_evaluation  # noqa: E402
from envs import as_trl_environment, trl_task_dataset  # noqa: E402
from tests.trl.tool_model import TINY_KWARGS  # noqa: E402


def fewer_turns(completions, **kwargs):
    """A user reward function: a small cost per assistant turn."""
    return [-0.01 * sum(m["role"] == "assistant" for m in completion) for completion in completions]


class RecordingTrainer(BiPACETrainer):
    records: list = []

    def on_rollout(self, rollout, advantages, diagnostics):
        groups = {}
        for episode in rollout.episodes:
            groups.setdefault(episode.group, set()).add(episode.task_id)
        self.records.append({
            "groups": [sorted(ids) for _, ids in sorted(groups.items())],
            "generate_calls": rollout.generate_calls,
            "episodes": [{"reward": e.reward, "failed": e.failed} for e in rollout.episodes],
        })


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    cli = parser.parse_args()
    data = trl_task_dataset("tiny", **TINY_KWARGS)
    args = BiPACEConfig(
        output_dir=cli.out, preset="gigpo", max_steps=1, tasks_per_iteration=2, num_generations=2,
        per_device_train_batch_size=2, max_turns=3, max_turn_length=40, max_completion_length=1024, max_tool_calling_iterations=3,
        learning_rate=1e-3, temperature=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        seed=0, disable_tqdm=True, shuffle_dataset=False, evaluate_before_training=False, eval_tasks=3,
        eval_rollouts_per_task=1,
    )
    trainer = RecordingTrainer(
        model=AutoModelForCausalLM.from_pretrained(cli.model), args=args, processing_class=load_tokenizer(cli.model),
        train_dataset=data.select(range(4)), eval_dataset=data.select(range(4, 7)),
        environment_factory=as_trl_environment("tiny", **TINY_KWARGS), reward_funcs=fewer_turns,
    )
    trainer.train()
    # one task on two ranks: rank 1 plays none and must not wait on rank 0's rewards (the rollout's settings are
    # values fixed when the trainer was built, so the panel is cut here rather than by changing eval_tasks)
    one_task = play_evaluation(trainer.collector, trainer.eval_task_refs()[:1], temperature=args.eval_temperature,
                               step=trainer.state.global_step, tag="one_task", split=args.eval_split, seed=args.seed,
                               model=trainer.model)
    trainer.close_envs()
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
        "global_step": trainer.state.global_step,
        "rollouts": RecordingTrainer.records,
        "final_eval": trainer.eval_history[-1] if trainer.eval_history else None,
        "one_task_eval": one_task,
    }
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip slow interpreter teardown of gloo groups


if __name__ == "__main__":
    main()
