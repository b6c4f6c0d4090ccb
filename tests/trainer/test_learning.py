"""The policy learns: success on the tiny env rises clearly above its start.

The tiny model is warm-started on uniformly random moves (it knows the reply format,
not the task). On `goal_side="right"` tasks the optimal move never depends on the state,
so a 2-layer model can learn it from the env reward alone within CI's budget; what is
tested is the RL loop end to end: rollouts, step-level advantages, TRL's loss and
optimizer, evaluation. The runs are seeded and deterministic on CPU.
"""

from __future__ import annotations

import pytest

from bipace_trainer import BiPACETrainer

from .tiny_setup import TINY_ENV_KWARGS, tiny_args


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["bipace_q", "gigpo"])
def test_success_rises_above_its_start(preset, warm_policy, tmp_path):
    model, tokenizer = warm_policy
    args = tiny_args(
        tmp_path,
        preset=preset,
        env_kwargs=dict(TINY_ENV_KWARGS, goal_side="right"),
        max_steps=16,
        tasks_per_iteration=3,
        per_device_train_batch_size=6,
        max_turns=3,
        eval_split="train",
        eval_tasks=0,
        eval_rollouts_per_task=8,
        # at 1e-3 bipace_q rose to 0.875 by step 12, then collapsed into invalid replies (eval 0.0),
        # at 79a1f41 too, with transformers 5.24. At 5e-4 it reached >= 0.95 under seeds 0-9 run alone,
        # but inside the whole suite in CI (12-03, AVX2) the same seed fell from 0.7 to 0.575: float-level
        # differences from the process's history, amplified by a step size near the edge. At 3e-4
        # (seeds 0-3, both presets) the gain is 0.20-0.40, the dynamics slower and further from collapse.
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        logging_steps=4,
    )
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer)  # full fine-tuning of the tiny model
    trainer.train()
    trainer.close_envs()
    before, after = trainer.eval_history[0], trainer.eval_history[-1]
    assert before["tag"] == "before" and after["tag"] == "final"
    assert before["num_tasks"] == after["num_tasks"] == 40
    assert before["success_rate"] <= 0.8  # the random walk fails often within 3 turns
    assert after["success_rate"] >= before["success_rate"] + 0.15, trainer.eval_history
    assert after["episode_length"] < before["episode_length"]  # it walks straight to the goal
