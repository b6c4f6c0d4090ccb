"""Every preset outside the GAGPO family keeps its output (issue 20: only GAGPO's penalty
handling and the opt-in `bootstrap_truncated` may change behaviour).

Deterministic, hypothesis-free: fixed batches from a seeded `torch.Generator` (invalid
steps, repeated anchors, singleton cells and task groups, lengths 1-7, truncation marks
that must be ignored without `bootstrap_truncated`), plus the 37-row batch hypothesis
once found, each checked over several γ / penalty / norm / weights / ε against the loop
references in this folder, computed in float64 (`reference.py`; for `gigpo` in
compatibility mode also `gigpo_reference.py` in float64). The package returns float32,
so the tolerance is 1e-6 plus the float32 rounding of the value itself.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from bipace_trainer.advantages import compute_advantages, resolve_settings

from . import reference
from .gigpo_reference import gigpo_advantages
from .strategies import to_batch

# Every built-in preset but GAGPO's (`gagpo`, `bigagpo`: baseline "gae").
PRESETS_KEPT = ["grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff"]

PROTOTYPES = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 2.0], [-1.0, 2.0, 1.0]]
REWARDS = [0.0, 0.0, 1.0, 0.5, -1.0, 10.0]

# The batch hypothesis found for test_gigpo_compat (gigpo, episode_stats="steps",
# norm="mean_std", γ=0.9, penalty=0.1, w=1): in group 3 the cell "obs-1" holds
# γ·1 = 0.9 (traj 1005) and 1 - 0.1 = 0.9 (traj 1006, invalid success), an exact tie,
# so A^s = 0 there (QUIRKS["tied_returns_make_a_zero_std_cell"]).
# (group, traj, t, reward, valid, anchor), key "act-0", hidden [1, 0, 0], not truncated.
HYPOTHESIS_ROWS = (
    [(0, 1000, t, 0.0, True, "obs-0") for t in range(4)]
    + [(0, 1001, t, 0.0, True, "obs-0") for t in range(5)]
    + [(1, 1002, t, 0.0, True, "obs-0") for t in range(8)]
    + [(1, 1003, t, 0.0, True, "obs-0") for t in range(6)]
    + [(2, 1004, t, 0.0, True, "obs-0") for t in range(5)]
    + [(3, 1005, 0, 0.0, True, "obs-0"), (3, 1005, 1, 0.0, True, "obs-1"), (3, 1005, 2, 1.0, True, "obs-0")]
    + [(3, 1006, t, 0.0, True, "obs-0") for t in range(5)]
    + [(3, 1006, 5, 1.0, False, "obs-1")]
)
HYPOTHESIS_SETTINGS = dict(advantage_norm="mean_std", step_gamma=0.9, invalid_action_penalty=0.1, w_step=1.0)


def hypothesis_steps():
    return [
        dict(group=g, traj=tr, t=t, reward=r, valid=v, anchor=a, key="act-0", hidden=[1.0, 0.0, 0.0], truncated=False)
        for g, tr, t, r, v, a in HYPOTHESIS_ROWS
    ]


def random_steps(seed: int):
    """A shuffled flat list of step dicts (`reference`'s format) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low, high):  # inclusive
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def coin(p):
        return bool(torch.rand(1, generator=gen) < p)

    steps, traj = [], 1000
    sparse = coin(0.5)
    for group in range(randint(1, 4)):
        num_anchors = randint(1, 4)  # 1: every state repeated; 4: many singleton cells
        for _ in range(randint(1, 4)):  # 1: a task group of one trajectory
            length, success, truncated = randint(1, 7), float(coin(0.5)), coin(0.3)
            for t in range(length):
                reward = (success if t == length - 1 else 0.0) if sparse else REWARDS[randint(0, len(REWARDS) - 1)]
                proto = randint(0, len(PROTOTYPES) - 1)
                scale = [0.5, 1.0, 3.0][randint(0, 2)]
                steps.append(
                    dict(
                        group=group * 7 - 5,
                        traj=traj,
                        t=t,
                        reward=reward,
                        valid=coin(0.7),
                        anchor=f"obs-{randint(0, num_anchors - 1)}",
                        key=f"act-{randint(0, 2)}",
                        hidden=[scale * v for v in PROTOTYPES[proto]],
                        truncated=truncated and t == length - 1,
                    )
                )
            traj += 1
    order = torch.randperm(len(steps), generator=gen).tolist()
    return [steps[i] for i in order]


SEEDS = range(16)
GRID = list(
    itertools.product(
        [0.5, 0.9, 0.95, 1.0],  # gamma
        [0.0, 0.1, 0.5],  # invalid_penalty
        ["mean", "mean_std"],  # norm
        [(1.0, 1.0), (1.0, 0.8), (0.0, 1.0)],  # (w_ep, w_step)
        ["trajectory", "steps"],  # episode_stats
        ["mean", "mean_std"],  # pace_norm
        [0.0, 0.05, 0.3, 1.0],  # cluster_eps of the hidden partition
    )
)


def cases():
    """(id, steps, preset, overrides, eps): a few grid points per preset and batch."""
    out = [("hypothesis-gigpo-steps", hypothesis_steps(), "gigpo", dict(HYPOTHESIS_SETTINGS, episode_stats="steps"), None)]
    for seed in SEEDS:
        steps = random_steps(seed)
        pick = torch.Generator().manual_seed(10_000 + seed)
        for preset in PRESETS_KEPT:
            for k in torch.randperm(len(GRID), generator=pick)[:4].tolist():
                gamma, penalty, norm, (w_ep, w_step), episode_stats, pace_norm, eps = GRID[k]
                overrides = dict(
                    step_gamma=gamma, invalid_action_penalty=penalty, advantage_norm=norm, episode_stats=episode_stats,
                    pace_norm=pace_norm,
                )
                if preset != "grpo":
                    overrides.update(w_ep=w_ep, w_step=w_step)
                out.append((f"seed{seed}-{preset}-{k}", steps, preset, overrides, eps))
        for preset in PRESETS_KEPT:  # the same batch once more, hypothesis' settings
            out.append((f"seed{seed}-{preset}-hyp", steps, preset, dict(HYPOTHESIS_SETTINGS), 0.3))
    return out


CASES = cases()


def test_the_cases_cover_what_they_should():
    all_steps = [s for _, steps, _, _, _ in CASES for s in steps]
    assert any(not s["valid"] for s in all_steps) and any(s["truncated"] for s in all_steps)
    for seed in SEEDS:
        cells = reference.members_of(reference.hash_cells(random_steps(seed)))
        assert max(map(len, cells.values())) > 1
    sizes = [len(m) for seed in SEEDS for m in reference.members_of(reference.hash_cells(random_steps(seed))).values()]
    assert 1 in sizes  # singleton cells
    lengths = {len(idx) for seed in SEEDS for idx in reference.trajectories(random_steps(seed)).values()}
    assert {1, 7} <= lengths
    assert {p for _, _, p, _, _ in CASES} == set(PRESETS_KEPT)


@pytest.mark.parametrize("case_id,steps,preset,overrides,eps", CASES, ids=[c[0] for c in CASES])
def test_preset_matches_reference(case_id, steps, preset, overrides, eps):
    settings = resolve_settings(preset, **overrides)
    eps = eps if settings.step_partition == "hidden" else None
    expected, margin = reference.advantages(steps, settings, eps)
    if margin <= 1e-6:  # float32 cosine distances are good to ~1e-7
        pytest.skip("a join decision within float rounding of ε")
    got = compute_advantages(to_batch(steps), settings, cluster_eps=eps)[0]
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=2.0**-23)  # rtol: the float32 output

    if preset == "gigpo" and settings.episode_stats == "steps" and settings.w_ep == 1.0:  # and verl-agent's
        rows = sorted(steps, key=lambda s: (s["traj"], s["t"]))
        ours = compute_advantages(to_batch(rows), settings)[0]
        ref = gigpo_advantages(
            [s["group"] for s in rows],
            [s["traj"] for s in rows],
            [s["reward"] for s in rows],
            [s["valid"] for s in rows],
            [s["anchor"] for s in rows],
            gamma=settings.step_gamma,
            penalty_coef=settings.invalid_action_penalty,
            mode={"mean_std": "mean_std_norm", "mean": "mean_norm"}[settings.advantage_norm],
            w=settings.w_step,
            dtype=torch.float64,
        )
        torch.testing.assert_close(ours.double(), ref, atol=1e-6, rtol=2.0**-23)


def test_few_cases_are_skipped():
    skipped = 0
    for _, steps, preset, overrides, eps in CASES:
        settings = resolve_settings(preset, **overrides)
        if settings.step_partition == "hidden" and settings.w_step:
            skipped += reference.hidden_cells(steps, eps)[1] <= 1e-6
    assert skipped <= len(CASES) // 10
