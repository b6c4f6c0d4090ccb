"""GraphGPO as the trainer trains it: every episode's end, recorded by the rollout the trainer played,
reaches the estimator, whose advantages are the reference's (verl-agent `core_graph.py`, transcribed
in tests/advantages/graphgpo_reference.py) on those very batches."""

from __future__ import annotations

import pytest
import torch

from envs.tiny import TinyEnv
from tests.advantages.graphgpo_reference import graphgpo_advantages, replayed_rows

from .tiny_setup import TINY_ENV_KWARGS, CapturingTrainer, tiny_args


@pytest.mark.slow
def test_the_trainers_graphgpo_advantages_are_the_references_on_the_batches_it_played(warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path, preset="graphgpo", episode_stats="steps", evaluate_before_training=False, eval_tasks=1,
                     rollout_dump_steps=1)  # fmt: skip
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer)
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    known_ends = 0
    for rollout, advantages, _ in trainer.captured:
        # the reference's rows from the env alone: each episode's actions replayed on a fresh tiny env
        rows = replayed_rows(rollout, lambda: TinyEnv(**TINY_ENV_KWARGS))
        group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
        reference = graphgpo_advantages(group, traj, reward, valid, anchor, nxt, gamma=0.1, exact_mean=True,
                                        dtype=torch.float64)  # fmt: skip
        position = {(s.traj, s.t): i for i, s in enumerate(rollout.steps)}
        ours = advantages[[position[key] for key in zip(traj, t)]]
        torch.testing.assert_close(ours, reference.to(torch.float32), atol=1e-5, rtol=0)
        seen = set(zip(group, anchor))
        ended = {(g, j): n for g, j, _, _, _, _, n in rows}  # each trajectory's last row wins: its end
        known_ends += sum((g, end) in seen for (g, _), end in ended.items() if end != "success")
    # what tells the reference's end rule from a dead end happened in these batches: a lost or cut
    # episode whose final observation is a state its group's steps were taken from
    assert known_ends > 0
    logged = [entry for entry in trainer.state.log_history if "graph/failed_ends_known" in entry]
    assert len(logged) == args.max_steps and all(entry["graph/dead_ends"] == 0 for entry in logged)
    # the dumps keep each episode's end
    dumped = [line for line in (tmp_path / "rollouts" / "step-000001.jsonl").read_text().splitlines()]
    assert dumped and all('"final_observation": "' in line for line in dumped)
