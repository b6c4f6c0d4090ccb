"""The learning study's statistics: from finished runs to one env's summary (JSON-able).

Success is read from the runs' evaluations (final, peak, steps to reach the warm start +
a gain) and from their per-step curves (training-batch success, singleton rates, branch
fractions, advantage spread), as mean ± std over seeds (`common.mean_std`). Runs of one
seed draw the same tasks at every step, so training-batch success is also compared with
the paired baseline's step by step (`paired_differences`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench import common
from studies.learning.plan import EnvPlan

GAINS = (0.05, 0.1, 0.2)  # steps to reach warm-start success + gain
PAIRED_BASELINE = "grpo"  # training-batch success is also reported as a difference to it, seed by seed


def final_and_peak(run: dict[str, Any], split: str) -> tuple[float, float]:
    curve = [e["success_rate"] for e in run["evals"] if e["split"] == split]
    return curve[-1], max(curve)


def steps_to_gain(run: dict[str, Any], split: str, target: float) -> int | None:
    return next((e["step"] for e in run["evals"] if e["split"] == split and e["success_rate"] >= target), None)


def window_mean(run: dict[str, Any], window: slice) -> float:
    return statistics.fmean(row["train_success"] for row in run["curve"][window])


def paired_differences(run: dict[str, Any], baseline: dict[str, Any]) -> list[float]:
    """Step by step, run's − baseline's training-batch success.

    Runs with the same seed draw the same tasks at every step, so the difference removes
    how hard each step's tasks are, which dominates a 2-task batch's success.
    """
    return [a["train_success"] - b["train_success"] for a, b in zip(run["curve"], baseline["curve"])]


def paired_gap(run: dict[str, Any], baseline: dict[str, Any]) -> float:
    """`paired_differences` averaged over the second half of the steps."""
    differences = paired_differences(run, baseline)
    return statistics.fmean(differences[len(differences) // 2:])


def curve_mean(runs: list[dict[str, Any]], key: str) -> float:
    values = [row[key] for run in runs for row in run["curve"] if not math.isnan(row[key] if row[key] is not None else math.nan)]
    return statistics.fmean(values) if values else math.nan


CURVE_KEYS = (  # per-step curve values, averaged over every step of a preset's runs
    "train_success",
    "hash_singleton_rate",
    "hidden_singleton_rate",
    "hidden_eps",
    "hidden_branch_pace",
    "hidden_branch_loo",
    "hidden_branch_singleton",
    "hash_branch_pace",
    "hash_branch_loo",
    "hash_branch_singleton",
    "advantage_std",
    "nonzero_advantage",
)


def summarise_env(plan: EnvPlan, warm: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One env's summary: the warm start, and per preset every statistic above over its seeds."""
    validation = plan.eval_splits[0]
    start = next(e["success_rate"] for e in warm["evals"] if e["split"] == validation)
    presets = {}
    baseline = {run["seed"]: run for run in runs if run["preset"] == PAIRED_BASELINE}
    for preset in dict.fromkeys(run["preset"] for run in runs):
        mine = [run for run in runs if run["preset"] == preset]
        gaps = [paired_gap(run, baseline[run["seed"]]) for run in mine if run["seed"] in baseline]
        finals = {split: [final_and_peak(run, split)[0] for run in mine] for split in plan.eval_splits}
        per_type: dict[str, dict[str, list[float]]] = {split: {} for split in plan.eval_splits}
        for run in mine:
            for split in plan.eval_splits:
                final = [e for e in run["evals"] if e["split"] == split][-1]
                for key, value in (final["per_type"] or {}).items():
                    per_type[split].setdefault(key, []).append(value)
        steps_to = {}
        for gain in GAINS:
            reached = [s for s in (steps_to_gain(run, validation, start + gain) for run in mine) if s is not None]
            steps_to[f"+{gain:g}"] = {"steps": common.mean_std(reached), "reached": len(reached), "runs": len(mine)}
        presets[preset] = {
            "final": {split: common.mean_std(values) for split, values in finals.items()},
            "peak": common.mean_std([final_and_peak(run, validation)[1] for run in mine]),
            # training-batch success (sampled at the rollout temperature): first and last 5 steps of each run
            "train_success_first5": common.mean_std([window_mean(run, slice(None, 5)) for run in mine]),
            "train_success_last5": common.mean_std([window_mean(run, slice(-5, None)) for run in mine]),
            f"train_success_minus_{PAIRED_BASELINE}_2nd_half": common.mean_std(gaps),
            "per_type_final": {key: common.mean_std(values) for key, values in sorted(per_type[validation].items())},
            "per_type_final_by_split": {
                split: {key: common.mean_std(values) for key, values in sorted(types.items())}
                for split, types in per_type.items()
            },
            "steps_to_gain": steps_to,
            **{key: curve_mean(mine, key) for key in CURVE_KEYS},
            "seconds_per_step": statistics.fmean(run["timing"].get("step_time", math.nan) for run in mine),
            "timing": {k: statistics.fmean(run["timing"].get(k, math.nan) for run in mine) for k in mine[0]["timing"]},
        }
    return {"validation_split": validation, "warm_start": warm, "presets": presets}
