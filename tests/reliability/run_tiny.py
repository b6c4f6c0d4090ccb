"""A small seeded training run in its own process, for the interruption tests.

    python tests/reliability/run_tiny.py --model DIR --out OUT [--resume] [--slow-save-at N] [--fsize-limit-at N]

Trains the tiny policy for --steps optimizer steps with a checkpoint after every
step, then writes OUT/result.json (the per-step metrics, whether a signal stopped it)
and the final weights. `--slow-save-at N` stalls inside the save of step N, after
part of the checkpoint is written, and touches OUT/saving so a test can kill the
process mid-save. `--fsize-limit-at N` caps the size of every file the process writes
(RLIMIT_FSIZE, SIGXFSZ ignored) from the start of step N on: the save of checkpoint-N
finds no room, as on a full disk. A `CheckpointWriteError` is printed as one line with exit
code 1, as train.py does.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import AutoModelForCausalLM, Trainer  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from bipace_trainer import BiPACETrainer  # noqa: E402
from bipace_trainer.run.checkpointing import CheckpointWriteError  # noqa: E402
from bipace_trainer.models import load_tokenizer  # noqa: E402
from tests.trainer.tiny_setup import tiny_args  # noqa: E402

METRICS = ("loss", "grad_norm", "episode/success_rate", "episode/steps", "advantage/mean", "estimator/cluster_eps")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow-save-at", type=int, default=0)
    parser.add_argument("--pause-after-step", type=float, default=0.0, help="seconds, to give a test time to signal")
    parser.add_argument("--env", default="tiny", help="env_name (a dotted path to one of faulty_envs)")
    parser.add_argument("--env-step-timeout", type=float, default=60.0)
    parser.add_argument("--resample", type=int, default=0, help="resample_without_signal")
    parser.add_argument("--fsize-limit-at", type=int, default=0, help="step from which no file may grow past 64 KiB")
    cli = parser.parse_args()
    out = Path(cli.out)

    if cli.slow_save_at:
        save_rng_state = Trainer._save_rng_state

        def stalled_save(self, output_dir):
            if self.state.global_step == cli.slow_save_at:
                (out / "saving").touch()
                time.sleep(60)  # the test SIGKILLs us here, half-way through the checkpoint
            save_rng_state(self, output_dir)

        Trainer._save_rng_state = stalled_save

    model = AutoModelForCausalLM.from_pretrained(cli.model)
    tokenizer = load_tokenizer(cli.model)
    env = {} if cli.env == "tiny" else {"env_name": cli.env, "env_kwargs": {}}
    args = tiny_args(out, preset="bipace_q", max_steps=cli.steps, save_strategy="steps", save_steps=1,
                     evaluate_before_training=False, eval_tasks=2, learning_rate=2e-3,
                     env_step_timeout=cli.env_step_timeout, resample_without_signal=cli.resample, **env)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer)
    if cli.pause_after_step:
        from transformers import TrainerCallback

        class Pause(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                (out / f"step-{state.global_step}").touch()
                time.sleep(cli.pause_after_step)

        trainer.add_callback(Pause())
    if cli.fsize_limit_at:
        from transformers import TrainerCallback

        class DiskFull(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == cli.fsize_limit_at:
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
                    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

        trainer.add_callback(DiskFull())
    try:
        trainer.train(resume_from_checkpoint=get_last_checkpoint(str(out)) if cli.resume else None)
    except CheckpointWriteError as err:
        print(f"run_tiny.py: error: {err}", file=sys.stderr)
        sys.exit(1)
    trainer.close_envs()
    trainer.save_model(str(out / "final"))
    steps = [{k: e[k] for k in METRICS if k in e} | {"step": e["step"]} for e in trainer.state.log_history if "loss" in e]
    result = {"interrupted": trainer.interrupted, "global_step": trainer.state.global_step, "steps": steps,
              "cluster_eps": trainer.estimator.cluster_eps}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
