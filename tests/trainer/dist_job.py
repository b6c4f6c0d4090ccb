"""A two-step training job on the tiny setup, run by test_distributed.py under `accelerate launch`.

Each rank writes <out>/rank<k>.json: the tasks of every task group it rolled out, the
generate calls it made per rollout, its episode lengths and its optimizer step count.
Tasks with an even id end after one turn (`RankSkewEnv`), and the data order puts
them all on rank 0, so rank 0 runs out of active envs first and must keep joining the
collective generate calls of rank 1 (ZeRO-3 gathers parameters inside each call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peft import LoraConfig  # noqa: E402

from bipace_trainer import BiPACETrainer  # noqa: E402
from envs.tiny import TinyEnv  # noqa: E402
from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args  # noqa: E402


class RankSkewEnv(TinyEnv):
    """The tiny env, except that even task ids end after one step (won or not)."""

    def reset(self, task_id: int):
        self.task_id = task_id
        return super().reset(task_id)

    def step(self, action: str):
        result = super().step(action)
        if self.task_id % 2 == 0 and not result.done:
            self.done = True
            result = self._result("Time is up.")
        return result


class RecordingTrainer(BiPACETrainer):
    records: list = []

    def on_rollout(self, rollout, advantages, diagnostics):
        groups = {}
        for episode in rollout.episodes:  # one per task this rank rolled out
            groups.setdefault(episode.group, set()).add(episode.task_id)
        self.records.append(
            {
                "groups": [sorted(ids) for _, ids in sorted(groups.items())],
                "generate_calls": rollout.generate_calls,
                "episode_lengths": [e.length for e in rollout.episodes],
                "samples": len(rollout.steps),
            }
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="bipace_q")
    parser.add_argument("--rollout_mode", default="lockstep")
    cli = parser.parse_args()
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=0)
    args = tiny_args(
        cli.out,
        env_name="tests.trainer.dist_job:RankSkewEnv",
        env_kwargs={},
        preset=cli.preset,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        eval_tasks=2,
        evaluate_before_training=False,
        shuffle_dataset=False,
        learning_rate=1e-3,
        rollout_mode=cli.rollout_mode,
    )
    trainer = RecordingTrainer(
        model, args=args, processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    trainer.train()
    trainer.close_envs()
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "global_step": trainer.state.global_step,
        "rollouts": RecordingTrainer.records,
        "final_eval": trainer.eval_history[-1] if trainer.eval_history else None,
    }
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip slow interpreter teardown of gloo/DeepSpeed groups


if __name__ == "__main__":
    main()
