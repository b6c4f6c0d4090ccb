"""Three training steps on 2 ranks with a fault on rank 1, run by test_distributed_faults.py.

    accelerate launch --config_file CONFIG tests/reliability/dist_fault_job.py --out OUT --fault hang|kill

`hang`: rank 1's first env step hangs for an hour (the default serial backend must end
it at env_step_timeout). `kill`: rank 1 SIGKILLs itself at its first env step after
checkpoint-1 exists. Each rank that finishes writes <out>/rank<k>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peft import LoraConfig  # noqa: E402

from bipace_trainer import BiPACETrainer  # noqa: E402
from envs.tiny import TinyEnv  # noqa: E402
from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args  # noqa: E402

STEP_TIMEOUT = 5.0


class RankFaultEnv(TinyEnv):
    fired = False

    def step(self, action: str):
        fault, rank = os.environ["RANK_FAULT"], int(os.environ.get("RANK", "0"))
        if rank == 1 and not RankFaultEnv.fired:
            if fault == "hang":
                RankFaultEnv.fired = True
                time.sleep(3600)
            elif fault == "kill" and Path(os.environ["FAULT_OUT"], "checkpoint-1").exists():
                RankFaultEnv.fired = True
                os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", choices=["hang", "kill"], required=True)
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()
    os.environ.update(RANK_FAULT="none" if cli.resume else cli.fault, FAULT_OUT=cli.out)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=0)
    args = tiny_args(
        cli.out, env_name="tests.reliability.dist_fault_job:RankFaultEnv", env_kwargs={}, preset="grpo",
        num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=3,
        max_completion_length=8, eval_tasks=2, evaluate_before_training=False, save_strategy="steps", save_steps=1,
        env_step_timeout=STEP_TIMEOUT, ddp_timeout=60, learning_rate=1e-3,
    )
    trainer = BiPACETrainer(
        model, args=args, processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    trainer.close_envs()
    rank = trainer.accelerator.process_index
    result = {"global_step": trainer.state.global_step, "log": trainer.state.log_history}
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip slow interpreter teardown of gloo/DeepSpeed groups


if __name__ == "__main__":
    main()
