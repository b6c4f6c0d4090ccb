"""Evaluate main-job adapters on the held-out goals with more episodes than the main job can afford.

    OMP_NUM_THREADS=1 python -m bench.main_job_eval warm_starts/smollm2-135m-textcraft outputs/smollm2-textcraft-bipace_q

The main job evaluates each of its 8 held-out goals once before and once after RL (its
10-minute budget); one episode per goal cannot tell a rise of a few points from noise.
This script plays each held-out goal `--rollouts` times with each adapter given (the shipped
warm start, a main job's output dir: anything `--warm_start_from` takes), through the
trainer's own evaluation (`BiPACETrainer.evaluate_policy`) with the main job's settings
(`train.parse_args([])`: env, goal filter, turn budget, history, evaluation temperature),
and prints each success rate with its 95% Wilson interval. About 7 minutes per adapter and
6 rollouts on one thread of a 2-core machine. Flags it does not know go to train.py's parser
(`--model_name_or_path`, `--env`, ...), so the same check runs for another model or env.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from bipace_trainer.run_summary import evaluation_summary, format_evaluation  # noqa: E402
from train import build_trainer, parse_args  # noqa: E402


def evaluate(adapter: str, rollouts: int, split: str, train_flags: list[str] = ()) -> dict:
    """The main job's evaluation of `split` with `adapter`, each goal played `rollouts` times
    (`train_flags` go to train.py's parser first)."""
    with tempfile.TemporaryDirectory() as out:
        flags = [*train_flags, "--warm_start_from", adapter, "--output_dir", out, "--eval_tasks", "0",
                 "--eval_rollouts_per_task", str(rollouts), "--disable_tqdm", "true"]  # fmt: skip
        script_args, training_args, model_args = parse_args(flags)
        trainer, _ = build_trainer(script_args, training_args, model_args)  # as train.py loads it
        try:
            result = trainer.evaluate_policy(tag="bench", split=split)
        finally:
            trainer.close_envs()
        return result | {"temperature": training_args.eval_temperature}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", help="adapter folders (what --warm_start_from takes)")
    parser.add_argument("--rollouts", type=int, default=6, help="episodes per held-out goal")
    parser.add_argument("--split", default="valid", help="the env split to play (the main job's held-out: valid)")
    args, train_flags = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    results = []
    for adapter in args.adapters:
        start = time.perf_counter()
        result = evaluate(adapter, args.rollouts, args.split, train_flags)
        label = f"{adapter} ({args.split}, temperature {result['temperature']})"
        print(f"{format_evaluation(label, evaluation_summary(result))}; {time.perf_counter() - start:.0f} s", flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
