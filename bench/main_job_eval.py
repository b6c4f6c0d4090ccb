"""Evaluate main-job adapters on the held-out goals with more episodes than the main job can afford.

    OMP_NUM_THREADS=1 python -m bench.main_job_eval warm_starts/smollm2-135m-textcraft outputs/smollm2-textcraft-bipace_q

The main job evaluates each of its 8 held-out goals once before and once after RL (its
10-minute budget); one episode per goal cannot tell a rise of a few points from noise.
This script plays each held-out goal `--rollouts` times (default 6: seeds 123, 456 and 789,
twice each) with each adapter given (the shipped warm start, a main job's output dir: anything
`bipace-eval` takes), with the main job's settings (`train.parse_args([])`: env, goal filter,
turn budget, history, reply length, evaluation temperature), through `bipace-eval`
(`bipace_trainer.cli.evaluate`, which plays through the trainer's own `evaluate_policy`). It prints
each success rate with its 95% Wilson interval and, for two adapters, their paired difference
on the same goals and seeds; results and episodes land in `--output_dir` (rerun to resume).
About 7 minutes per adapter and 6 rollouts on one thread of a 2-core machine. Flags it does not
know go to train.py's parser (`--model_name_or_path`, `--env`, ...), so the same check runs for
another model or env.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from bipace_trainer.cli import evaluate  # noqa: E402
from bipace_trainer.cli.evaluate import PROTOCOLS  # noqa: E402
from bipace_trainer.cli.train import parse_args  # noqa: E402


def eval_flags(adapters: list[str], split: str, seeds: list[int], per_seed: int, output_dir: str,
               train_flags: list[str] = ()) -> list[str]:  # fmt: skip
    """`bipace-eval`'s flags for the main job's settings (`train_flags` go to train.py's parser first)."""
    _, training_args, model_args = parse_args(list(train_flags))
    flags = [*adapters, "--env", training_args.env_name, "--env_kwargs", json.dumps(training_args.env_kwargs),
             "--split", split, "--max_turns", str(training_args.max_turns),
             "--history_length", str(training_args.history_length),
             "--max_completion_length", str(training_args.max_completion_length),
             "--temperature", str(training_args.eval_temperature), "--seeds", *map(str, seeds),
             "--episodes_per_task", str(per_seed), "--output_dir", output_dir]  # fmt: skip
    if model_args.model_name_or_path not in (None, "", "embedded"):
        flags += ["--base_model", model_args.model_name_or_path]
    if model_args.dtype:
        flags += ["--dtype", model_args.dtype]
    if training_args.use_cpu:
        flags.append("--use_cpu")
    return flags


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", help="one or two adapter folders (what --warm_start_from takes)")
    parser.add_argument("--rollouts", type=int, default=6, help="episodes per held-out goal, a multiple of the seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(PROTOCOLS["textcraft"].seeds))
    parser.add_argument("--split", default="valid", help="the env split to play (the main job's held-out: valid)")
    parser.add_argument("--output_dir", default="outputs/main_job_eval", help="results and episodes (rerun: resume)")
    args, train_flags = parser.parse_known_args(argv)
    if args.rollouts % len(args.seeds):
        parser.error(f"--rollouts {args.rollouts}: must be a multiple of the {len(args.seeds)} seeds")
    torch.set_num_threads(1)
    flags = eval_flags(args.adapters, args.split, args.seeds, args.rollouts // len(args.seeds), args.output_dir, train_flags)
    result = evaluate.run(evaluate.parse_args(flags), progress=lambda line: print(line, flush=True))
    print(result["markdown"])
    temperature = result["protocol"]["temperature"]
    return [
        model["splits"][args.split]["overall"] | {"num_tasks": model["splits"][args.split]["overall"]["episodes"],
                                                 "temperature": temperature, "label": model["label"]}
        for model in result["models"]
    ]  # fmt: skip


if __name__ == "__main__":
    main()
