"""What a run shows at its end: success with its 95% interval, the valid-action rate, and a learning curve.

    low, high = wilson_interval(successes=3, n=8)           # 95% Wilson score interval
    curve = learning_curve(trainer.state.log_history)     # per RL step: batch success, valid rate, loss, ...
    plot_learning_curve(curve, "outputs/run/learning_curve.png")

The interval is Wilson's score interval (Wilson 1927, https://doi.org/10.1080/01621459.1927.10502953):
with p̂ = k/n and z = 1.96,

    centre = (p̂ + z²/2n) / (1 + z²/n),   half = z √(p̂(1−p̂)/n + z²/4n²) / (1 + z²/n),

which, unlike p̂ ± z√(p̂(1−p̂)/n), stays inside [0, 1] and is not empty at 0 or n successes:
what an evaluation of 8 episodes needs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "wilson_interval", "learning_curve", "plot_learning_curve", "evaluation_summary", "format_evaluation", "CURVE_FILE",
    "EVAL_MARKERS", "eval_marker", "intervals_overlap",
]

CURVE_FILE = "learning_curve.png"

# log_history key -> curve column, per RL step (TRL logs the step's metrics under these names)
_COLUMNS = {
    "episode/success_rate": "batch_success",
    "episode/invalid_action_rate": "invalid_rate",
    "loss": "loss",
    "train/skipped_batches": "skipped",
    "advantage/std": "advantage_std",
    # with resample_without_signal: retries, and success over every episode the step played
    "train/resamples": "resamples",
    "episode/success_rate_all_played": "played_success",
}


# The held-out evaluations' markers by occasion (matplotlib's, plotly's), so "before" and "final"
# read apart on the learning curve and in the report; any other occasion gets the last.
EVAL_MARKERS = {"before": ("o", "circle-open"), "interval": ("s", "square"), "final": ("D", "diamond"), "": ("P", "cross")}


def eval_marker(tag: Any, library: int) -> str:
    """The marker of an evaluation occasion (`EVAL_MARKERS`): `library` 0 for matplotlib, 1 for plotly."""
    return EVAL_MARKERS.get(tag, EVAL_MARKERS[""])[library]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% (z = 1.96) Wilson score interval of a success rate from `successes` of `n` episodes."""
    if n <= 0:
        raise ValueError(f"n={n}: an interval needs at least one episode.")
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must lie in [0, n={n}].")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def learning_curve(log_history: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """One row per logged RL step: step, batch_success, valid_rate, loss, skipped, advantage_std,
    and with resampling resamples and played_success (the columns a step logged;
    `valid_rate` = 1 − `episode/invalid_action_rate`)."""
    rows = []
    for entry in log_history:
        if "episode/success_rate" not in entry:
            continue
        row = {"step": int(entry["step"])}
        row.update({column: float(entry[key]) for key, column in _COLUMNS.items() if key in entry})
        if "invalid_rate" in row:
            row["valid_rate"] = 1.0 - row.pop("invalid_rate")
        rows.append(row)
    return rows


def plot_learning_curve(
    curve: Sequence[dict[str, float]], path: str | Path, evaluations: Sequence[dict[str, Any]] = (), title: str = ""
) -> Path:
    """Batch success and valid-action rate (left axis) and loss (right axis) per RL step,
    with the held-out evaluations (`trainer.eval_history`) as points and 95% intervals, a
    marker per occasion (`EVAL_MARKERS`), and "intervals overlap" written when those of the
    evaluations before and after training do (`intervals_overlap`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, rates = plt.subplots(figsize=(7, 5), layout="constrained")
    steps = [row["step"] for row in curve]
    columns = (
        ("batch_success", "training-batch success", "o-"),
        ("played_success", "success of every rollout played (resampled ones too)", "v-."),
        ("valid_rate", "valid-action rate", "s--"),
    )
    for column, label, style in columns:
        points = [(row["step"], row[column]) for row in curve if column in row]
        if points:
            rates.plot(*zip(*points), style, label=label)
    for evaluation in evaluations:
        n = int(evaluation.get("num_tasks", 0))
        if not n:
            continue
        rate = evaluation["success_rate"]
        low, high = wilson_interval(round(rate * n), n)
        rates.errorbar(
            [evaluation["step"]], [rate], yerr=[[rate - low], [high - rate]], fmt=eval_marker(evaluation.get("tag"), 0),
            color="black", capsize=4, label=f"held-out success ({evaluation['tag']}, n={n}, 95% CI)",
        )
    rates.set_xlabel("RL optimizer step")
    rates.set_ylabel("rate")
    rates.set_ylim(-0.05, 1.05)
    if steps:
        rates.set_xticks(sorted({0, *steps}))
    losses = [(row["step"], row["loss"]) for row in curve if "loss" in row]
    if losses:
        loss_axis = rates.twinx()
        loss_axis.plot(*zip(*losses), "^:", color="tab:red", label="loss")
        loss_axis.set_ylabel("loss", color="tab:red")
    handles, labels = rates.get_legend_handles_labels()
    if losses:
        extra_handles, extra_labels = loss_axis.get_legend_handles_labels()
        handles, labels = handles + extra_handles, labels + extra_labels
    # two held-out points that look apart may differ by chance alone: the legend says so. Below the axes, off
    # the data: inside, it covered the evaluation before training (step 0, upper left) on the README's curve.
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=2, title=intervals_overlap(evaluations),
               title_fontsize=7)
    rates.set_title(title, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def evaluation_summary(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """An evaluation (`trainer.eval_history` entry) as: success rate, episodes, successes, 95% interval,
    valid-action rate (None when the evaluation did not record it)."""
    if not evaluation or not evaluation.get("num_tasks"):
        return None
    n = int(evaluation["num_tasks"])
    successes = round(evaluation["success_rate"] * n)
    return {
        "success_rate": evaluation["success_rate"],
        "episodes": n,
        "successes": successes,
        "ci95": wilson_interval(successes, n),
        "valid_action_rate": evaluation.get("valid_action_rate"),
        "step": evaluation.get("step"),
    }


def intervals_overlap(evaluations: Sequence[dict[str, Any]]) -> str | None:
    """'intervals overlap: before 0.14-0.69, final 0.22-0.78 (95%)' when the held-out success
    intervals of the evaluation before training and the final one overlap (the change is within
    what chance gives on so few episodes), else None (no overlap, or not both evaluated)."""
    last = {e.get("tag"): evaluation_summary(e) for e in evaluations if evaluation_summary(e) is not None}
    before, final = last.get("before"), last.get("final")
    if before is None or final is None:
        return None
    (low_b, high_b), (low_f, high_f) = before["ci95"], final["ci95"]
    if max(low_b, low_f) > min(high_b, high_f):
        return None
    return f"intervals overlap: before {low_b:.2f}-{high_b:.2f}, final {low_f:.2f}-{high_f:.2f} (95%)"


def format_evaluation(label: str, summary: dict[str, Any] | None) -> str:
    """'success before RL: 0.375 (3 of 8 episodes, 95% CI 0.137-0.694), valid actions 0.95'."""
    if summary is None:
        return f"{label}: not evaluated"
    low, high = summary["ci95"]
    text = (
        f"{label}: {summary['success_rate']:.3f} ({summary['successes']} of {summary['episodes']} episodes, "
        f"95% CI {low:.3f}-{high:.3f})"
    )
    if summary["valid_action_rate"] is not None:
        text += f", valid actions {summary['valid_action_rate']:.2f}"
    return text
