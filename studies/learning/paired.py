"""Paired-by-seed differences between presets, with 95% intervals, from finished study JSONs.

    python -m studies.learning.paired studies/learning/results/graphgpo_tiny/learning_study.json \
        --preset graphgpo bigraphgpo --against grpo gigpo hgpo
    python -m studies.learning.paired studies/learning/results/graphgpo_textcraft/learning_study_cpu-textcraft.json \
        studies/learning/results/textcraft_hgpo/learning_study_cpu-textcraft.json --at-step 10 \
        --preset graphgpo --against grpo gigpo hgpo

Runs of one seed draw the same tasks at every step, so the difference of two presets' runs of
one seed removes how hard those tasks were. Per pair of presets and seed: training-batch success
averaged over the last 5 steps (up to `--at-step`) and validation success at that step (the
last evaluation by default); then the mean difference over seeds with a Student-t 95% interval
(n − 1 degrees of freedom). Runs from several JSONs are pooled (a later file never replaces a
run already read); each run's host is in its JSON (`machine`). `--plot DIR` draws the pooled runs of
each env as the study does (`DIR/learning_<env>.png`, every preset on one figure, up to `--at-step`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from scipy import stats


def load_runs(paths: list[Path], env: str | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs of every file (of `env` only, if given), by (preset, seed); the first read wins."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        for name, data in json.loads(path.read_text())["envs"].items():
            if env is None or name == env:
                for run in data["runs"]:
                    runs.setdefault((run["preset"], run["seed"]), run)
    return runs


def measures(run: dict[str, Any], split: str, at_step: int | None) -> dict[str, float]:
    """Training-batch success over the last 5 steps up to `at_step`, and validation success there."""
    curve = [row for row in run["curve"] if at_step is None or row["step"] <= at_step]
    evals = [e for e in run["evals"] if e["split"] == split and (at_step is None or e["step"] <= at_step)]
    return {"train_last5": statistics.fmean(row["train_success"] for row in curve[-5:]),
            "validation": evals[-1]["success_rate"] if evals else math.nan}


def interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean and the Student-t 95% interval of paired differences."""
    n = len(differences)
    mean = statistics.fmean(differences)
    if n < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half


def table(runs, presets, against, split, at_step) -> str:
    lines = [f"| preset − baseline | seeds | train success, last 5 steps{' to step %d' % at_step if at_step else ''} "
             "| validation success |", "|---|---|---|---|"]
    for preset in presets:
        for base in against:
            if base == preset:
                continue
            seeds = sorted(s for p, s in runs if p == preset and (base, s) in runs)
            if not seeds:
                continue
            cells = []
            for key in ("train_last5", "validation"):
                diffs = [measures(runs[(preset, s)], split, at_step)[key] - measures(runs[(base, s)], split, at_step)[key]
                         for s in seeds]
                mean, low, high = interval(diffs)
                cells.append(f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]")
            lines.append(f"| `{preset}` − `{base}` | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", type=Path, nargs="+", help="learning_study*.json files (runs pooled)")
    parser.add_argument("--preset", nargs="+", required=True)
    parser.add_argument("--against", nargs="+", required=True)
    parser.add_argument("--split", default="valid", help="validation split (default: valid)")
    parser.add_argument("--at-step", type=int, help="compare up to this RL step (default: each run's end)")
    parser.add_argument("--plot", type=Path, help="draw the pooled runs of each env into DIR/learning_<env>.png")
    args = parser.parse_args()
    print(table(load_runs(args.studies), args.preset, args.against, args.split, args.at_step))
    if args.plot:
        plot_pooled(args.studies, args.plot, args.at_step)


def up_to(run: dict[str, Any], at_step: int | None) -> dict[str, Any]:
    """The run as it stood at `at_step` (its curve and evaluations up to it; None: the whole run)."""
    if at_step is None:
        return run
    return {**run, "curve": [row for row in run["curve"] if row["step"] <= at_step],
            "evals": [e for e in run["evals"] if e["step"] <= at_step]}


def plot_pooled(paths: list[Path], out: Path, at_step: int | None = None) -> None:
    """Each env's runs from every file (up to `at_step`: runs of different lengths draw alike), summarised and
    drawn with the first file's plan and warm start."""
    from studies.learning.plan import EnvPlan
    from studies.learning.report import plot_env
    from studies.learning.stats import summarise_env

    envs: dict[str, dict[str, Any]] = {}
    for path in paths:
        for name, env in json.loads(path.read_text())["envs"].items():
            envs.setdefault(name, env)
    out.mkdir(parents=True, exist_ok=True)
    for name, env in envs.items():
        runs = [up_to(run, at_step) for run in load_runs(paths, env=name).values()]
        # the splits every run evaluated: a short run (--validation-only) has only the validation split
        splits = tuple(split for split in env["plan"]["eval_splits"]
                       if all(any(e["split"] == split for e in run["evals"]) for run in runs))
        plan = EnvPlan(**{**env["plan"], "eval_splits": splits})
        plot_env(name, summarise_env(plan, env["warm_start"], runs), runs, out / f"learning_{name}.png")
        print(f"wrote {out / f'learning_{name}.png'}")


if __name__ == "__main__":
    main()
