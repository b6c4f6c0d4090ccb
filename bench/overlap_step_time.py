"""Step time with and without `max_staleness=1` (the next generation plays during the update), side by side.

    python -m bench.overlap_step_time            # tiny env, a small random Qwen2, LoRA and full fine-tuning
    python -m bench.overlap_step_time --quick    # CI size

Each variant trains the same policy on the same tasks for `--steps` optimizer steps, with
every update applied (`skip_update_without_signal=False`: a random policy's batches have no
signal, and a skipped update leaves nothing to overlap). The wall time between optimizer steps
is measured from step 2 on (generation 1 plays in the foreground in both; the defaults keep
the run inside one epoch, whose first generation also plays in the foreground), and its median is
reported with the rollout and update shares, and overlap's speed-up (off / on). On a CPU the
background rollout and the update compete for the same cores: the gain is bounded by the
cores free beside training, and it is largest when the rollout and the update take similar
time. Written to docs/results/overlap_step_time.json unless `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bipace_trainer import BiPACEConfig, BiPACETrainer  # noqa: E402
from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2  # noqa: E402
from bipace_trainer.run.demonstrations import collect_demonstrations  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class AlwaysUpdate(BiPACETrainer):
    skip_update_without_signal = False


class StepClock(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: 3 steps, hidden 64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=2,
                        help="tasks per generation (x4 rollouts each; 2: one generation per optimizer step)")
    parser.add_argument("--env-size", type=int, default=6, help="tiny env size (6: 24 train tasks, 12 generations an epoch)")
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--variants", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.hidden_size, args.layers, args.tasks, args.variants = 3, 64, 2, 2, ["lora"]
    return args


def tokenizer_for_tiny():
    rows = collect_demonstrations("tiny", range(12), env_kwargs={"size": 4}, expert_prob=0.5, max_turns=4, history_length=1)
    corpus = [r["prompt"][0]["content"] + r["completion"][0]["content"] for r in rows]
    return bpe_chat_tokenizer(corpus, vocab_size=1500)


def run(tokenizer, args, variant: str, staleness: int, work: Path) -> dict:
    model = tiny_qwen2(tokenizer, hidden_size=args.hidden_size, layers=args.layers, seed=0)
    config = BiPACEConfig(
        output_dir=str(work / f"{variant}-{staleness}"), env_name="tiny", env_kwargs={"size": args.env_size}, preset="grpo",
        max_steps=args.steps, tasks_per_iteration=args.tasks, num_generations=4, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_turns=4, history_length=1, max_completion_length=args.max_completion_length,
        evaluate_before_training=False, eval_interval=0, eval_tasks=1, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, max_staleness=staleness,
        learning_rate=1e-3 if variant == "lora" else 1e-4,
    )
    peft = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if variant == "lora" else None
    trainer = AlwaysUpdate(model, args=config, processing_class=tokenizer, peft_config=peft)
    trainer.evaluate_policy = lambda *a, **k: {}  # timing the steps, not the final evaluation
    clock = StepClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.train()
    trainer.close_envs()
    intervals = [b - a for a, b in zip(clock.times, clock.times[1:])]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    rollout = [e.get("time/rollout_s", 0.0) for e in logs[1:]]
    return {
        "variant": variant, "max_staleness": staleness, "steps": args.steps,
        "step_s_median": statistics.median(intervals) if intervals else float("nan"),
        "first_step_s": clock.times[0] - start if clock.times else float("nan"),
        "rollout_s_median": statistics.median(rollout) if rollout else float("nan"),
        "staleness_logged": [e.get("rollout/staleness") for e in logs],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer = tokenizer_for_tiny()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for variant in args.variants:
            for staleness in (0, 1):
                rows.append(run(tokenizer, args, variant, staleness, Path(work)))
                print("ROW", json.dumps(rows[-1]), flush=True)
    print(f"{'variant':8} {'max_staleness':>13} {'step s (median)':>16} {'rollout s':>10} {'speed-up':>9}")
    for row in rows:
        base = next(r for r in rows if r["variant"] == row["variant"] and r["max_staleness"] == 0)
        row["speedup_vs_off"] = base["step_s_median"] / row["step_s_median"]
        print(f"{row['variant']:8} {row['max_staleness']:>13} {row['step_s_median']:>16.3f} "
              f"{row['rollout_s_median']:>10.3f} {row['speedup_vs_off']:>8.2f}x")
    result = {
        "args": vars(args), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
    }
    out = Path(args.out) if args.out else ROOT / "docs" / "results" / "overlap_step_time.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
