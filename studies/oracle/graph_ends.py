"""How often a failed episode ends in a state its task group visited, and what GraphGPO's step advantages do with it.

    OMP_NUM_THREADS=1 python -m studies.oracle.graph_ends --source scripted --env textcraft
    OMP_NUM_THREADS=1 python -m studies.oracle.graph_ends --source scripted --env alfworld
    OMP_NUM_THREADS=1 python -m studies.oracle.graph_ends --source model --env textcraft
    OMP_NUM_THREADS=1 python -m studies.oracle.graph_ends --source model --env alfworld --max-turns 15
    python -m studies.oracle.graph_ends --report studies/oracle/results/graph_ends/*.json

GraphGPO's graph joins the steps of a task group into one state graph; a failed trajectory's
last step leads to the state of the env's final observation (verl-agent's `next_obs`), which the
rollout records (`Episode.final_anchor`, `StepBatch.next_anchor`). Before it did, every failed
last step led to a dead end of its own. The two rules differ exactly where the final observation
is a state some step of the group was taken from ("known"): this counts those ends and the step
advantages of `graphgpo` (its preset defaults: γ = 0.1, mean ÷ std, w_ep = 1) that change from one
rule to the other, on real play:

- `--source scripted`: the oracle study's behaviour policies (`truth.truth_rollouts`: the env's
  expert action with probability p, else a random admissible or plausible command), G = 8
  rollouts per task, the oracle study's turn budgets (TextCraft 30, ALFWorld 50);
- `--source model`: the embedded SmolLM2-135M-Instruct, played by the trainer's own rollout
  collector (`BiPACETrainer.collector`, no update) with `python train.py`'s settings and warm start:
  TextCraft's shipped adapter, ALFWorld's trained here by `--warm_start_steps` (the CLI's code)
  or one an earlier run trained (`--warm-start-from`).

Env-failed episodes leave the batch as they do in training (`penalize_env_failures=False`).
Writes one JSON per (source, env) under `--out` with every batch's counts and the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench import common
from bipace_trainer.advantages import estimate_advantages, resolve_settings

OUT = Path("studies/oracle/results/graph_ends")
CHANGED = 1e-4  # an advantage that moved by more than float32 noise
SCRIPTED = {  # the oracle study's sizes: tasks per batch, turn budget, seeds, expert probabilities
    "textcraft": dict(tasks=4, max_turns=30, seeds=(0, 1, 2, 3, 4), expert_probs=(0.2, 0.5, 0.7, 0.9), env_kwargs={}),
    "alfworld": dict(tasks=2, max_turns=50, seeds=(0, 1), expert_probs=(0.2, 0.5, 0.7, 0.9), env_kwargs={"source": "auto"}),
}


def end_counts(rollout) -> dict[str, Any]:
    """One batch: how its failed trajectories ended, and the `graphgpo` step advantages that change
    when their recorded ends replace the dead-end rule."""
    trained = rollout.without_failed_episodes()
    batch = trained.step_batch()
    settings = resolve_settings("graphgpo")
    recorded = estimate_advantages(batch, settings)
    dead_end = estimate_advantages(dataclasses.replace(batch, next_anchor=None), settings)
    change = (recorded.advantage - dead_end.advantage).abs()
    shared = torch.bincount(recorded.cell)[recorded.cell] > 1  # rows whose step term can be non-zero
    d = recorded.diagnostics
    episodes = rollout.episodes
    return {
        "episodes": len(episodes),
        "won": sum(e.won for e in episodes),
        "truncated": sum(e.truncated and not e.won for e in episodes),
        "env_failed": sum(e.failed for e in episodes),
        "failed_ends": int(d.get("graph/failed_ends", 0)),
        "failed_ends_known": int(d.get("graph/failed_ends_known", 0)),
        "groups_without_success": len({e.group for e in episodes} - {e.group for e in episodes if e.won}),
        "steps": len(batch),
        "steps_in_shared_cells": int(shared.sum()),
        "steps_changed": int((change > CHANGED).sum()),
        "max_change": float(change.max()) if len(batch) else 0.0,
    }


def scripted_batches(env: str) -> list[dict[str, Any]]:
    """The oracle study's behaviour policies: every (seed, p) batch of `SCRIPTED[env]`."""
    from studies.oracle.study import task_ids
    from studies.oracle.truth import TRUTH, truth_rollouts

    size = SCRIPTED[env]
    truth = TRUTH[env]()
    batches = []
    listed = task_ids(env, size["tasks"] * len(size["seeds"]), size["env_kwargs"])
    for index, seed in enumerate(size["seeds"]):  # each seed its own tasks
        ids = listed[index * size["tasks"]:][: size["tasks"]]
        for p in size["expert_probs"]:
            start = time.perf_counter()
            played = truth_rollouts(env, ids, group_size=8, expert_prob=p, max_turns=size["max_turns"], seed=seed,
                                    env_kwargs=size["env_kwargs"], truth=truth)  # fmt: skip
            batches.append({"seed": seed, "expert_prob": p, "task_ids": ids, **end_counts(played.rollout),
                            "seconds": time.perf_counter() - start})  # fmt: skip
            print(json.dumps(batches[-1]), flush=True)
    return batches


def model_batches(
    env: str, num_batches: int, tasks: int, flags: list[str], work_dir: Path, save: Callable[..., None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The embedded model with `python train.py`'s settings and warm start, `num_batches` training
    generations of `tasks` task groups × 8 rollouts, played by the trainer's collector (no update).
    `save(batches, extra)` runs after every batch: a run cut short keeps the batches it played."""
    from bipace_trainer.cli.train import build_trainer, parse_args

    argv = ["--env", env, "--preset", "graphgpo", "--output_dir", str(work_dir / env), "--num_generations", "8",
            "--tasks_per_iteration", str(tasks), "--evaluate_before_training", "false", *flags]  # fmt: skip
    script_args, training_args, model_args = parse_args(argv)
    trainer, warm_start = build_trainer(script_args, training_args, model_args)
    rows = list(trainer.train_dataset)
    settings = {key: getattr(training_args, key) for key in ("max_turns", "history_length", "max_completion_length",
                                                              "temperature", "env_kwargs")}  # fmt: skip
    extra = {"argv": argv, "settings": settings, "warm_start": warm_start}
    batches: list[dict[str, Any]] = []
    try:
        for index in range(num_batches):
            drawn = random.Random(f"graph_ends/{env}/{index}").sample(rows, tasks)
            refs = trainer.collector.task_refs([row for row in drawn for _ in range(8)], group_size=8)
            start = time.perf_counter()
            with trainer.collector.sampling_temperature(training_args.temperature):
                played = trainer.collector.collect("train", refs)
            batches.append({"batch": index, "task_ids": [ref.task_id for ref in refs[::8]], **end_counts(played),
                            "seconds": time.perf_counter() - start})  # fmt: skip
            print(json.dumps(batches[-1]), flush=True)
            save(batches, extra)
    finally:
        trainer.close_envs()
    return batches, extra


def totals(batches: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("episodes", "won", "truncated", "env_failed", "failed_ends", "failed_ends_known", "groups_without_success",
            "steps", "steps_in_shared_cells", "steps_changed")  # fmt: skip
    out: dict[str, Any] = {key: sum(b[key] for b in batches) for key in keys}
    out["max_change"] = max((b["max_change"] for b in batches), default=0.0)
    out["batches"] = len(batches)
    out["batches_with_a_change"] = sum(b["steps_changed"] > 0 for b in batches)
    return out


def report(paths: list[Path]) -> str:
    """The markdown table of docs/results/graphgpo.md: one row per JSON."""
    lines = [
        "| play | episodes (won / cut / lost by the env) | failed last steps | of them in a known state | steps | "
        "steps whose advantage changed (> 1e-4) | largest change |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        result = json.loads(Path(path).read_text())
        t = result["totals"]
        lost = t["episodes"] - t["won"] - t["truncated"] - t["env_failed"]
        known = f"{t['failed_ends_known']} ({t['failed_ends_known'] / max(t['failed_ends'], 1):.0%})"
        changed = f"{t['steps_changed']} ({t['steps_changed'] / max(t['steps'], 1):.1%}; {t['batches_with_a_change']} of {t['batches']} batches)"
        lines.append(
            f"| {result['source']} {result['env']} {result.get('name', '')}".rstrip() + f" | {t['episodes']} ({t['won']} / {t['truncated']} / {lost}) | "
            f"{t['failed_ends']} | {known} | {t['steps']} | {changed} | {t['max_change']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("scripted", "model"), default="scripted")
    parser.add_argument("--env", choices=("textcraft", "alfworld"), default="textcraft")
    parser.add_argument("--batches", type=int, default=4, help="model: training generations played")
    parser.add_argument("--tasks", type=int, default=2, help="model: task groups per generation (8 rollouts each)")
    parser.add_argument("--max-turns", type=int, default=None, help="model: the turn budget (default: train.py's)")
    parser.add_argument("--warm-start-steps", type=int, default=32, help="model, alfworld: SFT steps of its warm start")
    parser.add_argument("--warm-start-from", default=None, help="model, alfworld: a warm start an earlier run trained (its folder)")
    parser.add_argument("--name", default="", help="a suffix for the JSON's name (another setting of one source and env)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/graph_ends"))
    parser.add_argument("--report", nargs="+", type=Path, help="print the table of finished runs and exit")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    start = time.perf_counter()
    path = args.out / f"graph_ends_{args.source}_{args.env}{'_' + args.name if args.name else ''}.json"

    def save(batches: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        result = {
            "source": args.source, "env": args.env, "name": args.name, "preset": "graphgpo", "changed_above": CHANGED,
            **extra, "totals": totals(batches), "batches": batches, "seconds": time.perf_counter() - start,
            "machine": common.machine(),
        }  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))

    if args.source == "scripted":
        save(scripted_batches(args.env), {"settings": {**SCRIPTED[args.env], "group_size": 8}})
    else:
        flags = ["--max_turns", str(args.max_turns)] if args.max_turns else []
        if args.env != "textcraft" and args.warm_start_from:  # one an earlier run of this command trained
            flags += ["--warm_start_from", args.warm_start_from]
        elif args.env != "textcraft":  # the shipped adapter is TextCraft's: train this env's own (the CLI's code)
            flags += ["--warm_start_from", "", "--warm_start_steps", str(args.warm_start_steps)]
        save(*model_batches(args.env, args.batches, args.tasks, flags, args.work_dir, save))
    print(report([path]))
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
