"""The surface-variation learning run's report: success with intervals and paired differences to GiGPO.

    python -m studies.surface_learning.study studies/surface_learning/results/surface_tiny/learning_study_cpu-surface.json
    python -m studies.surface_learning.study --runs outputs/learning_textcraft_surface/textcraft/runs \
        --warm studies/surface_learning/results/textcraft_surface/learning_cpu-textcraft-surface_textcraft_warm.json
        # (a study still running)
    python -m studies.surface_learning.study --runs A/runs --warm A/warm.json --runs B/study.json --warm B/warm.json  # two warm starts

Reads a finished `studies.learning.study` result (e.g. `--size cpu-surface`, or
`--size cpu-textcraft-surface --set train_tasks=8`), or with `--runs` the runs a study still
running has finished (each run's JSON and the warm start's; `--runs` also takes a finished study's
JSON; `--runs`/`--warm` repeated: seeds that ran from different warm starts, each seed's runs from
one), and prints, per preset: training-batch success over the first and the last third of the
steps and the final held-out success, each as mean and 95% t-interval over seeds; the paired
difference to GiGPO (runs of one seed draw the same tasks at every step, so a preset's
training-batch success minus GiGPO's on the same seed, averaged over the second half, removes
how hard each step's tasks were), per seed and with its interval; the partitions' singleton
rates and the share of steps with a non-zero advantage; per seed, how many leading steps a run
shares with GRPO's of the same seed (same batch success, length and advantage spread: at a
variation where every hash cell is a singleton GiGPO's step term is 0 and its run is GRPO's
until two renderings collide); and the runs' wall time. Draws <json stem>_vs_gigpo.png next to
the JSON: the paired difference to GiGPO per step (mean over seeds) and held-out success.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from studies.learning.stats import curve_mean, paired_differences, paired_gap

BASELINE = "gigpo"
SAME_STEP_KEYS = ("train_success", "episode_length", "num_steps", "advantage_std")  # a step's batch, as logged


def interval(values: list[float]) -> dict[str, float]:
    """Mean and the 95% Student-t interval half-width over seeds (NaN half-width for one value)."""
    values = [float(v) for v in values if not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "half_width": math.nan, "n": 0}
    if len(values) == 1:
        return {"mean": values[0], "half_width": math.nan, "n": 1}
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": statistics.fmean(values), "half_width": float(half), "n": len(values)}


def _fmt(i: dict[str, float]) -> str:
    if not i["n"]:
        return "–"
    return f"{i['mean']:.3f}" if math.isnan(i["half_width"]) else f"{i['mean']:.3f} ± {i['half_width']:.3f}"


def steps_shared(run: dict[str, Any], other: dict[str, Any]) -> int:
    """How many leading steps of two runs logged the same batch (`SAME_STEP_KEYS` all equal)."""
    shared = 0
    for a, b in zip(run["curve"], other["curve"]):
        if any(a.get(key) != b.get(key) for key in SAME_STEP_KEYS):
            break
        shared += 1
    return shared


def summarise(runs: list[dict[str, Any]], validation: str) -> dict[str, Any]:
    """Per preset: success intervals, paired gaps to GiGPO, singleton rates."""
    baseline = {run["seed"]: run for run in runs if run["preset"] == BASELINE}
    grpo = {run["seed"]: run for run in runs if run["preset"] == "grpo"}
    out = {}
    for preset in dict.fromkeys(run["preset"] for run in runs):
        mine = sorted((run for run in runs if run["preset"] == preset), key=lambda run: run["seed"])
        third = max(len(mine[0]["curve"]) // 3, 1)
        train = lambda run, part: statistics.fmean(row["train_success"] for row in part(run["curve"]))  # noqa: E731
        finals = [[e for e in run["evals"] if e["split"] == validation][-1]["success_rate"] for run in mine]
        gaps = [paired_gap(run, baseline[run["seed"]]) for run in mine if run["seed"] in baseline]
        out[preset] = {
            "seeds": [run["seed"] for run in mine],
            "train_first": interval([train(run, lambda c: c[:third]) for run in mine]),
            "train_last": interval([train(run, lambda c: c[-third:]) for run in mine]),
            "heldout_final": interval(finals),
            "minus_gigpo_2nd_half": interval(gaps),
            "minus_gigpo_per_seed": gaps,
            "hash_singleton_rate": statistics.fmean(row["hash_singleton_rate"] for run in mine for row in run["curve"]),
            "hidden_singleton_rate": statistics.fmean(row["hidden_singleton_rate"] for run in mine for row in run["curve"]),
            "nonzero_advantage": curve_mean(mine, "nonzero_advantage"),
            "steps_shared_with_grpo": [steps_shared(run, grpo[run["seed"]]) for run in mine if run["seed"] in grpo],
            "seconds": [run["seconds"] for run in mine],
        }
    return out


def table(summary: dict[str, Any], warm: float | list[float]) -> str:
    """The summary as a Markdown table; `warm` is the warm start's held-out success (a list: one per warm start)."""
    warm_text = f"warm start {warm:.3f}" if isinstance(warm, float) else "warm starts " + " / ".join(f"{w:.3f}" for w in warm)
    lines = [
        "| preset | train success, first third | last third | held-out final ("
        f"{warm_text}) | − GiGPO, paired, 2nd half (per seed) | singletons hash / hidden | non-zero advantage "
        "| leading steps with GRPO's batch and advantages (per seed) | run s (mean, min–max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, s in summary.items():
        per_seed = ", ".join(f"{g:+.2f}" for g in s["minus_gigpo_per_seed"])
        gap = "—" if preset == BASELINE else f"{_fmt(s['minus_gigpo_2nd_half'])} ({per_seed})"
        lines.append(
            f"| `{preset}` | {_fmt(s['train_first'])} | {_fmt(s['train_last'])} | {_fmt(s['heldout_final'])} | {gap} "
            f"| {s['hash_singleton_rate']:.3f} / {s['hidden_singleton_rate']:.3f} | {s['nonzero_advantage']:.2f} "
            f"| {', '.join(map(str, s['steps_shared_with_grpo'])) or '–'} "
            f"| {statistics.fmean(s['seconds']):.0f} ({min(s['seconds']):.0f}–{max(s['seconds']):.0f}) |"
        )
    seeds = max(len(s["seeds"]) for s in summary.values())
    lines.append("\nMean ± 95% t-interval half-width over seeds." if seeds > 1 else "\nOne seed: single values, no interval.")
    seconds = [t for s in summary.values() for t in s["seconds"]]
    lines.append(f"{len(seconds)} runs, {sum(seconds) / 3600:.1f} run-hours in all (run s: each run's own wall time).")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], validation: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = {run["seed"]: run for run in runs if run["preset"] == BASELINE}
    fig, (gap_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4))
    presets = list(dict.fromkeys(run["preset"] for run in runs))
    color = {preset: f"C{i}" for i, preset in enumerate(presets)}  # one colour per preset in both panels
    for preset in presets:
        mine = [run for run in runs if run["preset"] == preset]
        diffs = np.array([paired_differences(run, baseline[run["seed"]]) for run in mine if run["seed"] in baseline])
        if len(diffs) and preset != BASELINE:
            kernel = np.ones(5) / 5  # 5-step moving average: one step's 16 episodes are noisy
            mean = np.convolve(diffs.mean(0), kernel, mode="valid")
            gap_ax.plot(np.arange(len(mean)) + 3, mean, label=preset, color=color[preset])
        evals = [[(e["step"], e["success_rate"]) for e in run["evals"] if e["split"] == validation] for run in mine]
        steps = [s for s, _ in evals[0]]
        eval_ax.plot(steps, np.mean([[v for _, v in e] for e in evals], 0), marker="o", label=preset, color=color[preset])
    gap_ax.axhline(0, color="black", lw=0.8)
    gap_ax.set(xlabel="step", ylabel="training success − GiGPO's (same seed)", title="paired with GiGPO (5-step mean)")
    eval_ax.set(xlabel="step", ylabel=f"{validation} success", title="held-out success (mean over seeds)")
    for ax in (gap_ax, eval_ax):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def warm_success(warm: dict[str, Any], validation: str) -> float:
    return next(e["success_rate"] for e in warm["evals"] if e["split"] == validation)


def report(env: str, validation: str, warm: dict[str, Any], runs: list[dict[str, Any]], plot_path: Path) -> dict[str, Any]:
    """Prints the table of one env's runs against its warm start's `validation` success and draws the plot."""
    summary = summarise(runs, validation)
    print(f"\n{env} ({validation}):\n{table(summary, warm_success(warm, validation))}")
    plot(runs, validation, plot_path)
    return summary


def report_groups(validation: str, groups: list[tuple[dict[str, Any], list[dict[str, Any]]]], plot_path: Path) -> dict[str, Any]:
    """Seeds that ran from different warm starts (`groups`: (warm start, its runs)): a table per warm start,
    then one over every seed. Each seed's presets share a warm start and its task draws, so the paired
    differences stay paired; the spread over seeds now also holds the warm starts' difference."""
    env = groups[0][0]["env"]
    for i, (warm, runs) in enumerate(groups):
        seeds = sorted({run["seed"] for run in runs})
        print(f"\n{env} ({validation}), warm start {i + 1} ({(warm.get('machine') or {}).get('platform', 'host unknown')}), "
              f"seeds {seeds}:\n{table(summarise(runs, validation), warm_success(warm, validation))}")
    runs = [run for _, mine in groups for run in mine]
    summary = summarise(runs, validation)
    print(f"\n{env} ({validation}), every seed:\n{table(summary, [warm_success(w, validation) for w, _ in groups])}")
    plot(runs, validation, plot_path)
    return summary


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The runs in a folder of `<preset>-seed<n>.json`, or in a finished learning_study JSON (its one env's)."""
    if path.is_dir():
        return [json.loads(run.read_text()) for run in sorted(path.glob("*-seed*.json"))]
    if not path.is_file():
        return []
    return [run for entry in json.loads(path.read_text()).get("envs", {}).values() for run in entry.get("runs", [])]


def read_groups(parser: argparse.ArgumentParser, args) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(warm start, runs) per `--runs`/`--warm` pair; a preset and seed in two folders is an error."""
    if len(args.warm or []) != len(args.runs):
        parser.error(f"--runs was given {len(args.runs)} times and --warm {len(args.warm or [])}: give each folder of runs "
                     "its warm start's JSON (learning_<size>_<env>_warm.json), in the same order")
    groups, seen = [], {}
    for runs_dir, warm_path in zip(args.runs, args.warm):
        runs = read_runs(runs_dir)
        if not runs:
            parser.error(f"--runs {runs_dir}: no <preset>-seed<n>.json in it" if runs_dir.is_dir() else
                         f"--runs {runs_dir}: neither a folder of runs nor a learning_study JSON with runs")
        for run in runs:
            key = (run["preset"], run["seed"])
            if key in seen:
                parser.error(f"--runs: {key[0]} seed {key[1]} is in both {seen[key]} and {runs_dir}; a seed's runs must "
                             "come from one warm start, keep one of them")
            seen[key] = runs_dir
        groups.append((json.loads(warm_path.read_text()), runs))
    if len({warm["env"] for warm, _ in groups}) > 1:
        parser.error(f"--warm: the warm starts are of different envs ({sorted({w['env'] for w, _ in groups})})")
    return groups


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, nargs="?", help="a learning_study JSON")
    parser.add_argument("--runs", type=Path, action="append", help="instead: a folder of finished runs' JSON (a study "
                        "still running: <work-dir>/<env>/runs, or a copy of them) or a finished study's JSON; repeat it "
                        "for seeds of another warm start")
    parser.add_argument("--warm", type=Path, action="append", help="with --runs: their warm start's JSON (once per --runs)")
    parser.add_argument("--split", default="valid", help="with --runs: the held-out split (default: valid)")
    parser.add_argument("--plot", type=Path, help="with --runs: the plot's path (default: <first --runs>/vs_gigpo.png)")
    args = parser.parse_args(argv)
    if args.runs:
        groups = read_groups(parser, args)
        plot_path = args.plot or args.runs[0] / "vs_gigpo.png"
        env = groups[0][0]["env"]
        if len(groups) == 1:
            warm, runs = groups[0]
            return {env: report(env, args.split, warm, runs, plot_path)}
        return {env: report_groups(args.split, groups, plot_path)}
    if not args.result:
        parser.error("give a learning_study JSON, or --runs and --warm")
    result = json.loads(args.result.read_text())
    return {
        env: report(env, entry["validation_split"], entry["warm_start"], entry["runs"],
                    args.result.with_name(f"{args.result.stem}_{env}_vs_gigpo.png"))
        for env, entry in result["envs"].items()
    }


if __name__ == "__main__":
    main()
