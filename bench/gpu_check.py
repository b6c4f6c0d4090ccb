"""The GPU check (`bash bench/gpu_check.sh` runs it): bf16 LoRA train steps on the HF path with
random-initialised Qwen2.5-0.5B and -1.5B, lockstep against continuous rollouts.

    python -m bench.gpu_check [--sizes 0.5b,1.5b] [--steps 3] [--budget_s 480] [--out PATH]

Nothing comes from the Hub: each model is a `Qwen2ForCausalLM` built from a `Qwen2Config` with
the published sizes of Qwen2.5-0.5B / 1.5B (vocabulary 151,936 included, so the LM head costs
what it costs), random weights, bf16, on the GPU; the tokenizer is a byte-level BPE trained
offline on the env's text (`bipace_trainer.models.bpe_chat_tokenizer`, as the tests do). The env
is the repo's `tiny` grid walk (no env package needed). A random policy wins nothing, so
`skip_update_without_signal` is off: every step runs its update, with zero advantages.

For each size and rollout mode (`BiPACEConfig.rollout_mode`, `lockstep` and `continuous`;
a checkout without that field runs lockstep only and says so): the wall time of each train step,
the rollout's seconds and generated tokens (tokens/s), the update's seconds, and the peak GPU
memory (`torch.cuda.max_memory_allocated`, reset before each run). Everything goes into one JSON,
`$OUT/gpu_check.json` when OUT is set. A run that fails is recorded with its error and the check
goes on; runs that would start after `--budget_s` are recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The published Qwen2.5 sizes (config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B).
QWEN25_SIZES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
QWEN25_VOCAB = 151936
# --cpu_smoke: the same code path on a CPU with a tiny Qwen2, to check the script without a GPU.
SMOKE_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
MODES = ("lockstep", "continuous")
NEEDS_GPU = "gpu_check: needs a GPU (torch.cuda.is_available() is False here); nothing was run."


def output_path(out: str | None) -> Path:
    if out:
        return Path(out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "outputs" / "gpu_check" / "gpu_check.json"


def supported_modes() -> tuple[list[str], str | None]:
    """The rollout modes this checkout's BiPACEConfig takes, and a note when continuous is missing."""
    from bipace_trainer import BiPACEConfig

    if "rollout_mode" in {f.name for f in dataclasses.fields(BiPACEConfig)}:
        return list(MODES), None
    return ["lockstep"], "BiPACEConfig has no rollout_mode in this checkout: lockstep only"


def make_tokenizer():
    from bipace_trainer.run.demonstrations import collect_demonstrations
    from bipace_trainer.models import bpe_chat_tokenizer

    rows = collect_demonstrations("tiny", range(16), env_kwargs={"size": 4}, expert_prob=0.5, max_turns=4,
                                  history_length=1)
    corpus = [r["prompt"][0]["content"] + r["completion"][0]["content"] for r in rows]
    return bpe_chat_tokenizer(corpus, vocab_size=2000)


def make_model(size: str, tokenizer, seed: int = 0, smoke: bool = False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer) if smoke else QWEN25_VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, **(SMOKE_SIZE if smoke else QWEN25_SIZES[size]),
    )
    with torch.device("cpu" if smoke else "cuda"):
        model = Qwen2ForCausalLM(config).to(torch.float32 if smoke else torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def run_one(size: str, mode: str | None, steps: int, tokenizer, output_dir: str, smoke: bool = False) -> dict[str, Any]:
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback

    from bipace_trainer import BiPACEConfig, BiPACETrainer

    if not smoke:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    settings = dict(
        output_dir=output_dir, env_name="tiny", env_kwargs={"size": 4}, max_steps=steps, tasks_per_iteration=4,
        num_generations=4, per_device_train_batch_size=16, max_turns=4, history_length=1,
        max_completion_length=8 if smoke else 64, temperature=1.0, eval_tasks=0, bf16=not smoke, use_cpu=smoke,
        gradient_checkpointing=True,
        learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        resample_without_signal=0,
    )
    if smoke:
        settings["cluster_layer"] = -1  # the default, -8, is deeper than the smoke model's 2 layers
    if mode is not None:
        settings["rollout_mode"] = mode
    args = BiPACEConfig(**settings)
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             task_type="CAUSAL_LM")
    model = make_model(size, tokenizer, smoke=smoke)
    parameters = sum(p.numel() for p in model.parameters())

    class Timed(BiPACETrainer):
        skip_update_without_signal = False  # a random policy has no signal; time the update anyway

        def collect(self, tasks, prefetched=None):
            start = time.perf_counter()
            scored = super().collect(tasks, prefetched)
            rollouts.append({
                "seconds": time.perf_counter() - start,
                "tokens": sum(len(s.completion_ids or []) for s in scored.rollout.steps),
                "samples": len(scored.rollout.steps),
            })
            return scored

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if not smoke:
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.start)

    rollouts: list[dict[str, float]] = []
    step_seconds: list[float] = []
    trainer = Timed(model=model, args=args, processing_class=tokenizer, peft_config=peft_config,
                    callbacks=[StepClock()])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.close_envs()
    later = step_seconds[1:] or step_seconds  # the first step holds the CUDA warm-up
    tokens = sum(r["tokens"] for r in rollouts[1:] or rollouts)
    rollout_seconds = sum(r["seconds"] for r in rollouts[1:] or rollouts)
    updates = [s - r["seconds"] for s, r in zip(step_seconds, rollouts)]
    result = {
        "size": size,
        "rollout_mode": mode or "lockstep",
        "parameters": parameters,
        "steps": len(step_seconds),
        "wall_s": round(wall, 2),
        "step_s": [round(s, 3) for s in step_seconds],
        "median_step_s_after_first": round(statistics.median(later), 3) if later else None,
        "rollout_s": [round(r["seconds"], 3) for r in rollouts],
        "update_s": [round(u, 3) for u in updates],
        "generated_tokens": [r["tokens"] for r in rollouts],
        "samples": [r["samples"] for r in rollouts],
        "rollout_tokens_per_s_after_first": round(tokens / rollout_seconds, 1) if rollout_seconds else None,
        "peak_gpu_memory_gib": None if smoke else round(torch.cuda.max_memory_allocated() / 2**30, 3),
    }
    del trainer, model
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(QWEN25_SIZES)}")
    parser.add_argument("--steps", type=int, default=3, help="train steps per size and mode (the first is warm-up)")
    parser.add_argument("--budget_s", type=float, default=480.0, help="start no run after this many seconds")
    parser.add_argument("--out", default=None, help="the JSON (default $OUT/gpu_check.json)")
    parser.add_argument("--cpu_smoke", action="store_true",
                        help="no GPU: one tiny Qwen2 on the CPU through the same code (checks the script, measures nothing)")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(QWEN25_SIZES))
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(QWEN25_SIZES)}")

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(NEEDS_GPU)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    import trl

    out = output_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    modes, note = supported_modes()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": "none (--cpu_smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "trl": trl.__version__, "python": sys.version.split()[0],
        "settings": {"tasks_per_iteration": 4, "num_generations": 4, "max_turns": 4, "max_completion_length": 64,
                     "lora_r": 16, "dtype": "bf16", "gradient_checkpointing": True, "env": "tiny"},
        "modes": modes, "note": note, "runs": [],
    }
    start = time.perf_counter()
    tokenizer = make_tokenizer()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        for size in sizes:
            for mode in modes:
                label = f"{size} {mode}"
                if time.perf_counter() - start > args.budget_s:
                    result["runs"].append({"size": size, "rollout_mode": mode, "skipped": "over --budget_s"})
                    print(f"[gpu_check] {label}: skipped (over the {args.budget_s:.0f} s budget)", flush=True)
                    continue
                print(f"[gpu_check] {label}: {args.steps} steps", flush=True)
                try:
                    row = run_one(size, mode if note is None else None, args.steps, tokenizer,
                                  str(Path(scratch) / f"{size}-{mode}"), smoke=args.cpu_smoke)
                except Exception as err:  # one failing run must not lose the others' figures
                    row = {"size": size, "rollout_mode": mode, "error": f"{type(err).__name__}: {err}",
                           "traceback": traceback.format_exc()[-4000:]}
                result["runs"].append(row)
                print(f"[gpu_check] {label}: {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}",
                      flush=True)
                out.write_text(json.dumps(result, indent=2))
    result["total_s"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(result, indent=2))
    print(f"[gpu_check] wrote {out} in {result['total_s']:.0f} s")
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
