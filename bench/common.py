"""What the bench scripts share: a tiny offline policy, its SFT warm start, a transition memo, result files.

    tokenizer = train_tokenizer("textcraft", rows)          # rows from collect_demonstrations(...)
    model = tiny_model(tokenizer, hidden_size=64, layers=2)
    sft_warm_start(model, tokenizer, rows, "outputs/sft", steps=300)

A 2-core CPU can train only a tiny model, so the policy is built here, offline: a
byte-level BPE tokenizer trained on the env's own demonstration text and a small Qwen2
built from its config. The env's fixed instruction and the reply-format paragraph are
added to the tokenizer as single tokens: they are the same in every prompt, carry no
information, and would otherwise be a third of each prompt's tokens (and of its cost).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sqlite3
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from bipace_trainer.rollout.prompting import build_prompt
from envs.base import StepResult, TaskSpec, TextEnv, normalise_action, register_env, resolve_env_class
from envs.factory import make_env

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------- the tiny policy


def fixed_prompt_text(env: str) -> list[str]:
    """The parts of every prompt of `env` that never change: its instruction and the reply format."""
    formats = {build_prompt("", "", [], "", admissible).rpartition("\n\n")[2] for admissible in (None, [])}
    return [resolve_env_class(env).instruction, *sorted(formats)]


def train_tokenizer(env: str, rows: Sequence[dict[str, Any]], vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the prompts and replies of `rows`, with a chat template."""
    corpus = [row["prompt"][0]["content"] + row["completion"][0]["content"] for row in rows]
    tokenizer = bpe_chat_tokenizer(corpus, vocab_size)
    tokenizer.add_tokens(fixed_prompt_text(env))
    return tokenizer


def tiny_model(tokenizer, *, hidden_size: int = 64, layers: int = 2, seed: int = 0, **heads) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 sized for a CPU (`bipace_trainer.models.tiny_qwen2`)."""
    return tiny_qwen2(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed, **heads)


def sft_warm_start(
    model,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    output_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
    use_cpu: bool = True,
):
    """Supervised warm start with TRL's SFTTrainer on demonstration rows (loss on the reply only).

    Returns the SFT loss log. Gradient checkpointing is off: it is TRL's default to save
    memory, which a tiny model does not need, and it costs a third of the step time. On a CPU
    it trains in float32: TRL's SFTConfig defaults to bf16, which transformers now honours on a
    CPU by autocasting, 8x slower per step on this AVX2 machine (72 against 9 s/step, the
    study's 256 x 4 policy) and not what the published studies' warm starts were trained in.
    """
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_list([{"prompt": row["prompt"], "completion": row["completion"]} for row in rows])
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(20, steps // 10),
        gradient_checkpointing=False,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=use_cpu,
        **({"bf16": False} if use_cpu else {}),
        seed=seed,
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e]


# ---------------------------------------------------------------------- transition memo


class MemoEnv(TextEnv):
    """A deterministic engine behind an exact transition memo that processes share (SQLite).

    ALFWorld's engine is deterministic: a game and the commands played so far fix the
    next observation. Its resets (0.3-2 s) and steps (60-200 ms) dominate a CPU study in
    which many runs start from one warm-started policy and play largely the same
    episodes. The memo maps (task id, commands so far) to the engine's `StepResult`;
    on a miss it plays the engine, first bringing it to the episode's current state
    (reset and replay) when it is elsewhere. The agent reads exactly what the engine
    would have said; only the time differs.

    Subclass it with `inner` (the wrapped env's registry name) set; `normalise` must
    map commands as the inner env does, so that equal commands share an entry.
    `totals` counts, over the process, transitions served from the memo (hits), played
    (misses) and replayed to reach a miss's state.
    """

    inner: str = ""
    totals: Counter = Counter()

    def __init__(self, memo_path: str, **inner_kwargs: Any):
        self._inner_kwargs = inner_kwargs
        self._engine: TextEnv | None = None  # built on the first miss
        self._engine_path: tuple | None = None  # what the engine has actually played
        self._path: tuple = ()
        self._db = sqlite3.connect(memo_path, timeout=120, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS memo (key TEXT PRIMARY KEY, value TEXT)")

    @classmethod
    def tasks(cls, split: str = "train", memo_path: str = "", **inner_kwargs: Any) -> list[TaskSpec]:
        return resolve_env_class(cls.inner).tasks(split, **inner_kwargs)

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return resolve_env_class(cls.inner).splits()

    @staticmethod
    def normalise(action: str) -> str:
        # The command ALFWorld and TextCraft give their engines; an inner env that keeps
        # case (ScienceWorld, WebShop's arguments) would want normalise_action(action, lower=False).
        return normalise_action(action)

    def reset(self, task_id: int) -> StepResult:
        self._path = (int(task_id),)
        return self._lookup()

    def step(self, action: str) -> StepResult:
        self._path = (*self._path, self.normalise(action))
        return self._lookup()

    def _lookup(self) -> StepResult:
        key = json.dumps(self._path)
        row = self._db.execute("SELECT value FROM memo WHERE key = ?", (key,)).fetchone()
        if row is None:
            self.totals["misses"] += 1
            value = self._play()
            self._db.execute("INSERT OR IGNORE INTO memo VALUES (?, ?)", (key, json.dumps(value)))
        else:
            self.totals["hits"] += 1
            value = json.loads(row[0])
        self.task = value["task"]
        return StepResult(**value["result"])

    def _play(self) -> dict[str, Any]:
        if self._engine is None:
            self._engine = make_env(self.inner, **self._inner_kwargs)
        task_id, *commands = self._path
        if self._engine_path != self._path[:-1]:  # the engine is elsewhere: bring it to the parent state
            self._engine.reset(task_id)
            for command in commands[:-1]:
                self._engine.step(command)
            self.totals["replayed"] += len(commands)
        result = self._engine.step(commands[-1]) if commands else self._engine.reset(task_id)
        self._engine_path = self._path
        return {"result": dataclasses.asdict(result), "task": self._engine.task}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._engine_path = None
        self._db.close()


def memo_env(env: str) -> str:
    """Registry name of the memoised version of `env`, registering it on first use."""
    name = f"{env}-memo"
    inner = resolve_env_class(env)
    attributes = {
        "inner": env,
        "instruction": inner.instruction,
        "invalid_action": inner.invalid_action,
        "report_key": inner.report_key,
        "__module__": __name__,
    }
    register_env(name)(type(f"Memo_{env}", (MemoEnv,), attributes))
    return name


# ---------------------------------------------------------------------- results


def mean_std(values: Sequence[float]) -> dict[str, float]:
    values = [float(v) for v in values]
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and the vector ISA flags that decide kernel speed (AVX2, AVX-512,
    AMX, bf16 support): a speed figure means little without them."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return name, flags
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == (platform.processor() or platform.machine()):
            name = value.strip()
        elif key.strip() == "flags":
            flags = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma", "f16c")))
            break
    return name, flags


def machine() -> dict[str, Any]:
    """What the numbers were measured on (other jobs on the machine make timings noisy: load average)."""
    cpu, isa = cpu_model()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_isa": isa,
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()),
    }


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path
