"""What the learning study runs: per size, the policy and each env's warm start and RL budget.

`SIZES` names the study's sizes (`--size`); `rl_config` turns an env's plan into the RL
run's `BiPACEConfig`. What each size showed when it ran: docs/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common
from bipace_trainer import BiPACEConfig

PRESETS = ("grpo", "gigpo", "bipace_q", "gagpo", "bigagpo")


@dataclass(frozen=True)
class EnvPlan:
    """One env's warm start and RL budget."""

    env: str
    eval_splits: tuple[str, ...]  # the first is validated during training; the others at the end
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    memo: bool = False  # serve episodes through common.MemoEnv
    # warm start
    expert_prob: float = 1.0
    episodes_per_task: int = 1
    demo_variants: int = 1  # task ids t + k * demo_id_stride, k < demo_variants (same goals, other distractors)
    demo_id_stride: int = 0
    sft_steps: int = 300
    sft_batch_size: int = 8
    sft_learning_rate: float = 3e-3
    # RL
    rl_steps: int = 30
    tasks_per_iteration: int = 2
    num_generations: int = 8
    max_turns: int = 10
    eval_interval: int = 10
    eval_tasks: int = 0
    eval_rollouts_per_task: int = 1


@dataclass(frozen=True)
class Size:
    """The policy and what every env shares."""

    envs: dict[str, EnvPlan]
    model: str | None = None  # None: tiny random Qwen2 (hidden_size x layers) with a tokenizer trained on the env
    hidden_size: int = 64
    layers: int = 2
    learning_rate: float = 1e-3  # tiny model, full fine-tuning (docs/RESULTS.md, "Learning comparison")
    history_length: int = 1
    max_completion_length: int = 40
    cluster_layer: int = -2  # hidden state of the tiny model's middle (the paper: layer -8 of 28)
    seeds: int = 3
    jobs: int = 2
    device: str = "cpu"


SIZES = {
    "quick": Size(
        envs={
            "tiny": EnvPlan(
                "tiny", ("valid",), env_kwargs={"size": 4}, expert_prob=0.5, episodes_per_task=4, sft_steps=80,
                sft_learning_rate=5e-3, rl_steps=3, tasks_per_iteration=2, num_generations=4, max_turns=4, eval_interval=2,
                eval_rollouts_per_task=4,
            )
        },
        seeds=1,
        jobs=1,
    ),
    "cpu": Size(
        envs={
            "tiny": EnvPlan(
                "tiny", ("valid",), env_kwargs={"size": 6}, expert_prob=0.5, episodes_per_task=4, sft_steps=80,
                sft_learning_rate=5e-3, rl_steps=30, tasks_per_iteration=2, num_generations=8, max_turns=6,
                eval_interval=5, eval_rollouts_per_task=8,
            )
        },
        seeds=5,
    ),
    # TextCraft and ALFWorld with the tiny model: too small to win after SFT, hence the sizes
    # below (docs/RESULTS.md, "ALFWorld").
    "cpu-envs": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood"), demo_variants=3, demo_id_stride=419, sft_steps=400,
                sft_batch_size=16, rl_steps=30, tasks_per_iteration=2, num_generations=8, max_turns=10,
                eval_interval=10,
            ),
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), memo=True, expert_prob=0.8, episodes_per_task=2,
                sft_steps=300, rl_steps=16, tasks_per_iteration=2, num_generations=8, max_turns=10, eval_interval=8,
            ),
        },
    ),
    # TextCraft alone with a policy 17x the tiny env's (256 x 4, 2.7M parameters), a warm
    # start long enough to win some goals, and lr 1e-4, chosen by two pilots (docs/RESULTS.md,
    # "TextCraft: 5 presets x 3 seeds"). Its study samples rollouts at 0.5 (--set temperature=0.5).
    "cpu-textcraft": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood", "train"), demo_variants=3, demo_id_stride=419, sft_steps=1200,
                sft_batch_size=16, sft_learning_rate=1e-3, rl_steps=30, tasks_per_iteration=2, num_generations=8,
                max_turns=10, eval_interval=10, eval_tasks=48,
            ),
        },
        hidden_size=256,
        layers=4,
        learning_rate=1e-4,
    ),
    # ALFWorld with the same 256 x 4 policy: 240 generated training games (40 per task
    # type), two expert-ish episodes each, 15 turns (the expert needs up to ~12 on them).
    # RL is 10 steps, what 2 cores give the 15 runs of the comparison in about 2 hours
    # (docs/RESULTS.md, "ALFWorld").
    "cpu-alfworld": Size(
        envs={
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), env_kwargs={"train_games_per_type": 40, "eval_games_per_type": 8},
                memo=True, expert_prob=0.8, episodes_per_task=2, sft_steps=1200, sft_batch_size=16,
                sft_learning_rate=1e-3, rl_steps=10, tasks_per_iteration=2, num_generations=8, max_turns=15,
                eval_interval=10,
            ),
        },
        hidden_size=256,
        layers=4,
        learning_rate=1e-4,
    ),
    # Surface variation (issue 32, envs.SurfaceVariation) at level 1, where exact-match cells
    # collapse to singletons: the warm start's demonstrations, the RL rollouts and the evaluations
    # all see the varied text. `cpu-surface` is the tiny-env study (`cpu`) under it;
    # `cpu-textcraft-surface` the TextCraft study (run it with --set train_tasks=8 for the task mix).
    "cpu-surface": Size(
        envs={
            "tiny": EnvPlan(
                "tiny", ("valid",), env_kwargs={"size": 6, "surface_variation": 1.0}, expert_prob=0.5,
                episodes_per_task=4, sft_steps=80, sft_learning_rate=5e-3, rl_steps=30, tasks_per_iteration=2,
                num_generations=8, max_turns=6, eval_interval=5, eval_rollouts_per_task=8,
            )
        },
        seeds=5,
    ),
    "cpu-textcraft-surface": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood", "train"), env_kwargs={"surface_variation": 1.0}, demo_variants=3,
                demo_id_stride=419, sft_steps=1200, sft_batch_size=16, sft_learning_rate=1e-3, rl_steps=30,
                tasks_per_iteration=2, num_generations=8, max_turns=10, eval_interval=10, eval_tasks=48,
            ),
        },
        hidden_size=256,
        layers=4,
        learning_rate=1e-4,
        seeds=5,
    ),
    "cuda": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood"), sft_steps=100, sft_batch_size=16, sft_learning_rate=1e-5,
                rl_steps=150, tasks_per_iteration=16, num_generations=8, max_turns=15, eval_interval=10,
            ),
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), env_kwargs={"train_games_per_type": 48, "eval_games_per_type": 8},
                expert_prob=0.8, episodes_per_task=2, sft_steps=100, sft_batch_size=16, sft_learning_rate=1e-5,
                rl_steps=150, tasks_per_iteration=16, num_generations=8, max_turns=30, eval_interval=10,
            ),
        },
        model="Qwen/Qwen2.5-0.5B-Instruct",
        learning_rate=1e-6,
        history_length=2,
        max_completion_length=256,
        cluster_layer=-8,
        jobs=1,
        device="cuda",
    ),
}


def env_name_and_kwargs(plan: EnvPlan, work_dir: Path) -> tuple[str, dict[str, Any]]:
    if not plan.memo:
        return plan.env, dict(plan.env_kwargs)
    return common.memo_env(plan.env), {**plan.env_kwargs, "memo_path": str(work_dir / plan.env / "memo.sqlite")}


def rl_config(plan: EnvPlan, size: Size, work_dir: Path, output_dir: Path, preset: str = "grpo", seed: int = 0,
              overrides: dict[str, Any] | None = None):
    """The RL run's `BiPACEConfig`; `overrides` (from --set) replace any field, e.g. cluster_eps."""
    env_name, env_kwargs = env_name_and_kwargs(plan, work_dir)
    fields = dict(
        output_dir=str(output_dir),
        env_name=env_name,
        env_kwargs=env_kwargs,
        preset=preset,
        seed=seed,
        max_steps=plan.rl_steps,
        learning_rate=size.learning_rate,
        lr_scheduler_type="constant",
        tasks_per_iteration=plan.tasks_per_iteration,
        num_generations=plan.num_generations,
        # one rollout batch = one optimizer step, accumulated over one micro-batch per task group
        per_device_train_batch_size=plan.num_generations,
        gradient_accumulation_steps=plan.tasks_per_iteration,
        max_turns=plan.max_turns,
        history_length=size.history_length,
        max_completion_length=size.max_completion_length,
        cluster_layer=size.cluster_layer,
        capture_hidden_states=True,  # both partitions are measured on every preset (runner.StudyTrainer)
        eval_split=plan.eval_splits[0],
        eval_tasks=plan.eval_tasks,
        eval_rollouts_per_task=plan.eval_rollouts_per_task,
        eval_interval=plan.eval_interval,
        evaluate_before_training=False,  # the warm start is evaluated once for all runs
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=size.device == "cpu",
        bf16=size.device != "cpu",  # float32 on a CPU (GRPOConfig's default would autocast to bf16 there)
    )
    return BiPACEConfig(**{**fields, **(overrides or {})})
