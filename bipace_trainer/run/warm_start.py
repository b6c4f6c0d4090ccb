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
`<output_dir>/warm_start` before RL starts, written whole or not at all (a staging folder
renamed into place, with `warm_start.json`: the report and a fingerprint of the base model).
A resumed run (`--resume_from_checkpoint`) keeps a finished warm start instead of training
it again. Every env whose class implements `TextEnv.expert_action` can be warm-started;
the others need `--warm_start_from`.

`--warm_start_from` is checked before any weights load (`check_warm_start`): the folder
must hold a readable `adapter_config.json` and a complete weights file, LoRA flags given
next to it must agree with the adapter (the adapter is what RL trains), and `--use_peft
false` contradicts it. At load, an adapter whose `warm_start.json` fingerprints another
base model is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.base import TextEnv, resolve_env_class, stratified_subset

from .demonstrations import collect_demonstrations

__all__ = [
    "WarmStartArguments", "apply_warm_start", "check_warm_start", "demonstration_rows", "train_warm_start", "load_warm_start",
    "finished_warm_start", "base_fingerprint", "WARM_START_DIR", "WARM_START_INFO",
]

WARM_START_DIR = "warm_start"  # under output_dir
WARM_START_INFO = "warm_start.json"  # next to the adapter: the report and the base model's fingerprint
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# train.py's LoRA flags (TRL's ModelConfig) -> the adapter_config.json key they set
_LORA_FLAGS = {
    "lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "lora_target_modules": "target_modules",
    "lora_modules_to_save": "modules_to_save", "use_rslora": "use_rslora",
}  # fmt: skip


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


def check_warm_start(
    warm_args: WarmStartArguments, training_args, use_peft: bool, model_args=None, explicit: set[str] | None = None
) -> None:
    """Fail before any weights load when the warm start asked for cannot run (ValueError naming the field).

    `model_args` (TRL's ModelConfig) and `explicit` (the flags the user set) let
    `--warm_start_from` refuse LoRA flags that contradict the adapter, and an explicit `--use_peft false`.
    """
    if warm_args.warm_start_steps > 0:
        _require_expert(warm_args, training_args.env_name)
        if not use_peft:
            raise ValueError(_NEEDS_PEFT.format(steps=warm_args.warm_start_steps))
    elif warm_args.warm_start_from:
        config = _require_adapter(warm_args.warm_start_from)
        explicit = explicit or set()
        if "use_peft" in explicit and not use_peft:
            raise ValueError(
                f"use_peft=False contradicts warm_start_from={str(warm_args.warm_start_from)!r}: the warm start is a "
                "LoRA adapter, which RL trains. Drop --use_peft false, or pass --warm_start_from '' to train every weight."
            )
        if model_args is not None:
            _check_lora_flags(warm_args.warm_start_from, config, model_args, explicit)


def _check_lora_flags(path, adapter: dict[str, Any], model_args, explicit: set[str]) -> None:
    """LoRA flags the user set must describe the adapter RL continues (it is trained as saved)."""
    for flag, key in _LORA_FLAGS.items():
        if flag not in explicit or key not in adapter:
            continue
        wanted, saved = getattr(model_args, flag), adapter[key]
        if key in ("target_modules", "modules_to_save"):  # one name may come as a string
            wanted = [wanted] if isinstance(wanted, str) else list(wanted or [])
            same = set(wanted) == set([saved] if isinstance(saved, str) else saved or [])
        else:
            same = wanted == saved
        if not same:
            raise ValueError(
                f"{flag}={wanted!r} contradicts warm_start_from={str(path)!r}, whose adapter has {key}={saved!r}: RL "
                f"trains that adapter as saved. Drop --{flag}, or build a warm start with these flags (--warm_start_steps N)."
            )


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


def _require_adapter(path: str | Path) -> dict[str, Any]:
    """The adapter config of a loadable saved adapter at `path`; a ValueError naming what is wrong otherwise."""
    path = Path(path)
    where = f"warm_start_from={str(path)!r}"
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{where} holds no LoRA adapter (no adapter_config.json): give the folder a "
            f"warm start was saved to (<output_dir>/{WARM_START_DIR}, or warm_starts/ from python -m bench.warm_start_adapter), "
            "or build one with --warm_start_steps N."
        )
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: adapter_config.json is not readable JSON ({err}); save the adapter again.") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: adapter_config.json does not describe a LoRA adapter; save the adapter again.")
    weights = next((path / name for name in _WEIGHT_FILES if (path / name).is_file()), None)
    if weights is None:
        raise ValueError(
            f"{where} has adapter_config.json but no weights ({' or '.join(_WEIGHT_FILES)}): the save was cut short; "
            "copy the whole folder again, or build one with --warm_start_steps N."
        )
    if weights.suffix == ".safetensors":
        _check_safetensors(weights, where)
    return config


def _check_safetensors(weights: Path, where: str) -> None:
    """Every tensor of `weights` lies inside the file: a truncated copy fails here, not after the model loads."""
    try:
        with open(weights, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_size)) if 0 < header_size < 100_000_000 else None
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
        end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
        if 8 + header_size + end > weights.stat().st_size:
            raise ValueError(f"{weights.stat().st_size} bytes, the header needs {8 + header_size + end}")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(
            f"{where}: {weights.name} is truncated or not a safetensors file ({err}); copy it again, or build one "
            "with --warm_start_steps N."
        ) from None


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
    fingerprint = base_fingerprint(model)  # before the adapter wraps it
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    losses = [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e]
    report = {
        "steps": warm_args.warm_start_steps,
        "rows": len(rows),
        "steps_from_won_episodes": _won_fraction(rows),
        "loss": losses,
        "seconds": time.perf_counter() - start,
        "adapter": str(output_dir),
        "base_model": _base_name(model) or None,
        "base_fingerprint": fingerprint,
    }
    # Whole or not at all: a kill mid-save leaves the staging folder, never a warm start that looks finished.
    staging = output_dir.with_name(f".{WARM_START_DIR}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    trainer.save_model(str(staging))
    (staging / WARM_START_INFO).write_text(json.dumps(report, indent=2))
    shutil.rmtree(output_dir, ignore_errors=True)
    os.replace(staging, output_dir)
    return trainer.model, report


def finished_warm_start(output_dir: str | Path) -> dict[str, Any] | None:
    """The report of the warm start saved in `<output_dir>/warm_start`, or None when there is
    none or it was cut short (no `warm_start.json` next to complete weights)."""
    folder = Path(output_dir) / WARM_START_DIR
    try:
        report = json.loads((folder / WARM_START_INFO).read_text())
        _require_adapter(folder)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def base_fingerprint(model, count: int = 64) -> list[float]:
    """`count` evenly spaced values of the input embedding matrix: which base model an adapter
    was trained on, robust to the dtype it is loaded in (two initialisations differ everywhere)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weight = base.get_input_embeddings().weight.detach().float().flatten()
    # clamped: float32 rounds the last position of a large matrix (SmolLM2's 28,311,551) past its end
    index = torch.linspace(0, weight.numel() - 1, count).long().clamp(max=weight.numel() - 1)
    return [round(float(v), 6) for v in weight[index].cpu()]


def same_base(saved: list[float], model) -> bool:
    """Whether `model` is the base model `saved` (a `base_fingerprint`) was taken of: equal up to bf16 rounding."""
    import torch

    now = torch.tensor(base_fingerprint(model, len(saved)))
    saved_t = torch.tensor(saved)
    scale = saved_t.abs().mean() + 1e-8
    return bool(((now - saved_t).abs() <= 0.02 * saved_t.abs() + 0.01 * scale).all())


def apply_warm_start(model, tokenizer, warm_args: WarmStartArguments, training_args, peft_config, resume: bool = False):
    """The policy RL starts from, the `peft_config` to hand `BiPACETrainer`, and a report (None: no warm start).

    `warm_start_steps` > 0 trains a fresh adapter on the env's expert play (and ignores
    `warm_start_from`), unless `resume` and `<output_dir>/warm_start` holds a finished one,
    which is loaded (report["reused"] True); else `warm_start_from` loads a saved one; else `model` is returned
    as it is, with `peft_config`. A warm-started model is a `PeftModel` whose adapter RL
    continues, so the trainer gets no `peft_config`.
    """
    if warm_args.warm_start_steps > 0:
        finished = finished_warm_start(training_args.output_dir) if resume else None
        if finished is not None:  # a resumed run: the warm start it began from is saved whole
            path = Path(training_args.output_dir) / WARM_START_DIR
            print(f"warm start: resuming, so the finished warm start in {path} is loaded, not trained again.")
            return load_warm_start(model, path), None, {**finished, "adapter": str(path), "reused": True}
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
    config = _require_adapter(path)
    _check_base_model(path, config, model)
    try:
        policy = PeftModel.from_pretrained(model, str(path), is_trainable=True)
    except RuntimeError as err:  # "size mismatch for ...": an adapter of another base model
        base = _base_name(model) or "this model"
        raise ValueError(
            f"warm_start_from={str(path)!r} does not fit {base} ({str(err).splitlines()[0][:200]}): it was trained "
            "on another base model. Build one for this model with --warm_start_steps N, or pass --warm_start_from ''."
        ) from None
    # The adapter's config names the base model as it was where the adapter was built (the shipped
    # warm start: another machine's cache path). RL continues it on this base model, so the adapters
    # this run saves name this one, and peft finds its config when it saves them.
    base = _base_name(model)
    if base:
        for adapter_config in policy.peft_config.values():
            adapter_config.base_model_name_or_path = base
    return policy


def _base_name(model) -> str:
    """The name or path `model` was loaded from ("" when it has none, e.g. built from a config)."""
    return getattr(getattr(model, "config", None), "name_or_path", "") or ""


def _check_base_model(path: Path, config: dict[str, Any], model) -> None:
    """Refuse an adapter whose `warm_start.json` fingerprints another base model (same
    architecture, other weights: it would load without an error and act as noise)."""
    try:
        info = json.loads((path / WARM_START_INFO).read_text())
    except (OSError, ValueError):
        info = {}
    saved = info.get("base_fingerprint") if isinstance(info, dict) else None
    base = _base_name(model) or "this model"
    if saved and not same_base(saved, model):
        raise ValueError(
            f"warm_start_from={str(path)!r} was trained on another base model ({info.get('base_model') or 'unknown'}), "
            f"not {base}: its weights would not fit. Pass the model it was trained on with --model_name_or_path, or "
            "build a warm start for this model with --warm_start_steps N."
        )
    named = Path(str(config.get("base_model_name_or_path") or "")).name
    if not saved and named and named != Path(str(base)).name:
        print(f"warm start: {path} names base model {named!r}, this run's is {Path(str(base)).name!r}; loading it anyway "
              f"(it has no {WARM_START_INFO} fingerprint to check).")


def _won_fraction(rows) -> float:
    """Fraction of demonstration steps that belong to a won episode."""
    return sum(bool(row["won"]) for row in rows) / max(len(rows), 1)
