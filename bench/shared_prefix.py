"""The update with each shared prefix forwarded once (`shared_prefix=True`) against TRL's row-by-row
forward, side by side in one process: tokens forwarded, update time and peak memory per batch.

    python -m bench.shared_prefix                                   # every workload, 2 rounds
    python -m bench.shared_prefix --workloads textcraft --rounds 3
    python -m bench.shared_prefix --out bench/results/shared_prefix.json

The model and settings are the main job's (`python train.py`): the embedded SmolLM2-135M-Instruct with
LoRA r=16 on q/k/v/o, gradient checkpointing, pieces of `per_device_train_batch_size=4` rows, TRL's
fused LM head on the labelled positions (`memory.bound_cpu_memory`). One update is
`BiPACETrainer.compute_loss` and its backward over one micro-batch, as `training_step` runs it.
Batches, laid out by `batching.padded_tensors` exactly as training lays them out:

- `textcraft`: one task group of the main job: 4 episodes of a 3-step goal (max_expert_steps=3), up to
  6 turns, history 1, played by the half-random expert (`collect_demonstrations`, expert_prob 0.5);
- `alfworld`: the same on ALFWorld's first training game, history 2 (the recipes');
- `tool{T}`: a TRL tool env's group: 2 episodes of T turns of a calculator tool, where turn k+1's prompt is
  turn k's prompt, reply and tool answer (the exact tokens, as TRL's environment_factory builds them).

Each round runs plain then shared on every batch (one untimed shared call first: the first-use check).
Prints a table and the ratios; `--out` writes JSON with the CPU model, threads and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

WORKLOADS = ("textcraft", "alfworld", "tool3", "tool10", "tool30")


def make_trainer(output_dir: str):
    from peft import LoraConfig

    from bipace_trainer import BiPACEConfig, BiPACETrainer

    args = BiPACEConfig(
        output_dir=output_dir, env_name="textcraft", env_kwargs={"max_expert_steps": 3}, use_cpu=True, bf16=False,
        tasks_per_iteration=1, num_generations=4, per_device_train_batch_size=4, gradient_checkpointing=True,
        max_turns=6, history_length=1, max_completion_length=40, temperature=0.7, report_to="none",
        save_strategy="no", shared_prefix=True,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    trainer = BiPACETrainer(model="embedded", args=args, peft_config=lora)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    return trainer


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def env_rows(trainer, env: str, history_length: int, env_kwargs: dict) -> list[SimpleNamespace]:
    """One task group's step rows, tokenized as the rollout tokenizes them (chat template, EOS-ended replies)."""
    from bipace_trainer.rollout.collector import task_dataset
    from bipace_trainer.run.demonstrations import collect_demonstrations

    task = task_dataset(env, "train", env_kwargs)["task_id"][0]
    rows = collect_demonstrations(env, [task], env_kwargs=env_kwargs, expert_prob=0.5, episodes_per_task=4,
                                  max_turns=6, history_length=history_length, seed=0)
    tokenizer = trainer._tokenizer
    steps = []
    for row in rows:
        prompt = chat_ids(tokenizer, row["prompt"])
        reply = tokenizer.encode(row["completion"][0]["content"], add_special_tokens=False)[:39]
        steps.append(SimpleNamespace(prompt_ids=prompt, completion_ids=reply + [tokenizer.eos_token_id]))
    return steps


def tool_rows(trainer, turns: int, episodes: int = 2, seed: int = 0) -> list[SimpleNamespace]:
    """A TRL tool env's group: each turn's prompt is the one before, its reply and the tool's answer."""
    tokenizer, rng = trainer._tokenizer, random.Random(seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    system = [{"role": "system", "content": "You can call add(a, b) by replying <tool_call>add(a, b)</tool_call>."},
              {"role": "user", "content": "Add the numbers 3, 14, 15, 92, 65, 35, 89, 79, 32, 38 one call at a time."}]
    start = chat_ids(tokenizer, system)
    steps = []
    for _ in range(episodes):
        prompt, total = start, 0
        for _ in range(turns):
            a, b = total, rng.randrange(1, 100)
            reply = encode(f"<tool_call>add({a}, {b})</tool_call>") + [tokenizer.eos_token_id]
            steps.append(SimpleNamespace(prompt_ids=prompt, completion_ids=reply))
            total = a + b
            answer = encode(f"\n<|im_start|>user\n<tool_response>{total}</tool_response><|im_end|>\n<|im_start|>assistant\n")
            prompt = prompt + reply + answer
    return steps


def micro_batch(trainer, steps) -> dict:
    """The steps as TRL's training batch (`batching.padded_tensors`), shuffled as TRL shuffles it."""
    from bipace_trainer.rollout.batching import padded_tensors

    steps = list(steps)
    random.Random(0).shuffle(steps)
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded_tensors(trainer.batch_spec, steps, len(steps))
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.linspace(-1, 1, len(steps)),
        "num_items_in_batch": completion_mask.sum(), "old_per_token_logps": None,
    }


def update(trainer, inputs, shared) -> dict:
    """One micro-batch's loss and backward; seconds, peak RSS above the start, tokens forwarded."""
    from bipace_trainer.micro_batches import split_rows

    trainer.shared_prefix = shared
    trainer.model.zero_grad(set_to_none=True)
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    before_tokens = shared.stats["tokens_shared"] if shared else 0
    base = process.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if shared:
        tokens = shared.stats["tokens_shared"] - before_tokens
    else:
        tokens = sum(p["prompt_ids"].numel() + p["completion_ids"].numel()
                     for p in split_rows(inputs, trainer.args.per_device_train_batch_size))
    return {"seconds": seconds, "peak_mb": (peak[0] - base) / 2**20, "tokens": tokens, "loss": float(loss.detach())}


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    return {"cpu": model, "avx512": "avx512f" in flags, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "torch": torch.__version__}


def batches(trainer, names) -> dict:
    made = {}
    for name in names:
        if name == "textcraft":
            steps = env_rows(trainer, "textcraft", 1, {"max_expert_steps": 3})
        elif name == "alfworld":
            steps = env_rows(trainer, "alfworld", 2, {})
        else:
            steps = tool_rows(trainer, int(name.removeprefix("tool")))
        made[name] = micro_batch(trainer, steps)
    return made


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args(argv)
    from bipace_trainer import memory

    trainer = make_trainer(tempfile.mkdtemp(prefix="bench-shared-prefix-"))
    with memory.bound_cpu_memory(trainer.accelerator.device):  # as `BiPACETrainer.train` runs the update
        return run(trainer, cli)


def run(trainer, cli) -> dict:
    shared = trainer.shared_prefix
    assert shared is not None, "shared_prefix is off for this model (see the log)"
    made = batches(trainer, cli.workloads)
    first = next(iter(made.values()))
    update(trainer, {k: (v[:2] if torch.is_tensor(v) and v.dim() else v) for k, v in first.items()}, shared)  # the check
    assert shared.enabled, "the first-use check turned shared_prefix off"
    results = {name: {"rows": int(b["prompt_ids"].size(0)), "plain": [], "shared": []} for name, b in made.items()}
    for _ in range(cli.rounds):
        for name, inputs in made.items():
            results[name]["plain"].append(update(trainer, inputs, None))
            results[name]["shared"].append(update(trainer, inputs, shared))
    report = {"machine": machine(), "rounds": cli.rounds, "date": time.strftime("%Y-%m-%d"), "results": results}
    print(table(report))
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    lines = [f"{report['machine']['cpu']}, {report['machine']['threads']} thread(s), load {report['machine']['load_average']}",
             f"{'batch':<10} {'rows':>4} | {'tokens plain':>12} {'shared':>7} {'ratio':>5} | {'update s plain':>14} "
             f"{'shared':>7} {'ratio':>5} | {'peak MB plain':>13} {'shared':>7} | loss plain / shared"]
    for name, r in report["results"].items():
        p, s = r["plain"], r["shared"]
        tp, ts = p[0]["tokens"], s[0]["tokens"]
        sp, ss = statistics.median(x["seconds"] for x in p), statistics.median(x["seconds"] for x in s)
        mp, ms = max(x["peak_mb"] for x in p), max(x["peak_mb"] for x in s)
        lines.append(f"{name:<10} {r['rows']:>4} | {tp:>12} {ts:>7} {ts / tp:>5.2f} | {sp:>14.1f} {ss:>7.1f} "
                     f"{ss / sp:>5.2f} | {mp:>13.0f} {ms:>7.0f} | {p[0]['loss']:.6f} / {s[0]['loss']:.6f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
