"""Time every estimator preset, side by side with the GiGPO reference, and how time grows.

    OMP_NUM_THREADS=2 python -m bench.estimators            # full run (~2-3 minutes)
    python -m bench.estimators --quick                      # CI-sized (seconds)
    OMP_NUM_THREADS=1 python -m bench.estimators --clustering   # hidden clustering only (below)

Batches are synthetic but shaped like real rollouts: `groups` task groups × 8 rollouts
× 50 steps, sparse terminal rewards, each step in one of 30 states per group (its
anchor), hidden states of width 3,584 (Qwen2.5-7B) = the state's direction + noise, so
hash and hidden partitions both find non-trivial cells (ε = 0.1). The reference is the
transcription of verl-agent's GiGPO in tests/advantages/gigpo_reference.py (quadratic
return computation), timed on the same batch; the HGPO presets are timed against
verl-agent's HGPO (tests/advantages/hgpo_reference.py, K = 2, the same batch), the graph
presets against verl-agent's GraphGPO (tests/advantages/graphgpo_reference.py), `beacon` against
BEACON's `core_migpo.py` (tests/advantages/beacon_reference.py): on milestone flags (each step
reaches one with probability 0.1), and as `beacon (plan)` on a static plan of 6 of the 6 actions
per task group, matched by difflib as BEACON matches it. Prints a table and writes JSON.

`--clustering` times the hidden partition's leader clustering (ε = 0.1, width 3,584, 16
groups of 8 × 50 steps) at 30, 170 and 400 distinct states per group, the code as it is
beside the same code growing its cluster sums by doubling with torch.cat (as it did
before 2026-12-05; `legacy_cluster_groups`), and `compute_advantages` with
`cluster_eps="auto"` called twice on one batch (the second call reuses the batch's ε).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bipace_trainer.advantages import (
    PRESETS,
    BatchLayout,
    StepBatch,
    calibrate_eps,
    compute_advantages,
    resolve_settings,
)
from bipace_trainer.advantages import partition as partition_module
from bipace_trainer.advantages.partition import hidden_partition
from tests.advantages.beacon_reference import beacon_advantages
from tests.advantages.gigpo_reference import gigpo_advantages
from tests.advantages.graphgpo_reference import graphgpo_advantages
from tests.advantages.hgpo_reference import hgpo_advantages

ROOT = Path(__file__).resolve().parents[1]

ROLLOUTS, LENGTH, STATES = 8, 50, 30
SCALED = ("gigpo", "bipace_q", "gagpo", "hgpo", "graphgpo", "beacon")  # presets whose time is measured over batch sizes
ACTIONS = [f"take object {k} from place {k}" for k in range(6)]  # the action keys as text, for BEACON's plan match
PLAN = "beacon (plan)"  # the beacon preset on a batch with static plans instead of flags


def make_batch(
    groups: int, dim: int, *, length: int = LENGTH, noise: float = 0.3, seed: int = 0, states: int = STATES
) -> StepBatch:
    gen = torch.Generator().manual_seed(seed)
    n = groups * ROLLOUTS * length
    group = torch.arange(groups).repeat_interleave(ROLLOUTS * length)
    traj = torch.arange(groups * ROLLOUTS).repeat_interleave(length)
    t = torch.arange(length).repeat(groups * ROLLOUTS)
    anchor = group * states + torch.randint(0, states, (n,), generator=gen)
    directions = torch.randn(groups * states, dim, generator=gen)
    hidden = directions[anchor] + noise * torch.randn(n, dim, generator=gen)
    success = (torch.rand(groups * ROLLOUTS, generator=gen) < 0.5).float()
    reward = torch.where(t == length - 1, success[traj], torch.zeros(n))
    action_key = torch.randint(0, 6, (n,), generator=gen)
    return StepBatch(
        group=group,
        traj=traj,
        t=t,
        reward=reward,
        valid=torch.rand(n, generator=gen) > 0.05,
        anchor=anchor,
        action_key=action_key,
        hidden=hidden,
        milestone=torch.rand(n, generator=gen) < 0.1,
        action_text=[ACTIONS[k] for k in action_key.tolist()],
    )


def with_plans(batch: StepBatch) -> StepBatch:
    """`batch` with every task group's plan: its 6 actions in a fixed order, the flags left out."""
    plans = [tuple(ACTIONS[(g + k) % 6] for k in range(6)) for g in batch.group.tolist()]
    return StepBatch(
        group=batch.group, traj=batch.traj, t=batch.t, reward=batch.reward, valid=batch.valid, anchor=batch.anchor,
        action_key=batch.action_key, hidden=batch.hidden, action_text=batch.action_text, milestone_plan=plans,
    )  # fmt: skip


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _graphgpo_reference(group, traj, reward, valid, anchor):
    """verl-agent's GraphGPO on the batch: next_obs is the next anchor, 'success' after a won
    trajectory's last step, a fresh observation after a failed one's."""
    nxt = list(anchor[1:]) + [None]
    for i in range(len(anchor)):
        if i == len(anchor) - 1 or traj[i + 1] != traj[i]:
            nxt[i] = "success" if reward[i] > 0 else f"end-{traj[i]}"
    return graphgpo_advantages(group, traj, reward, valid, anchor, nxt)


def _beacon_reference(group, traj, reward, valid, batch):
    """BEACON's code on the batch: its flags (dynamic), or its plans, one trial per task group (static)."""
    if batch.milestone_plan is None:
        return beacon_advantages(group, traj, reward, valid, batch.action_text, milestone_achieved=batch.milestone.tolist())
    trials = batch.milestone_plan.tolist()
    loader = dict(enumerate(batch.milestone_plans))
    return beacon_advantages(group, traj, reward, valid, batch.action_text, trial_id=trials, loader=loader)


REFERENCES = {
    "gigpo": lambda group, traj, reward, valid, batch: gigpo_advantages(group, traj, reward, valid, batch.anchor.tolist()),
    "hgpo": lambda group, traj, reward, valid, batch: hgpo_advantages(
        group, traj, reward, valid, batch.anchor.tolist(), history_length=2
    ),
    "graphgpo": lambda group, traj, reward, valid, batch: _graphgpo_reference(group, traj, reward, valid, batch.anchor.tolist()),
    "beacon": _beacon_reference,
}


def reference_seconds(batch: StepBatch, reference: str = "gigpo") -> float:
    """One call of the transcribed reference on `batch` (rows already in trajectory order)."""
    args = (batch.group.numpy(), batch.traj.numpy(), batch.reward.tolist(), batch.valid.tolist(), batch)
    start = time.perf_counter()
    REFERENCES[reference](*args)
    return time.perf_counter() - start


def reference_of(preset: str) -> str:
    """The reference a preset is timed against: verl-agent's HGPO for the hierarchy presets,
    its GraphGPO for the graph-return presets, BEACON's code for the milestone presets, GiGPO
    for the others."""
    settings = resolve_settings("beacon" if preset == PLAN else preset)
    if settings.uses_milestones:
        return "beacon"
    if settings.step_return == "graph":
        return "graphgpo"
    return "hgpo" if settings.step_baseline == "hierarchy" else "gigpo"


def preset_table(groups_list, dim, repeats, with_reference):
    rows = []
    for groups in groups_list:
        flagged = make_batch(groups, dim)
        planned = with_plans(flagged)
        n = len(flagged)
        refs = {name: reference_seconds(flagged, name) for name in REFERENCES} if with_reference else {}
        plan_ref = reference_seconds(planned, "beacon") if with_reference else None
        for name in [*PRESETS, PLAN]:
            batch = planned if name == PLAN else flagged
            settings = resolve_settings("beacon" if name == PLAN else name, cluster_eps=0.1)
            seconds = timed(lambda: compute_advantages(batch, settings), repeats)
            ref = plan_ref if name == PLAN else refs.get(reference_of(name))
            rows.append(
                dict(
                    preset=name,
                    steps=n,
                    seconds=seconds,
                    steps_per_s=n / seconds,
                    reference=reference_of(name),
                    reference_seconds=ref,
                    speedup_vs_reference=(ref / seconds) if ref else None,
                )
            )
    return rows


def scaling(sizes, dim, repeats):
    rows = []
    for name in SCALED:
        settings = resolve_settings(name, cluster_eps=0.1)
        for steps in sizes:
            groups = max(1, steps // (ROLLOUTS * LENGTH))
            batch = make_batch(groups, dim, length=max(1, steps // (groups * ROLLOUTS)))
            seconds = timed(lambda: compute_advantages(batch, settings), repeats)
            rows.append(dict(preset=name, steps=len(batch), seconds=seconds, steps_per_s=len(batch) / seconds))
    return rows


def calibration(groups, dim):
    batch = make_batch(groups, dim)
    layout = BatchLayout.from_batch(batch)
    start = time.perf_counter()
    eps = calibrate_eps(batch.hidden, layout, target_singleton_rate=0.2, max_eps=0.3)
    return dict(steps=len(batch), seconds=time.perf_counter() - start, eps=eps)


def legacy_cluster_groups(hidden, order, start, size, threshold, block, label) -> None:
    """`partition._cluster_groups` as it was before 2026-12-05: the cluster sums start at 2 blocks
    of slots and double by torch.cat (a copy of every sum) when a block needs more."""
    import numpy as np

    _padded, _walk_block = partition_module._padded, partition_module._walk_block
    n, dim = hidden.shape
    num_groups, rounds = size.shape[0], int(size[0])
    capacity = _padded(min(rounds, 2 * block))
    member_sum = hidden.new_zeros(num_groups, capacity, dim)
    member_norm = np.zeros((num_groups, capacity))
    num_clusters = np.zeros(num_groups, dtype=np.int64)
    x_buffer = hidden.new_empty(num_groups * block, dim)
    for r0 in range(0, rounds, block):
        active = int((size > r0).sum())
        width = min(block, rounds - r0)
        rank = r0 + torch.arange(width)
        present_t = rank[None, :] < size[:active, None]
        present = present_t.numpy()
        steps = order[(start[:active, None] + rank[None, :]).clamp(max=n - 1)].reshape(-1)
        x_b = torch.index_select(hidden, 0, steps, out=x_buffer[: active * width])
        x_b.mul_((present_t.reshape(-1) / torch.linalg.vector_norm(x_b, dim=1).clamp(min=1e-30))[:, None])
        k0 = int(num_clusters[:active].max())
        slots = k0 + width
        if slots > capacity:
            grow = _padded(max(slots - capacity, capacity))
            member_sum = torch.cat([member_sum, member_sum.new_zeros(num_groups, grow, dim)], 1)
            member_norm = np.concatenate([member_norm, np.zeros((num_groups, grow))], 1)
            capacity += grow
        x_g = x_b.view(active, width, dim)
        gram = torch.bmm(x_g, x_g.transpose(1, 2)).double().numpy()
        dots = np.zeros((active, width, slots))
        if k0:
            sums = member_sum[:active, : min(_padded(k0), capacity)]
            dots[..., :k0] = torch.bmm(x_g, sums.transpose(1, 2))[..., :k0].double().numpy()
        block_label = _walk_block(dots, gram, member_norm[:active, :slots], num_clusters[:active], present, threshold)
        flat = torch.from_numpy((np.arange(active)[:, None] * capacity + block_label).reshape(-1))
        member_sum.view(-1, dim).scatter_add_(0, flat[:, None].expand(-1, dim), x_b)
        label[steps.view(active, width)[present_t]] = torch.from_numpy(block_label[present])


def clustering(dim, groups, states_list, repeats, eps=0.1):
    """Leader clustering steps/s at several distinct states per group, now vs. the doubling growth."""
    rows = []
    current = partition_module._cluster_groups
    for states in states_list:
        batch = make_batch(groups, dim, states=states)
        layout = BatchLayout.from_batch(batch)
        labels, seconds = {}, {}
        for name, fn in (("now", current), ("doubling", legacy_cluster_groups)):
            partition_module._cluster_groups = fn
            try:
                labels[name] = hidden_partition(batch.hidden, layout, eps).cell
                seconds[name] = timed(lambda: hidden_partition(batch.hidden, layout, eps), repeats)
            finally:
                partition_module._cluster_groups = current
        rows.append(
            dict(
                states_per_group=states, steps=len(batch), groups=groups, dim=dim, eps=eps,
                clusters_per_group=int(labels["now"].max() + 1) / groups, same_labels=bool(torch.equal(*labels.values())),
                seconds=seconds["now"], seconds_doubling=seconds["doubling"], steps_per_s=len(batch) / seconds["now"],
                steps_per_s_doubling=len(batch) / seconds["doubling"], speedup=seconds["doubling"] / seconds["now"],
            )  # fmt: skip
        )
    return rows


def auto_eps_twice(groups, dim):
    """`compute_advantages` with cluster_eps="auto" twice on one batch: the second reuses ε."""
    batch = make_batch(groups, dim)
    settings = resolve_settings("bipace_q")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compute_advantages(batch, settings)
        times.append(time.perf_counter() - start)
    return dict(steps=len(batch), first_seconds=times[0], second_seconds=times[1], ratio=times[0] / times[1])


def print_clustering(rows, auto):
    print(f"\n{'states/group':>12}{'clusters':>10}{'steps':>8}{'steps/s':>12}{'doubling':>12}{'ratio':>8}{'same':>6}")
    for r in rows:
        print(
            f"{r['states_per_group']:>12}{r['clusters_per_group']:>10.0f}{r['steps']:>8}{r['steps_per_s']:12,.0f}"
            f"{r['steps_per_s_doubling']:12,.0f}{r['speedup']:7.2f}x{str(r['same_labels']):>6}"
        )
    print(
        f"compute_advantages(cluster_eps='auto') on {auto['steps']} steps: first call {auto['first_seconds']:.2f} s "
        f"(calibrates), second {auto['second_seconds']:.2f} s on the same batch ({auto['ratio']:.1f}x)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: small batches, width 256")
    parser.add_argument("--clustering", action="store_true", help="only the hidden clustering at 30-400 states/group")
    parser.add_argument("--sizes", type=int, nargs="+", help="batch sizes (steps) of the growth table instead of the default")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "estimators.json"))
    args = parser.parse_args()

    if args.clustering:
        dim, groups, states, repeats = (256, 2, [30, 170], 1) if args.quick else (3584, 16, [30, 170, 400], 3)
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden width {dim}")
        rows, auto = clustering(dim, groups, states, repeats), auto_eps_twice(groups, dim)
        print_clustering(rows, auto)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(dim=dim, threads=torch.get_num_threads(), clustering=rows, auto_eps=auto), indent=2))
        print(f"wrote {out}")
        return

    if args.quick:
        dim, groups_list, sizes, repeats = 256, [4], [1_000, 4_000], 1
    else:
        dim, groups_list, sizes, repeats = 3584, [16, 64], [1_000, 4_000, 16_000, 25_600, 100_000], 3
    sizes = args.sizes or sizes
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden width {dim}")

    presets = preset_table(groups_list, dim, repeats, with_reference=True)
    print(f"\n{'preset':<12}{'steps':>8}{'ms/call':>10}{'steps/s':>12}{'reference':>10}{'ref ms':>10}{'speed-up':>10}")
    for r in presets:
        ref = (
            f"{r['reference']:>10}{r['reference_seconds'] * 1e3:10.0f}{r['speedup_vs_reference']:9.0f}x"
            if r["reference_seconds"]
            else ""
        )
        print(f"{r['preset']:<12}{r['steps']:>8}{r['seconds'] * 1e3:10.1f}{r['steps_per_s']:12,.0f}{ref}")

    growth = scaling(sizes, dim, repeats)
    print(f"\n{'preset':<12}{'steps':>8}{'ms/call':>10}{'steps/s':>12}{'time ratio / size ratio':>26}")
    for name in SCALED:
        mine = [r for r in growth if r["preset"] == name]
        for prev, r in zip([None] + mine[:-1], mine):
            ratio = "" if prev is None else f"{(r['seconds'] / prev['seconds']) / (r['steps'] / prev['steps']):26.2f}"
            print(f"{name:<12}{r['steps']:>8}{r['seconds'] * 1e3:10.1f}{r['steps_per_s']:12,.0f}{ratio}")

    calib = calibration(groups_list[0], dim)
    print(f"\nε auto-calibration (once per run): {calib['seconds']:.2f} s on {calib['steps']} steps → ε = {calib['eps']:.4f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(dim=dim, presets=presets, scaling=growth, calibration=calib), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
