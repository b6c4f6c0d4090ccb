"""The graph step return (GraphGPO): how far the state a step reached is from the goal.

GraphGPO (Cheng et al., ICML 2026, arXiv 2605.26684; verl-agent `recipe/GraphGPO/core_graph.py`)
merges the steps of every trajectory of a task group into one state-transition graph and
scores each step by the distance of the state it reached to the goal, instead of by the
rewards that followed it (docs/concepts/math.md#graph-return; the ideas: docs/concepts/estimators.md):

    nodes      the cells of a state partition (exact anchors: `hash`; hidden-state
               clusters: `hidden`), one goal node per group, one dead end per failed
               trajectory (below)
    edges      u_t -> u_{t+1} for every step, u_t the node of the step's state
    d(v)       shortest number of edges from v to the goal (reverse breadth-first search);
               a node that cannot reach it gets far + 1, far = the group's largest finite d
               (so in a group without a success every node has d = 1)
    R_t        10 · γ^{d(u_{t+1})}                      (normalize_distance=False)
               10 · γ^{d(u_{t+1}) - d(u_t) + 1}         (normalize_distance=True: distance closed)

A trajectory succeeded when its episode return is > 0 (the reference's `episode_rewards > 0`);
its last step reaches the goal. The last step of any other trajectory reached the state of the
env's final observation (`StepBatch.next_anchor`, which the rollout records for every episode
the env ended or the turn budget cut): that observation's node, as in the reference, so a loss
that ends in a state other rollouts passed through takes that state's distance. Where nothing
was recorded (an env fault; a batch without `next_anchor`) the state is a dead end of its own
(no out-edge, so d = far + 1). Over hidden-state clusters the final observation has no hidden
state (no prompt is built from it; capturing one would cost a forward pass): its node is the
cluster of the group's first step whose anchor is that observation (`known_state_cells`), else
a node of its own. The invalid-action penalty is subtracted after, as for the discounted return (`presets`).

Everything is vectorised over the batch: the search runs level by level over all groups at
once and touches each edge once, so its cost is linear in the number of steps (plus one sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

import torch

from .records import BatchLayout

__all__ = [
    "GOAL_RETURN", "TransitionGraph", "transition_graph", "goal_distances", "graph_returns", "similar_labels",
    "known_state_cells", "following_labels",
]

GOAL_RETURN = 10.0  # the reference's 10 · γ^d


@dataclass
class TransitionGraph:
    """The state-transition graphs of a batch, all groups in one node numbering.

    Nodes 0..S-1 are state nodes (labels nested in groups), S..S+G-1 the goals of the G
    groups, S+G.. the dead ends of failed trajectories (one per trajectory).

    Attributes:
        node: (N,) int64 node of each step's state.
        next_node: (N,) int64 node the step reached.
        node_group: (V,) int64 group index of each node.
        num_state_nodes: S.
        distance: (V,) float64 d(v), with the far + 1 rule applied.
        reachable: (V,) bool, a path to the goal exists.
    """

    node: torch.Tensor
    next_node: torch.Tensor
    node_group: torch.Tensor
    num_state_nodes: int
    distance: torch.Tensor
    reachable: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.node_group.shape[0]


def transition_graph(
    node_label: torch.Tensor,
    layout: BatchLayout,
    success: torch.Tensor,
    next_label: torch.Tensor | None = None,
) -> TransitionGraph:
    """Nodes and edges of each group's graph, and every node's distance to its goal.

    Args:
        node_label: (N,) int64 state label of each step, nested in groups (equal labels
            in two groups must not occur: use `Partition.cell` or `Partition.from_labels`).
        layout: the batch layout (trajectories, t, groups).
        success: (num_traj,) bool, the trajectory reached the goal with its last step.
        next_label: (N,) int64 label of the state each step reached, in the same numbering,
            -1 where none was recorded (a dead end of the trajectory's own), or None: the label
            of the next step of the trajectory (`following_labels`: a dead end after the last).
    Returns:
        `TransitionGraph`.
    """
    n = node_label.shape[0]
    num_groups, num_traj = layout.num_groups, layout.num_traj
    if next_label is None:
        next_label = following_labels(node_label, layout)
    num_states = int(max(int(node_label.max()) if n else -1, int(next_label.max()) if n else -1)) + 1
    goal = num_states + torch.arange(num_groups)
    dead_end = num_states + num_groups + torch.arange(num_traj)
    next_node = torch.where(next_label < 0, dead_end[layout.traj_index], next_label)
    won = _is_last(layout) & success[layout.traj_index]
    next_node = torch.where(won, goal[layout.group_index], next_node)
    node_group = torch.zeros(num_states + num_groups + num_traj, dtype=torch.long)
    node_group[node_label] = layout.group_index
    state_next = next_node < num_states
    node_group[next_node[state_next]] = layout.group_index[state_next]
    node_group[num_states:] = torch.cat([torch.arange(num_groups), layout.traj_group])
    distance = goal_distances(node_label, next_node, goal, node_group)
    reachable = torch.isfinite(distance)
    return TransitionGraph(node_label, next_node, node_group, num_states, _far_plus_one(distance, node_group, num_groups), reachable)


def _is_last(layout: BatchLayout) -> torch.Tensor:
    """(N,) bool: the step is its trajectory's last."""
    t = layout.grid_position - layout.traj_index * layout.max_length
    return t == layout.traj_length[layout.traj_index] - 1


def following_labels(label: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """(N,) the label of the next step of each step's trajectory, -1 after its last step."""
    grid = layout.to_grid(label, fill=-1).reshape(-1)
    following = grid[(layout.grid_position + 1).clamp(max=max(grid.shape[0] - 1, 0))]
    return torch.where(_is_last(layout), -1, following)


def known_state_cells(
    cell: torch.Tensor, anchor: torch.Tensor, next_anchor: torch.Tensor, layout: BatchLayout
) -> torch.Tensor:
    """The cell of the state each step reached, by its anchor: the cell of the first step (in
    (trajectory, t) order) of the same task group whose anchor is the step's `next_anchor`,
    -1 where no step of the group has that anchor (or `next_anchor` is -1).

    What a hidden-state graph uses after a trajectory's last step, whose final observation has
    no hidden state of its own: an observation seen elsewhere in the group joins that step's
    cluster; a new one is a node of its own that no step leaves (d = far + 1, as a dead end).

    Args:
        cell: (N,) int64 cell of each step; anchor, next_anchor: (N,) int64 anchor ids (one numbering).
    Returns:
        (N,) int64 cell ids, or -1.
    """
    n = cell.shape[0]
    if not n:
        return cell.clone()
    width = int(max(int(anchor.max()), int(next_anchor.max()))) + 1
    keys = torch.cat([anchor, next_anchor.clamp(min=0)]) + layout.group_index.repeat(2) * width  # (group, anchor)
    _, compact = torch.unique(keys, return_inverse=True)
    grid_size = layout.num_traj * layout.max_length
    first = torch.full((int(compact.max()) + 1,), grid_size, dtype=torch.long)  # grid_size: no step has it
    first.scatter_reduce_(0, compact[:n], layout.grid_position, reduce="amin")
    owner = torch.full((grid_size + 1,), -1, dtype=torch.long)
    owner[layout.grid_position] = cell
    return torch.where(next_anchor >= 0, owner[first[compact[n:]]], -1)


def goal_distances(source: torch.Tensor, target: torch.Tensor, goal: torch.Tensor, num_nodes_or_group) -> torch.Tensor:
    """Shortest edge count from every node to a goal, by reverse breadth-first search.

    Edges source[e] -> target[e] (E,); the search starts from all `goal` nodes at once and
    walks edges backwards level by level, each level taking the in-edges of its frontier
    from a CSR index (one sort), so every edge is read once: O(E log E + V).

    Args:
        source, target: (E,) int64 node ids.
        goal: (G,) int64 node ids at distance 0.
        num_nodes_or_group: V, or a (V,) tensor (its length is V).
    Returns:
        (V,) float64 distance, inf where no path leads to a goal.
    """
    num_nodes = num_nodes_or_group if isinstance(num_nodes_or_group, int) else num_nodes_or_group.shape[0]
    order = torch.argsort(target, stable=True)
    by_target = source[order]
    indptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(torch.bincount(target, minlength=num_nodes), 0)
    distance = torch.full((num_nodes,), float("inf"), dtype=torch.float64)
    distance[goal] = 0.0
    frontier, level = goal, 0
    while frontier.numel():
        start, count = indptr[frontier], indptr[frontier + 1] - indptr[frontier]
        total = int(count.sum())
        if not total:
            break
        # positions start_f + 0..count_f-1 of every frontier node, flattened
        offset = torch.arange(total) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        preds = by_target[torch.repeat_interleave(start, count) + offset]
        preds = torch.unique(preds[torch.isinf(distance[preds])])
        level += 1
        distance[preds] = float(level)
        frontier = preds
    return distance


def _far_plus_one(distance: torch.Tensor, node_group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The reference's rule: an unreachable node gets 1 + the largest finite d of its group."""
    finite = torch.where(torch.isfinite(distance), distance, torch.zeros_like(distance))
    far = torch.zeros(num_groups, dtype=torch.float64).scatter_reduce_(0, node_group, finite, reduce="amax")
    return torch.where(torch.isfinite(distance), distance, far[node_group] + 1.0)


def graph_returns(graph: TransitionGraph, gamma: float, normalize_distance: bool) -> torch.Tensor:
    """R_t = 10 γ^{d(u_{t+1})}, or 10 γ^{d(u_{t+1}) - d(u_t) + 1} with `normalize_distance`.

    Returns:
        (N,) float64, before the invalid-action penalty.
    """
    exponent = graph.distance[graph.next_node]
    if normalize_distance:
        exponent = exponent - graph.distance[graph.node] + 1.0
    return GOAL_RETURN * torch.pow(torch.tensor(float(gamma), dtype=torch.float64), exponent)


def similar_labels(
    label: torch.Tensor, text: tuple, layout: BatchLayout, threshold: float, next_label: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's `StateCanonicalizer`: nearly equal observations become one state.

    Per task group, steps in (trajectory, t) order, each step's state then (if given) its
    next state: a text joins the first earlier representative whose
    `difflib.SequenceMatcher(None, text, representative).ratio() >= threshold`, else it
    becomes a representative. Quadratic in the distinct texts of a group (a Python loop),
    as the reference; off by default.

    Args:
        label: (N,) int64 id of each step's observation; text[id] is its text.
        next_label: (N,) int64 ids of the observations reached (-1: the goal, not a text), or None.
    Returns:
        (canonical label (N,), canonical next label (N,) or None), ids into `text` (the
        representative's), still to be made group-nested by the caller.
    """
    order = torch.argsort(layout.grid_position).tolist()  # (trajectory id, t)
    group = layout.group_index.tolist()
    ids = label.tolist()
    next_ids = next_label.tolist() if next_label is not None else None
    clusters: dict[int, list[int]] = {}
    cache: dict[tuple[int, int], int] = {}

    def canonical(g: int, i: int) -> int:
        if (g, i) in cache:
            return cache[(g, i)]
        raw = text[i] if isinstance(text[i], str) else str(text[i])
        reps = clusters.setdefault(g, [])
        found = next((r for r in reps if SequenceMatcher(None, raw, _as_text(text[r])).ratio() >= threshold), None)
        if found is None:
            reps.append(i)
            found = i
        cache[(g, i)] = found
        return found

    out, out_next = list(ids), list(next_ids) if next_ids is not None else None
    for row in order:
        out[row] = canonical(group[row], ids[row])
        if out_next is not None and next_ids[row] >= 0:
            out_next[row] = canonical(group[row], next_ids[row])
    merged = torch.tensor(out, dtype=torch.long)
    return merged, torch.tensor(out_next, dtype=torch.long) if out_next is not None else None


def _as_text(value) -> str:
    return value if isinstance(value, str) else str(value)
