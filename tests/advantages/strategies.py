"""Hypothesis strategies for random step batches, and converters to StepBatch."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from bipace_trainer.advantages import StepBatch

# A few fixed directions, so hidden states repeat (same state) or differ by clear angles.
PROTOTYPES = [
    [1.0, 0.0, 0.0],
    [0.0, 1.0, 0.0],
    [1.0, 1.0, 0.0],
    [1.0, 0.0, 2.0],
    [-1.0, 2.0, 1.0],
    [2.0, 1.0, -1.0],
]

REWARDS = [0.0, 0.0, 1.0, 0.5, -1.0, 10.0]


@st.composite
def step_lists(draw, max_groups=4, max_traj=4, max_len=6, num_anchors=4, num_keys=3):
    """A shuffled flat list of step dicts: variable lengths, singletons, repeated anchors,
    one-trajectory groups, all-equal rewards (sparse terminal rewards) all occur; milestone
    flags at random (what BEACON's segments and return read)."""
    steps = []
    group_ids = draw(st.lists(st.integers(-50, 50), min_size=1, max_size=max_groups, unique=True))
    traj_ids = iter(draw(st.permutations(range(1000, 1000 + max_groups * max_traj))))
    sparse = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 1.0, 3.0]))  # hidden states of another norm
    for g in group_ids:
        for _ in range(draw(st.integers(1, max_traj))):
            traj = next(traj_ids)
            length = draw(st.integers(1, max_len))
            success = draw(st.sampled_from([0.0, 1.0]))
            truncated = draw(st.booleans())  # the turn budget cut it (read only with bootstrap_truncated)
            for t in range(length):
                if sparse:
                    reward = success if t == length - 1 else 0.0
                else:
                    reward = draw(st.sampled_from(REWARDS))
                anchor = draw(st.integers(0, num_anchors - 1))
                proto = draw(st.integers(0, len(PROTOTYPES) - 1))
                steps.append(
                    dict(
                        group=g,
                        traj=traj,
                        t=t,
                        reward=reward,
                        valid=draw(st.sampled_from([True, True, True, False])),
                        anchor=f"obs-{anchor}",
                        key=f"act-{draw(st.integers(0, num_keys - 1))}",
                        hidden=[scale * v for v in PROTOTYPES[proto]],
                        truncated=truncated and t == length - 1,
                        milestone=draw(st.booleans()),
                    )
                )
    order = draw(st.permutations(range(len(steps))))
    return [steps[i] for i in order]


def to_batch(steps) -> StepBatch:
    return StepBatch(
        group=[s["group"] for s in steps],
        traj=[s["traj"] for s in steps],
        t=[s["t"] for s in steps],
        reward=[s["reward"] for s in steps],
        valid=[s["valid"] for s in steps],
        anchor=[s["anchor"] for s in steps],
        action_key=[s["key"] for s in steps],
        hidden=torch.tensor([s["hidden"] for s in steps], dtype=torch.float32),
        truncated=[s.get("truncated", False) for s in steps],
        milestone=[s.get("milestone", False) for s in steps],
    )
