"""Time every estimator preset, side by side with the GiGPO reference, and how time grows.

    OMP_NUM_THREADS=2 python -m bench.estimators            # full run (~2-3 minutes)
    python -m bench.estimators --quick                      # CI-sized (seconds)

Batches are synthetic but shaped like real rollouts: `groups` task groups × 8 rollouts
× 50 steps, sparse terminal rewards, each step in one of 30 states per group (its
anchor), hidden states of width 3,584 (Qwen2.5-7B) = the state's direction + noise, so
hash and hidden partitions both find non-trivial cells (ε = 0.1). The reference is the
transcription of verl-agent's GiGPO in tests/advantages/gigpo_reference.py (quadratic
return computation), timed on the same batch; the HGPO presets are timed against
verl-agent's HGPO (tests/advantages/hgpo_reference.py, K = 2, the same batch). Prints a
table and writes JSON.
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
from tests.advantages.gigpo_reference import gigpo_advantages
from tests.advantages.hgpo_reference import hgpo_advantages

ROOT = Path(__file__).resolve().parents[1]

ROLLOUTS, LENGTH, STATES = 8, 50, 30
SCALED = ("gigpo", "bipace_q", "gagpo", "hgpo")  # presets whose time is measured over batch sizes


def make_batch(groups: int, dim: int, *, length: int = LENGTH, noise: float = 0.3, seed: int = 0) -> StepBatch:
    gen = torch.Generator().manual_seed(seed)
    n = groups * ROLLOUTS * length
    group = torch.arange(groups).repeat_interleave(ROLLOUTS * length)
    traj = torch.arange(groups * ROLLOUTS).repeat_interleave(length)
    t = torch.arange(length).repeat(groups * ROLLOUTS)
    anchor = group * STATES + torch.randint(0, STATES, (n,), generator=gen)
    directions = torch.randn(groups * STATES, dim, generator=gen)
    hidden = directions[anchor] + noise * torch.randn(n, dim, generator=gen)
    success = (torch.rand(groups * ROLLOUTS, generator=gen) < 0.5).float()
    reward = torch.where(t == length - 1, success[traj], torch.zeros(n))
    return StepBatch(
        group=group,
        traj=traj,
        t=t,
        reward=reward,
        valid=torch.rand(n, generator=gen) > 0.05,
        anchor=anchor,
        action_key=torch.randint(0, 6, (n,), generator=gen),
        hidden=hidden,
    )


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


REFERENCES = {"gigpo": gigpo_advantages, "hgpo": lambda *args: hgpo_advantages(*args, history_length=2)}


def reference_seconds(batch: StepBatch, reference: str = "gigpo") -> float:
    """One call of the transcribed reference on `batch` (rows already in trajectory order)."""
    anchors = batch.anchor.tolist()
    args = (batch.group.numpy(), batch.traj.numpy(), batch.reward.tolist(), batch.valid.tolist(), anchors)
    start = time.perf_counter()
    REFERENCES[reference](*args)
    return time.perf_counter() - start


def reference_of(preset: str) -> str:
    """The reference a preset is timed against: verl-agent's HGPO for the hierarchy presets."""
    return "hgpo" if resolve_settings(preset).step_baseline == "hierarchy" else "gigpo"


def preset_table(groups_list, dim, repeats, with_reference):
    rows = []
    for groups in groups_list:
        batch = make_batch(groups, dim)
        n = len(batch)
        refs = {name: reference_seconds(batch, name) for name in REFERENCES} if with_reference else {}
        for name in PRESETS:
            settings = resolve_settings(name, cluster_eps=0.1)
            seconds = timed(lambda: compute_advantages(batch, settings), repeats)
            ref = refs.get(reference_of(name))
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: small batches, width 256")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "estimators.json"))
    args = parser.parse_args()

    if args.quick:
        dim, groups_list, sizes, repeats = 256, [4], [1_000, 4_000], 1
    else:
        dim, groups_list, sizes, repeats = 3584, [16, 64], [1_000, 4_000, 16_000, 25_600, 100_000], 3
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
