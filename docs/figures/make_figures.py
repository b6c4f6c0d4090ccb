"""Draws the docs' figures (committed next to this file): the data flow of one training step, the
two estimator axes and the graph step return (GraphGPO). Run from the repository root after changing a picture:

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
    """A box with `text` centred in it; returns (box, text) for `check_fit`."""
    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.05", fc=colour, ec="#333")
    ax.add_patch(patch)
    return patch, ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)


def check_fit(fig, boxes) -> None:
    """Refuse a figure whose text runs out of its box (a long class name did once)."""
    renderer = fig.canvas.get_renderer()
    for patch, label in boxes:
        outer, inner = patch.get_window_extent(renderer), label.get_window_extent(renderer)
        if inner.x0 < outer.x0 or inner.x1 > outer.x1 or inner.y0 < outer.y0 or inner.y1 > outer.y1:
            raise SystemExit(f"data_flow.png: {label.get_text()!r} overflows its box; break or shorten its lines")


def arrow(ax, a, b, text=""):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color="#333"))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.08, text, ha="center", fontsize=7.5, color="#444")


def data_flow():
    """One training step, left to right, each stage under the package that runs it; nothing flows
    backwards (docs/architecture.md)."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.set_xlim(0, 10.2)
    ax.set_ylim(0, 2.6)
    ax.axis("off")
    stages = [
        (0.1, "dataset rows\n(tasks × G =\nnum_generations)", "#e8eef7", "the trainer"),
        (2.1, "rollout (lockstep\nor continuous):\nprompt → Policy →\nparse → env.step", "#e6f4ea", "rollout/"),
        (4.1, "step records\none sample per\nenv step", "#fff4e0", "rollout/ → update/"),
        (6.1, "StepAdvantage-\nEstimator: partition\n× baseline × return\n→ A per step", "#fde8e8", "advantages/"),
        (8.1, "TRL's loss,\nclipping, KL,\noptimizer", "#ede7f6", "update/ (TRL's)"),
    ]
    boxes = [box(ax, x, 0.7, 1.7, 1.3, text, colour) for x, text, colour, _ in stages]
    for x, _, _, package in stages:
        ax.text(x + 0.85, 0.5, package, ha="center", fontsize=7.5, family="monospace", color="#333")
    for (x, _, _, _), label in zip(stages[:-1], ["rows", "turns", "records", "advantages"]):
        arrow(ax, (x + 1.72, 1.35), (x + 2.0, 1.35))
    ax.text(5.1, 0.12, "envs know nothing of the trainer; the estimator nothing of models or envs; only update/ and "
            "the ledger (trl_compat) touch TRL's private names", ha="center", fontsize=7.5, style="italic", color="#555")
    ax.text(3.0, 2.25, "many envs per batch, one turn at a time (envs.VectorEnv); built from values (the run plan's\n"
            "RolloutSettings and EnvSpec) and a Policy, never the config or the trainer", ha="center", fontsize=8, color="#555")
    fig.canvas.draw()
    check_fit(fig, boxes)
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


# the same task group as a graph: the edges its steps took, and where each rollout ended
EDGES = [("s0", "s1"), ("s1", "s2"), ("s2", "goal"), ("s1", "s3"), ("s3", "end 1"), ("s0", "s4"), ("s4", "s4"),
         ("s4", "end 2"), ("s2", "end 3")]
POSITIONS = {"s0": (0, 1), "s1": (1, 1.6), "s2": (2, 1.6), "goal": (3, 1.6), "s3": (2, 0.9), "end 1": (3, 0.9),
             "s4": (1, 0.2), "end 2": (2, 0.2), "end 3": (3, 2.3)}
# distances to the goal by reverse breadth-first search; unreachable: far + 1 = 4 (far = d(s0) = 3)
DISTANCE = {"goal": 0, "s2": 1, "s1": 2, "s0": 3, "s3": 4, "end 1": 4, "s4": 4, "end 2": 4, "end 3": 4}


def step_return_axis(gamma=0.1):
    """The graph step return: one graph per task group over the partition's cells, d to the goal, 10·γ^d."""
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1.25, 1]})
    ax.set_xlim(-0.4, 3.5)
    ax.set_ylim(-0.2, 2.7)
    ax.axis("off")
    for a, b in EDGES:
        if a == b:
            ax.annotate("", xy=(POSITIONS[a][0] + 0.1, POSITIONS[a][1] + 0.12), xytext=(POSITIONS[a][0] - 0.1, POSITIONS[a][1] + 0.12),
                        arrowprops=dict(arrowstyle="-|>", connectionstyle="arc3,rad=-1.6", color="#555"))
            continue
        ax.add_patch(FancyArrowPatch(POSITIONS[a], POSITIONS[b], arrowstyle="-|>", mutation_scale=11, color="#555",
                                     shrinkA=11, shrinkB=11))
    for node, (x, y) in POSITIONS.items():
        colour = "#55a868" if node == "goal" else ("#bbbbbb" if node.startswith("end") else COLOURS.get(node, "#999"))
        ax.scatter(x, y, s=520, c=colour, edgecolors="#333", zorder=3)
        ax.text(x, y, node, ha="center", va="center", fontsize=7, color="white", zorder=4)
        ax.text(x, y - 0.3, f"d={DISTANCE[node]}", ha="center", fontsize=7, color="#333")
    ax.set_title("one task group's graph (nodes: cells; ends of failed rollouts: dead ends)", fontsize=9)
    # the returns of rollout 0 (s0 → s1 → s2 → goal) and 1 (s0 → s1 → s3 → end) under the two step returns
    steps = [("r0 t0\ns0→s1", 0.90, DISTANCE["s1"]), ("r0 t1\ns1→s2", 0.95, DISTANCE["s2"]),
             ("r0 t2\ns2→goal", 1.0, 0), ("r1 t0\ns0→s1", 0.90, DISTANCE["s1"]), ("r1 t1\ns1→s3", 0.0, DISTANCE["s3"])]
    xs = range(len(steps))
    blue = bars.bar([x - 0.18 for x in xs], [r for _, r, _ in steps], 0.36, color="#4c72b0",
                    label="discounted: r + γR' (γ 0.95; the example's returns)")
    orange = bars.bar([x + 0.18 for x in xs], [10 * gamma**d / 10 for _, _, d in steps], 0.36, color="#dd8452",
                      label=f"graph: 10·γ^d(next) / 10 (γ {gamma})")
    bars.bar_label(blue, fmt="%.2f", fontsize=6.5)
    bars.bar_label(orange, labels=[f"γ^{d}" for _, _, d in steps], fontsize=6.5)
    bars.set_ylim(0, 1.25)
    bars.set_xticks(list(xs), [label for label, _, _ in steps], fontsize=7.5)
    bars.set_ylabel("step return (graph ÷ 10)")
    bars.set_title("Axis 3, step return: rollout 0's t0 and rollout 1's t0 share s0 → s1", fontsize=9)
    bars.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(HERE / "axis_step_return.png", dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    data_flow()
    partition_axis()
    baseline_axis()
    step_return_axis()
    print("wrote", *sorted(p.name for p in HERE.glob("*.png")))
