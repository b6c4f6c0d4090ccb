"""Draws the docs' figures (committed next to this file): the data flow of one training step and the
two estimator axes. Run from the repository root after changing a picture:

    python docs/figures/make_figures.py

The numbers in the axis figures are a made-up example small enough to check by hand, not a measurement.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent


def box(ax, x, y, w, h, text, colour):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.05", fc=colour, ec="#333"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)


def arrow(ax, a, b, text=""):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color="#333"))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.08, text, ha="center", fontsize=7.5, color="#444")


def data_flow():
    """One training step, left to right; nothing flows backwards (docs/concepts/samples.md)."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.set_xlim(0, 10.2)
    ax.set_ylim(0, 2.6)
    ax.axis("off")
    stages = [
        (0.1, "dataset rows\n(tasks × G =\nnum_generations)", "#e8eef7"),
        (2.1, "lockstep rollout\nprompt → generate →\nparse → env.step\n(hidden state hook)", "#e6f4ea"),
        (4.1, "step records\none sample per\nenv step", "#fff4e0"),
        (6.1, "StepAdvantageEstimator\npartition × baseline\n→ A per step", "#fde8e8"),
        (8.1, "TRL's loss,\nclipping, KL,\noptimizer", "#ede7f6"),
    ]
    for x, text, colour in stages:
        box(ax, x, 0.7, 1.7, 1.3, text, colour)
    for (x, _, _), label in zip(stages[:-1], ["rows", "turns", "records", "advantages"]):
        arrow(ax, (x + 1.72, 1.35), (x + 2.0, 1.35))
    ax.text(5.1, 0.25, "envs know nothing of the trainer; the estimator nothing of models or envs", ha="center",
            fontsize=8, style="italic", color="#555")
    ax.text(3.0, 2.25, "many envs per batch, one turn at a time (envs.VectorEnv)", ha="center", fontsize=8, color="#555")
    fig.savefig(HERE / "data_flow.png", dpi=130, bbox_inches="tight")
    plt.close(fig)


# one task group: 4 rollouts × 3 steps; (rollout, t) → (true state, action, return-to-go)
STEPS = [
    (0, 0, "s0", "fetch logs", 0.90), (0, 1, "s1", "craft planks", 0.95), (0, 2, "s2", "craft plate", 1.0),
    (1, 0, "s0", "fetch logs", 0.90), (1, 1, "s1", "craft stick", 0.0), (1, 2, "s3", "look", 0.0),
    (2, 0, "s0", "fetch planks", 0.0), (2, 1, "s4", "look", 0.0), (2, 2, "s4", "look", 0.0),
    (3, 0, "s0", "fetch logs", 0.90), (3, 1, "s1", "craft planks", 0.45), (3, 2, "s2", "look", 0.5),
]
COLOURS = {"s0": "#4c72b0", "s1": "#dd8452", "s2": "#55a868", "s3": "#c44e52", "s4": "#8172b3"}


def partition_axis():
    """Axis 1: which steps share a cell. none: no cell; hash: identical anchor text; hidden: close hidden states."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (name, title) in zip(axes, [("none", "none (GRPO): no step cells"),
                                        ("hash", "hash (GiGPO): identical observation"),
                                        ("hidden", "hidden (BiPACE): leader clusters, d ≤ ε")]):
        ax.set_title(title, fontsize=8.5)
        ax.set_xlim(-0.5, 2.5)
        ax.set_ylim(-0.6, 3.6)
        ax.set_xticks([0, 1, 2], ["t=0", "t=1", "t=2"])
        ax.set_yticks([0, 1, 2, 3], [f"rollout {i}" for i in range(4)])
        for rollout, t, state, _, _ in STEPS:
            colour = "#bbbbbb" if name == "none" else COLOURS[state]
            # the hidden partition may split one true state (rollout 2's s4 drifts) or merge two
            if name == "hidden" and (rollout, t) == (2, 2):
                colour = "#e377c2"
            ax.scatter(t, rollout, s=260, c=colour, edgecolors="#333", zorder=3)
            if name != "none":
                ax.text(t, rollout, state if not (name == "hidden" and (rollout, t) == (2, 2)) else "s4'",
                        ha="center", va="center", fontsize=7, color="white", zorder=4)
        ax.grid(alpha=0.2)
    axes[2].text(1.0, -0.5, "rollout 2, t=2 is split off: its hidden state moved past ε", ha="center", fontsize=7)
    fig.suptitle("Axis 1, state partition: the cells of one task group (colour = cell)", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "axis_partition.png", dpi=130)
    plt.close(fig)


def baseline_axis():
    """Axis 2: how a step is compared with its cell; the cell of s1 above (3 steps, 2 actions)."""
    cell = [(rollout, action, ret) for rollout, t, state, action, ret in STEPS if state == "s1"]
    v_hat = sum(r for _, _, r in cell) / len(cell)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels, mean_adv, pace_adv = [], [], []
    for rollout, action, ret in cell:
        same = [r for _, a, r in cell if a == action]
        labels.append(f"rollout {rollout}\n{action}\nR={ret:.2f}")
        mean_adv.append(ret - v_hat)
        pace_adv.append(sum(same) / len(same) - v_hat)
    xs = range(len(cell))
    ax.bar([x - 0.18 for x in xs], mean_adv, 0.36, label="mean (GiGPO): R − V̂", color="#4c72b0")
    ax.bar([x + 0.18 for x in xs], pace_adv, 0.36, label="pace_q (BiPACE_Q): Q̂(a) − V̂", color="#dd8452")
    ax.axhline(0, color="#333", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("step advantage (before ÷ std)")
    ax.set_title(f"Axis 2, step baseline: one cell (state s1), V̂ = mean of its returns = {v_hat:.2f}", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(HERE / "axis_baseline.png", dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    data_flow()
    partition_axis()
    baseline_axis()
    print("wrote", *sorted(p.name for p in HERE.glob("*.png")))
