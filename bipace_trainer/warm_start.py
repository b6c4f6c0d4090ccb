"""Supervised warm start before RL: LoRA SFT with TRL's `SFTTrainer` on (perturbed) expert play.

    # in train.py: SFT for 60 steps on the env's expert play, then RL from that adapter
    python train.py --warm_start_steps 60
    # or start RL from an adapter saved by an earlier warm start
    python train.py --warm_start_from outputs/run/warm_start

A small model (SmolLM2-135M) never produces the `<think>…</think><action>…</action>`
reply on its own, so every RL batch is invalid and every advantage zero. A short SFT on
the env's expert play teaches it the format and a policy that sometimes wins, which is
where group-relative RL has signal. The demonstrations (`demonstrations.collect_demonstrations`)
are built with the prompt builder the rollout uses, the run's `history_length` and
`max_turns`, from the run's `train_split` (never its evaluation tasks): the warm-started
policy sees at RL time exactly the prompts it was trained on. With `warm_start_expert_prob`
< 1 each step takes a random admissible action instead of the expert's (envs that list
their admissible actions), so the data also holds recoverable mistakes.

The adapter is a `peft` LoRA adapter on the base model, built from the run's LoRA flags
(`--lora_r`, `--lora_target_modules`, ...). RL trains that same adapter further
(`BiPACETrainer` with the `PeftModel` and no `peft_config`); it is saved to
`<output_dir>/warm_start` before RL starts. Every env whose class implements
`TextEnv.expert_action` can be warm-started; the others need `--warm_start_from`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.base import TextEnv, resolve_env_class, stratified_subset

from .demonstrations import collect_demonstrations

__all__ = [
    "WarmStartArguments", "apply_warm_start", "check_warm_start", "demonstration_rows", "train_warm_start", "load_warm_start", "WARM_START_DIR",
]

WARM_START_DIR = "warm_start"  # under output_dir


@dataclass
class WarmStartArguments:
    """
    > Parameters of the supervised warm start (before RL, same run)

    warm_start_steps (`int`, 0): SFT optimizer steps on expert demonstrations before RL; 0: none.
    warm_start_from (`str` or `None`): a saved warm-start LoRA adapter to start RL from (a
        folder with `adapter_config.json`); ignored when `warm_start_steps` > 0, which rebuilds it.
    warm_start_tasks (`int`, 64): training tasks whose expert play is demonstrated (spread over
        task types/depths like `train_tasks`; 0: all of `train_split`).
    warm_start_episodes_per_task (`int`, 1): demonstrated episodes per task.
    warm_start_expert_prob (`float`, 0.8): probability that a demonstrated step is the expert's
        action, else a random admissible one (envs without an admissible list always take the expert's).
    warm_start_batch_size (`int`, 4), warm_start_learning_rate (`float`, 5e-4): SFT batch and
        learning rate (constant after 10% warm-up).
    """

    warm_start_steps: int = field(
        default=0, metadata={"help": "SFT optimizer steps on expert demonstrations before RL (0: no warm start)."}
    )
    warm_start_from: str | None = field(
        default=None,
        metadata={"help": "Start RL from this saved warm-start LoRA adapter (ignored when warm_start_steps > 0)."},
    )
    warm_start_tasks: int = field(default=64, metadata={"help": "Training tasks demonstrated (0: all of train_split)."})
    warm_start_episodes_per_task: int = field(default=1, metadata={"help": "Demonstrated episodes per task."})
    warm_start_expert_prob: float = field(
        default=0.8, metadata={"help": "Probability a demonstrated step is the expert's action (else random admissible)."}
    )
    warm_start_batch_size: int = field(default=4, metadata={"help": "SFT batch size."})
    warm_start_learning_rate: float = field(default=5e-4, metadata={"help": "SFT learning rate (LoRA)."})

    def __post_init__(self):
        checks = [
            (self.warm_start_steps >= 0, "warm_start_steps", "must be >= 0 (0 = no warm start)"),
            (self.warm_start_tasks >= 0, "warm_start_tasks", "must be >= 0 (0 = all of train_split)"),
            (self.warm_start_episodes_per_task >= 1, "warm_start_episodes_per_task", "must be >= 1"),
            (0.0 <= self.warm_start_expert_prob <= 1.0, "warm_start_expert_prob", "must lie in [0, 1]"),
            (self.warm_start_batch_size >= 1, "warm_start_batch_size", "must be >= 1"),
            (self.warm_start_learning_rate > 0, "warm_start_learning_rate", "must be > 0"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {message}.")
        if self.warm_start_from == "":
            self.warm_start_from = None


def has_expert(env_name: str) -> bool:
    env_class = resolve_env_class(env_name)
    return isinstance(env_class, type) and env_class.expert_action is not TextEnv.expert_action


def check_warm_start(warm_args: WarmStartArguments, training_args, use_peft: bool) -> None:
    """Fail before any weights load when the warm start asked for cannot run (ValueError naming the field)."""
    if warm_args.warm_start_steps > 0:
        _require_expert(warm_args, training_args.env_name)
        if not use_peft:
            raise ValueError(_NEEDS_PEFT.format(steps=warm_args.warm_start_steps))
    elif warm_args.warm_start_from:
        _require_adapter(warm_args.warm_start_from)


_NEEDS_PEFT = (
    "warm_start_steps={steps} trains a LoRA adapter: add --use_peft true (with --lora_r and "
    "--lora_target_modules as for RL), or set --warm_start_steps 0."
)


def _require_expert(warm_args: WarmStartArguments, env_name: str) -> None:
    if not has_expert(env_name):
        raise ValueError(
            f"warm_start_steps={warm_args.warm_start_steps}: env_name={env_name!r} has no expert "
            "(its class does not implement expert_action), so there is nothing to demonstrate; "
            "start from a saved adapter with --warm_start_from PATH, or set --warm_start_steps 0."
        )


def _require_adapter(path: str | Path) -> None:
    if not (Path(path) / "adapter_config.json").is_file():
        raise ValueError(
            f"warm_start_from={str(path)!r} holds no LoRA adapter (no adapter_config.json): give the folder a "
            f"warm start was saved to (<output_dir>/{WARM_START_DIR}, or warm_starts/ from python -m bench.warm_start_adapter), "
            "or build one with --warm_start_steps N."
        )


def demonstration_rows(training_args, warm_args: WarmStartArguments) -> list[dict[str, Any]]:
    """SFT rows of (perturbed) expert play on the run's training tasks, prompts as the rollout builds them.

    Tasks: the run's `train_tasks` subset of `train_split`, of which `warm_start_tasks`
    spread over task types (`stratified_subset`). Episodes stop at the run's `max_turns`.
    """
    env_name = training_args.env_name
    _require_expert(warm_args, env_name)
    env_class = resolve_env_class(env_name)
    specs = env_class.tasks(training_args.train_split, **training_args.env_kwargs)
    specs = stratified_subset(specs, training_args.train_tasks, env_class.report_key, "train_tasks")
    specs = stratified_subset(specs, warm_args.warm_start_tasks, env_class.report_key, "warm_start_tasks")
    return collect_demonstrations(
        env_name,
        [spec.task_id for spec in specs],
        env_kwargs=training_args.env_kwargs,
        expert_prob=warm_args.warm_start_expert_prob,
        episodes_per_task=warm_args.warm_start_episodes_per_task,
        max_turns=training_args.max_turns,
        history_length=training_args.history_length,
        seed=training_args.seed,
    )


def train_warm_start(model, tokenizer, rows, peft_config, warm_args: WarmStartArguments, training_args):
    """LoRA SFT of `model` on `rows` with TRL's `SFTTrainer` (loss on the reply only).

    Returns (the `PeftModel` with its trainable adapter, a report: loss per logged step,
    rows, won fraction, seconds). The adapter is saved to `<output_dir>/warm_start`.
    Gradient checkpointing is off: it saves memory a small model does not need and costs
    a third of the step time. Deterministic on a CPU for a fixed thread count and seed.
    """
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if peft_config is None:
        raise ValueError(_NEEDS_PEFT.format(steps=warm_args.warm_start_steps))
    if not rows:
        raise ValueError(
            f"warm_start_steps={warm_args.warm_start_steps}: the expert produced no demonstration steps on "
            f"{training_args.env_name!r}; check env_kwargs and train_split, or set --warm_start_steps 0."
        )
    output_dir = Path(training_args.output_dir) / WARM_START_DIR
    dataset = Dataset.from_list([{"prompt": row["prompt"], "completion": row["completion"]} for row in rows])
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=warm_args.warm_start_steps,
        per_device_train_batch_size=warm_args.warm_start_batch_size,
        learning_rate=warm_args.warm_start_learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=max(1, warm_args.warm_start_steps // 10),
        gradient_checkpointing=False,
        logging_steps=max(1, warm_args.warm_start_steps // 20),
        save_strategy="no",
        report_to="none",
        seed=training_args.seed,
        bf16=training_args.bf16,
        fp16=training_args.fp16,
        use_cpu=training_args.use_cpu,
        disable_tqdm=training_args.disable_tqdm,
        dataset_num_proc=None,
    )
    start = time.perf_counter()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(str(output_dir))
    losses = [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e]
    report = {
        "steps": warm_args.warm_start_steps,
        "rows": len(rows),
        "steps_from_won_episodes": _won_fraction(rows),
        "loss": losses,
        "seconds": time.perf_counter() - start,
        "adapter": str(output_dir),
    }
    return trainer.model, report


def apply_warm_start(model, tokenizer, warm_args: WarmStartArguments, training_args, peft_config):
    """The policy RL starts from, the `peft_config` to hand `BiPACETrainer`, and a report (None: no warm start).

    `warm_start_steps` > 0 trains a fresh adapter on the env's expert play (and ignores
    `warm_start_from`); else `warm_start_from` loads a saved one; else `model` is returned
    as it is, with `peft_config`. A warm-started model is a `PeftModel` whose adapter RL
    continues, so the trainer gets no `peft_config`.
    """
    if warm_args.warm_start_steps > 0:
        if warm_args.warm_start_from:
            print(f"warm start: training {warm_args.warm_start_steps} SFT steps; warm_start_from is not loaded.")
        rows = demonstration_rows(training_args, warm_args)
        model, report = train_warm_start(model, tokenizer, rows, peft_config, warm_args, training_args)
        return model, None, report
    if warm_args.warm_start_from:
        return load_warm_start(model, warm_args.warm_start_from), None, {"adapter": str(warm_args.warm_start_from)}
    return model, peft_config, None


def load_warm_start(model, path: str | Path):
    """`model` with the saved warm-start adapter at `path`, trainable (RL continues it)."""
    from peft import PeftModel

    path = Path(path)
    _require_adapter(path)
    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=True)
    except RuntimeError as err:  # "size mismatch for ...": an adapter of another base model
        base = getattr(getattr(model, "config", None), "_name_or_path", "this model")
        raise ValueError(
            f"warm_start_from={str(path)!r} does not fit {base} ({str(err).splitlines()[0][:200]}): it was trained "
            "on another base model. Build one for this model with --warm_start_steps N, or pass --warm_start_from ''."
        ) from None


def _won_fraction(rows) -> float:
    """Fraction of demonstration steps that belong to a won episode."""
    return sum(bool(row["won"]) for row in rows) / max(len(rows), 1)
