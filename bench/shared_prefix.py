"""The update with each shared prefix forwarded once (`shared_prefix=True`) against TRL's row-by-row
forward, side by side in one process: tokens forwarded, update time and peak memory per batch.

    python -m bench.shared_prefix                                   # every workload, 1 round
    python -m bench.shared_prefix --workloads textcraft context4k --rounds 2
    python -m bench.shared_prefix --out bench/results/shared_prefix.json
    python -m bench.shared_prefix --plan-only                       # the cost model's estimates, no forward

The model and settings are the main job's (`python train.py`): the embedded SmolLM2-135M-Instruct with
LoRA r=16 on q/k/v/o, gradient checkpointing (turned on as `Trainer.train` turns it on), pieces of
`per_device_train_batch_size=4` rows, TRL's fused LM head on the labelled positions
(`memory.bound_cpu_memory`), inside the shared-prefix forward's scope as `BiPACETrainer.train` runs it.
One update is `BiPACETrainer.compute_loss` and its backward over one micro-batch, as `training_step` runs
it. Batches, laid out by `batching.padded_tensors` exactly as training lays them out:

- `textcraft`: one task group of the main job: 4 episodes of a 3-step goal (max_expert_steps=3), up to
  6 turns, history 1, played by the half-random expert (`collect_demonstrations`, expert_prob 0.5);
- `alfworld`: the same on ALFWorld's first training game, history 2 (the recipes');
- `context{K}` (1k, 2k, 4k, 8k): an agent whose prompt holds K tokens: 4 rows of one task, each a shared
  context of K - 200 tokens (instructions, tool schemas, a document), then 200 tokens of its own (history
  and observation) and a 40-token reply; random token ids (the cost does not depend on the text);
- `quarter1k`: 4 rows of 1K-token prompts sharing their first quarter (near the cost model's margin);
- `distinct4k`: 4 rows of 4K-token prompts that share only a 100-token system text (little to share);
- `tool{T}` (10, 30, 50): a TRL tool env's group: 2 episodes of T turns of a calculator tool (one episode of
  50), where turn k+1's prompt is turn k's prompt, reply and tool answer (the exact tokens, as TRL's
  environment_factory builds them).

Each round runs plain then shared on every batch (one untimed shared call first: the first-use check),
interleaved, so that a machine shared with other jobs loads both alike. The table's time is the update's CPU
seconds (one thread: the work done, which other jobs on the cores stretch in wall time but not in CPU time;
the JSON has both). Prints the ratios, what the cost model chose and its own FLOPs and peak-memory ratios for
the batch (`SharedPrefixForward.estimate`; `--plan-only` prints those alone, forwarding nothing); `--out`
writes JSON with the CPU model, threads and the load average before and after each update. `--first-use`
makes each batch's shared update a run's first (its first-use check on the batch's own rows, timed and in its
peak memory), run before the plain one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

WORKLOADS = ("textcraft", "alfworld", "context1k", "context2k", "context4k", "context8k", "quarter1k", "distinct4k",
             "tool10", "tool30", "tool50")


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
    # as `Trainer.train` does before its first step (the trainer's constructor leaves it off)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
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


def context_rows(trainer, prompt_tokens: int, shared_tokens: int, rows: int = 4, seed: int = 0) -> list[SimpleNamespace]:
    """`rows` prompts of `prompt_tokens` tokens sharing their first `shared_tokens`, each with a 40-token reply."""
    rng, eos = random.Random(seed), trainer._tokenizer.eos_token_id
    vocabulary = range(100, trainer._tokenizer.vocab_size - 100)
    draw = lambda n: [rng.choice(vocabulary) for _ in range(n)]  # noqa: E731
    shared = draw(shared_tokens)
    return [SimpleNamespace(prompt_ids=shared + draw(prompt_tokens - shared_tokens), completion_ids=draw(39) + [eos])
            for _ in range(rows)]


def micro_batch(trainer, steps) -> dict:
    """The steps as TRL's training batch (`batching.padded_tensors`), shuffled as TRL shuffles it."""
    from bipace_trainer.update.batching import padded_tensors

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
    from bipace_trainer.update.micro_batches import split_rows

    trainer.shared_prefix = shared
    trainer.model.zero_grad(set_to_none=True)
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    before = dict(shared.stats) if shared else {}
    load_before = os.getloadavg()[0]
    base = process.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    done.set()
    sampler.join()
    result = {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mb": (peak[0] - base) / 2**20, "loss": float(loss.detach()),
              "load": [load_before, os.getloadavg()[0]]}
    if shared:  # what the cost model chose: forwards packed or left to TRL, micro-batches cut in token order
        result.update({key: shared.stats[key] - before.get(key, 0) for key in shared.stats})
        result["tokens"] = result["tokens_shared"]
    else:
        result["tokens"] = sum(p["prompt_ids"].numel() + p["completion_ids"].numel()
                               for p in split_rows(inputs, trainer.args.per_device_train_batch_size))
    return result


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
        elif name.startswith("context"):
            tokens = int(name.removeprefix("context").removesuffix("k")) * 1024
            steps = context_rows(trainer, tokens, tokens - 200)
        elif name.startswith("distinct"):
            steps = context_rows(trainer, int(name.removeprefix("distinct").removesuffix("k")) * 1024, 100)
        elif name.startswith("quarter"):
            tokens = int(name.removeprefix("quarter").removesuffix("k")) * 1024
            steps = context_rows(trainer, tokens, tokens // 4)
        else:  # the 50-turn episode alone: two would take the plain path hours on a shared 2-core machine
            turns = int(name.removeprefix("tool"))
            steps = tool_rows(trainer, turns, episodes=2 if turns <= 30 else 1)
        made[name] = micro_batch(trainer, steps)
    return made


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--first-use", action="store_true",
                        help="each batch's shared update is a first one: the first-use check on its rows, timed within it")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the cost model's estimates for each batch and forward nothing (seconds, not hours)")
    cli = parser.parse_args(argv)
    from bipace_trainer.update import memory

    trainer = make_trainer(tempfile.mkdtemp(prefix="bench-shared-prefix-"))
    # as `BiPACETrainer.train` runs the update (the plain path's calls go to transformers' own attention)
    with memory.bound_cpu_memory(trainer.accelerator.device), trainer.shared_prefix.scope():
        return run(trainer, cli)


def run(trainer, cli) -> dict:
    shared = trainer.shared_prefix
    assert shared is not None, "shared_prefix is off for this model (see the log)"
    made = batches(trainer, cli.workloads)
    update(trainer, micro_batch(trainer, context_rows(trainer, 300, 250)), shared)  # untimed: the first-use check
    assert shared.checked and shared.enabled, "the first-use check turned shared_prefix off"
    results = {name: {"rows": int(b["prompt_ids"].size(0)), "estimate": estimate(trainer, b), "plain": [], "shared": []}
               for name, b in made.items()}
    if cli.plan_only:
        print(plan_table(write(cli, results, planned=True)))
        return results
    for _ in range(cli.rounds):
        for name, inputs in made.items():
            if cli.first_use:  # the shared update checks its own rows (TRL's forward of them, no gradients) first
                shared.checked = False
                results[name]["shared"].append(update(trainer, inputs, shared))
                write(cli, results)  # kept even if the plain update does not finish
                results[name]["plain"].append(update(trainer, inputs, None))
            else:
                results[name]["plain"].append(update(trainer, inputs, None))
                results[name]["shared"].append(update(trainer, inputs, shared))
            report = write(cli, results)  # after every pair: a long run keeps what it measured
    print(table(report))
    return report


def estimate(trainer, inputs) -> dict:
    """The cost model's estimates for the update of this micro-batch, forwarding nothing: TRL's pieces against
    what the shared-prefix update would forward (its pieces cut in token order where that pays)."""
    from bipace_trainer.update.micro_batches import length_order, take_rows

    shared, size = trainer.shared_prefix, trainer.args.per_device_train_batch_size
    plain = length_order(inputs, size)
    runs = shared.pieces(inputs, plain)
    return {"plain": shared.estimate(take_rows(inputs, plain), packed=False),
            "shared": shared.estimate(take_rows(inputs, plain if runs is None else runs), packed=True),
            "regrouped": runs is not None}


def plan_table(report: dict) -> str:
    lines = [f"{'batch':<10} {'rows':>4} | {'tokens plain':>12} {'shared':>7} {'ratio':>5} | FLOPs ratio | "
             "peak memory estimate ratio | regrouped"]
    for name, r in report["results"].items():
        p, s = r["estimate"]["plain"], r["estimate"]["shared"]
        lines.append(f"{name:<10} {r['rows']:>4} | {p['tokens']:>12} {s['tokens']:>7} {s['tokens'] / p['tokens']:>5.2f} | "
                     f"{s['flops'] / p['flops']:>11.2f} | {s['memory'] / p['memory']:>26.2f} | {r['estimate']['regrouped']}")
    return "\n".join(lines)


def write(cli, results: dict, planned: bool = False) -> dict:
    done = {name: r for name, r in results.items() if r["shared"] or planned}
    report = {"machine": machine(), "rounds": cli.rounds, "date": time.strftime("%Y-%m-%d"), "results": done,
              "command": "python -m bench.shared_prefix " + " ".join(sys.argv[1:])}
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    lines = [f"{report['machine']['cpu']}, {report['machine']['threads']} thread(s), load {report['machine']['load_average']}",
             f"{'batch':<10} {'rows':>4} | {'tokens plain':>12} {'shared':>7} {'ratio':>5} | {'CPU s plain':>14} "
             f"{'shared':>7} {'ratio':>5} | {'peak MB plain':>13} {'shared':>7} {'ratio':>5} | packed/plain forwards, "
             "regrouped | loss plain / shared"]
    for name, r in report["results"].items():
        p, s = r["plain"], r["shared"]
        tp, ts = p[0]["tokens"], s[0]["tokens"]
        sp, ss = statistics.median(x["cpu_seconds"] for x in p), statistics.median(x["cpu_seconds"] for x in s)
        mp, ms = max(x["peak_mb"] for x in p), max(x["peak_mb"] for x in s)
        chose = f"{s[0]['packed_forwards']}/{s[0]['plain_forwards']}, {s[0]['regrouped']}"
        if r.get("estimate"):  # the cost model's FLOPs and peak memory ratios, to set beside the measured ones
            e = r["estimate"]
            chose += (f", model {e['shared']['flops'] / e['plain']['flops']:.2f} FLOPs, "
                      f"{e['shared']['memory'] / e['plain']['memory']:.2f} memory")
        lines.append(f"{name:<10} {r['rows']:>4} | {tp:>12} {ts:>7} {ts / tp:>5.2f} | {sp:>14.1f} {ss:>7.1f} "
                     f"{ss / sp:>5.2f} | {mp:>13.0f} {ms:>7.0f} {ms / max(mp, 1):>5.2f} | {chose:>21} | "
                     f"{p[0]['loss']:.6f} / {s[0]['loss']:.6f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
