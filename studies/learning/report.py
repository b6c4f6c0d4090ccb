"""The learning study's report: one env's summary as printed tables and a learning-curve plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from studies.learning.plan import EnvPlan
from studies.learning.stats import PAIRED_BASELINE, paired_differences


def print_env(env: str, summary: dict[str, Any], plan: EnvPlan) -> None:
    validation = summary["validation_split"]
    starts = {e["split"]: e["success_rate"] for e in summary["warm_start"]["evals"]}
    print(f"\n== {env}: warm start " + ", ".join(f"{s} {v:.3f}" for s, v in starts.items()))
    extra = plan.eval_splits[1:]
    header = f"{'preset':<10}{validation + ' final':>20}{'peak':>16}" + "".join(f"{s + ' final':>20}" for s in extra)
    header += f"{'train first5 → last5':>24}{'− ' + PAIRED_BASELINE + ' (paired)':>20}{'+0.1 at step':>14}"
    header += f"{'hash singl.':>12}{'hidden singl.':>14}{'A≠0':>7}{'s/step':>8}"
    print(header)
    for preset, row in summary["presets"].items():
        fmt = lambda ms: f"{ms['mean']:.3f} ± {ms['std']:.3f}"  # noqa: E731
        reach = row["steps_to_gain"]["+0.1"]
        reach_text = f"{reach['steps']['mean']:.0f} ({reach['reached']}/{reach['runs']})" if reach["reached"] else "never"
        line = f"{preset:<10}{fmt(row['final'][validation]):>20}{fmt(row['peak']):>16}"
        line += "".join(f"{fmt(row['final'][s]):>20}" for s in extra)
        line += f"{row['train_success_first5']['mean']:.3f} → {row['train_success_last5']['mean']:.3f}".rjust(24)
        line += f"{fmt(row[f'train_success_minus_{PAIRED_BASELINE}_2nd_half']):>20}"
        line += f"{reach_text:>14}{row['hash_singleton_rate']:>12.3f}{row['hidden_singleton_rate']:>14.3f}"
        line += f"{row['nonzero_advantage']:>7.2f}{row['seconds_per_step']:>8.1f}"
        print(line)
    for split in plan.eval_splits:
        types = sorted({t for row in summary["presets"].values() for t in row["per_type_final_by_split"][split]})
        if not types:
            continue
        warm = next(e for e in summary["warm_start"]["evals"] if e["split"] == split)["per_type"]
        print(f"\n{split}, final success per task type (mean over seeds; warm start first)")
        width = max(len(t) for t in types) + 2
        print(f"{'preset':<10}" + "".join(f"{t:>{width}}" for t in types))
        print(f"{'warm':<10}" + "".join(f"{warm.get(t, math.nan):>{width}.3f}" for t in types))
        for preset, row in summary["presets"].items():
            cells = row["per_type_final_by_split"][split]
            print(f"{preset:<10}" + "".join(f"{cells[t]['mean'] if t in cells else math.nan:>{width}.3f}" for t in types))


def plot_env(env: str, summary: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    validation = summary["validation_split"]
    start = next(e["success_rate"] for e in summary["warm_start"]["evals"] if e["split"] == validation)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    baseline = {run["seed"]: run for run in runs if run["preset"] == PAIRED_BASELINE}
    for preset in summary["presets"]:
        mine = [run for run in runs if run["preset"] == preset]
        steps = [0] + [e["step"] for e in mine[0]["evals"] if e["split"] == validation]
        values = np.array([[start] + [e["success_rate"] for e in run["evals"] if e["split"] == validation] for run in mine])
        (line,) = axes[0, 0].plot(steps, values.mean(0), "o-", label=preset)
        axes[0, 0].fill_between(steps, values.mean(0) - values.std(0), values.mean(0) + values.std(0),
                                color=line.get_color(), alpha=0.15)
        for ax, key in ((axes[0, 1], "train_success"), (axes[1, 1], "nonzero_advantage")):
            series = np.array([[row[key] for row in run["curve"]] for run in mine]).mean(0)
            window = min(5, len(series))
            smooth = np.convolve(series, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, len(series) + 1), smooth, color=line.get_color(), label=preset)
        paired = [run for run in mine if run["seed"] in baseline]
        if paired and preset != PAIRED_BASELINE:
            gaps = np.array([paired_differences(run, baseline[run["seed"]]) for run in paired])
            window = min(5, gaps.shape[1])
            smooth = np.array([np.convolve(g, np.ones(window) / window, mode="valid") for g in gaps])
            x = np.arange(window, gaps.shape[1] + 1)
            axes[0, 2].plot(x, smooth.mean(0), color=line.get_color(), label=preset)
            axes[0, 2].fill_between(x, smooth.mean(0) - smooth.std(0), smooth.mean(0) + smooth.std(0),
                                    color=line.get_color(), alpha=0.12)
    for key, style in (("hash_singleton_rate", "-"), ("hidden_singleton_rate", "--")):
        series = np.array([[row[key] for row in run["curve"]] for run in runs])
        mean, std = np.nanmean(series, 0), np.nanstd(series, 0)
        steps = np.arange(1, series.shape[1] + 1)
        axes[1, 0].plot(steps, mean, style, color="black", label=key.split("_")[0] + " partition")
        axes[1, 0].fill_between(steps, mean - std, mean + std, color="grey", alpha=0.2)
    for branch, style in (("pace", "-"), ("loo", "--"), ("singleton", ":")):
        for partition, color in (("hash", "black"), ("hidden", "tab:red")):
            series = np.array([[row[f"{partition}_branch_{branch}"] for row in run["curve"]] for run in runs])
            axes[1, 2].plot(np.arange(1, series.shape[1] + 1), np.nanmean(series, 0), style, color=color,
                            label=f"{partition}: {branch}")
    axes[0, 2].axhline(0.0, color="grey", lw=1)
    axes[0, 0].set(title=f"validation success ({validation}), mean ± std over seeds", xlabel="step")
    axes[0, 1].set(title="training-batch success (5-step mean)", xlabel="step")
    axes[0, 2].set(title=f"training-batch success − {PAIRED_BASELINE}'s, same seed and tasks\n(5-step mean ± std over seeds)",
                   xlabel="step")
    axes[1, 0].set(title="singleton rate on the same batches (all runs)", xlabel="step", ylim=(0, 1))
    axes[1, 1].set(title="steps with a non-zero advantage (5-step mean)", xlabel="step")
    axes[1, 2].set(title="PACE-Q branch fractions on the same batches (all runs)", xlabel="step", ylim=(0, 1))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{env}: RL from one warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
