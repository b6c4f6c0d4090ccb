"""Offline ALFWorld games: generation time and size, then reset/step/expert cost per task type.

    python -m bench.alfworld_gen                      # default sizes, 2 games per type and split
    python -m bench.alfworld_gen --train 24 --eval 8  # a bigger set
    python -m bench.alfworld_gen --out bench/results/alfworld_gen.json

Generates into a fresh temporary cache (so the time is a cold generation), then plays
`--games` games of every task type in each split with the planner expert, timing the first
reset of each game (load + reset), a replay reset (same game again), the mean step, and one
off-plan replan (after three random commands from the start). Every played game must be won.
Prints a table and writes JSON with the machine's load average (other jobs make timings noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from envs.alfworld import AlfWorldEnv
from envs.alfworld_gen import SPLITS, TASK_TYPES, generated_data_dir


def _size_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def _play(env: AlfWorldEnv, task_id: int, rng: random.Random) -> dict[str, float]:
    start = time.perf_counter()
    result = env.reset(task_id)
    first_reset = time.perf_counter() - start
    start = time.perf_counter()
    env.reset(task_id)
    replay_reset = time.perf_counter() - start

    step_times = []
    while not result.done and len(step_times) < 50:
        action = env.expert_action()
        start = time.perf_counter()
        result = env.step(action)
        step_times.append(time.perf_counter() - start)
    if not result.won:
        raise AssertionError(f"the expert did not win task {task_id}")

    result = env.reset(task_id)
    for _ in range(3):
        result = env.step(rng.choice(result.admissible_actions))
    start = time.perf_counter()
    env.expert_action()
    replan = time.perf_counter() - start
    return {
        "first_reset_s": first_reset,
        "replay_reset_s": replay_reset,
        "step_s": statistics.mean(step_times),
        "expert_steps": len(step_times),
        "replan_s": replan,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=12, help="train games per task type")
    parser.add_argument("--eval", type=int, default=4, help="valid_seen and valid_unseen games per task type")
    parser.add_argument("--games", type=int, default=2, help="games played per task type and split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="where to write the JSON")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        root = generated_data_dir(
            seed=args.seed, train_games_per_type=args.train, eval_games_per_type=args.eval, cache_dir=cache
        )
        generation = {
            "seconds": time.perf_counter() - start,
            "megabytes": _size_mb(root),
            "games": json.loads((root / "manifest.json").read_text())["games"],
        }
        print(f"generation: {generation['seconds']:.1f} s, {generation['megabytes']:.1f} MB, {generation['games']}")

        kwargs = {
            "source": "generated",
            "cache_dir": cache,
            "seed": args.seed,
            "train_games_per_type": args.train,
            "eval_games_per_type": args.eval,
        }
        env = AlfWorldEnv(**kwargs)
        rng = random.Random(args.seed)
        per_type: dict[str, list[dict[str, float]]] = {task_type: [] for task_type in TASK_TYPES}
        try:
            for split in SPLITS:
                specs = AlfWorldEnv.tasks(split, **kwargs)
                for task_type in TASK_TYPES:
                    chosen = [s for s in specs if s.attributes["task_type"] == task_type][: args.games]
                    per_type[task_type] += [_play(env, spec.task_id, rng) for spec in chosen]
        finally:
            env.close()

    summary = {}
    print(f"{'task type':32s} {'games':>5s} {'1st reset':>9s} {'replay':>7s} {'step':>7s} {'plan':>5s} {'replan':>12s}")
    for task_type, runs in per_type.items():
        row = {key: statistics.mean(run[key] for run in runs) for key in runs[0]}
        row["replan_max_s"] = max(run["replan_s"] for run in runs)
        summary[task_type] = row
        print(
            f"{task_type:32s} {len(runs):5d} {row['first_reset_s']:8.2f}s {row['replay_reset_s']:6.2f}s "
            f"{1000 * row['step_s']:5.0f}ms {row['expert_steps']:5.1f} {row['replan_s']:5.2f}s/{row['replan_max_s']:5.2f}s"
        )
    report = {"generation": generation, "per_task_type": summary, "load_average": os.getloadavg(), "args": vars(args)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
