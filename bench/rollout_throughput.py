"""Rollout throughput: the multi-turn lockstep rollout against TRL's single-turn generation and one env at a time.

    OMP_NUM_THREADS=2 python -m bench.rollout_throughput          # CPU run, TextCraft (~3 minutes)
    OMP_NUM_THREADS=2 python -m bench.rollout_throughput --quick  # CI size, tiny env (~20 s)
    python -m bench.rollout_throughput --device cuda --model Qwen/Qwen2.5-0.5B-Instruct \
        --num-envs 1 8 32 128 --max-completion-length 128
    # the lockstep rollout generating with vLLM next to HF generate (run where vLLM is
    # installed, e.g. the venv of tests/vllm/make_venv.sh on a CPU)
    OMP_NUM_THREADS=1 python -m bench.rollout_throughput --vllm --model embedded --num-envs 8 32 --max-turns 2 \
        --max-completion-length 64

One model, one tokenizer, the same first-turn prompts; three ways of generating, timed
side by side in one run for each number B of parallel envs:

- lockstep: `rollout.run_rollouts` over B envs. Every turn builds the prompts of the
  active envs, makes one batched generate call through TRL's generation path
  (`RolloutCollector.generate_turn`) and one `VectorEnv.step`.
- TRL single-turn: `GRPOTrainer._generate_single_turn` on the B first-turn prompts, once
  per turn of the budget: what TRL's GRPO generates for a batch of B with no env in the
  loop, the ceiling of the lockstep rollout at batch B.
- one at a time: each episode played alone with batch-1 generation (a plain agent loop),
  measured once on min(B_max, --sequential-episodes) episodes.

With `--vllm`, the lockstep rollout is timed a second time with generation through vLLM
(`use_vllm=True`, colocate; the same weights, saved and loaded by the engine), at the
same batch sizes, each vLLM run right after an HF `generate` run of the same tasks; the
ratio vLLM / HF generate printed per row is the median of those pairs' ratios.

Throughput = completion tokens / wall seconds, env time included for the two rollouts.
By default the model is a tiny random Qwen2 with a tokenizer trained on the env's text
(bench/common.py): its replies are almost never valid actions, so every episode runs the
whole turn budget and nearly every reply the whole `max_completion_length`, which makes
the three paths do comparable work. Writes JSON and a plot (tokens/s against B).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench import common
from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.demonstrations import collect_demonstrations
from bipace_trainer.models import load_tokenizer
from bipace_trainer.rollout import TaskRef, run_rollouts
from envs.base import resolve_env_class
from envs.vector import VectorEnv

HISTORY_LENGTH = 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: tiny env, B up to 8, 2 turns")
    parser.add_argument("--env", default="textcraft")
    parser.add_argument("--model", default=None, help="model id or path; default: tiny random Qwen2 (bench/common.py)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--num-envs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--sequential-episodes", type=int, default=8, help="episodes played one at a time")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per B (median)")
    parser.add_argument("--vllm", action="store_true", help="also time the lockstep rollout generating with vLLM")
    parser.add_argument("--vllm-dtypes", nargs="+", default=None,
                        help="engine dtypes to time with --vllm (default: float32 and bfloat16 on a CPU, auto on CUDA)")
    parser.add_argument("--out", default=str(common.ROOT / "docs" / "results" / "rollout_throughput.json"))
    args = parser.parse_args(argv)
    if args.vllm_dtypes is None:
        args.vllm_dtypes = ["float32", "bfloat16"] if args.device == "cpu" else ["auto"]
    if args.quick:
        args.env, args.num_envs, args.max_turns, args.sequential_episodes, args.repeats = "tiny", [1, 2, 4, 8], 2, 2, 1
        args.max_completion_length = 16
    return args


def load_policy(args):
    if args.model:
        from bipace_trainer.models import resolve_model_name

        name = resolve_model_name(args.model)
        return AutoModelForCausalLM.from_pretrained(name), load_tokenizer(name)
    specs = resolve_env_class(args.env).tasks("train")[:60]
    rows = collect_demonstrations(args.env, [spec.task_id for spec in specs], history_length=HISTORY_LENGTH)
    tokenizer = common.train_tokenizer(args.env, rows)
    heads = dict(heads=1, kv_heads=1) if args.vllm else {}  # vLLM's CPU attention needs head_dim >= 32
    return common.tiny_model(tokenizer, hidden_size=64, layers=2, **heads), tokenizer


def make_trainer(model, tokenizer, args, output_dir, **vllm) -> BiPACETrainer:
    config = BiPACEConfig(
        output_dir=output_dir,
        env_name=args.env,
        preset="grpo",  # no hidden-state capture: generation alone, as TRL's GRPO does it
        num_generations=2,
        tasks_per_iteration=1,
        per_device_train_batch_size=2,
        max_turns=args.max_turns,
        history_length=HISTORY_LENGTH,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        use_cpu=args.device == "cpu",
        report_to="none",
        save_strategy="no",
        seed=0,
        **vllm,
    )
    return BiPACETrainer(model, args=config, processing_class=tokenizer)


@contextlib.contextmanager
def engine_dtype(dtype: str):
    """TRL builds its colocated `vllm.LLM` without a dtype ("auto": a float32 checkpoint runs in
    float16, which vLLM's CPU build turns into bfloat16). Without AVX-512 bf16 kernels that is
    the slow path, so the bench names the dtype for each engine it builds."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, dtype=dtype)
    try:
        yield
    finally:
        vllm_generation.LLM = original


def measure_vllm(hf_trainer, model, tokenizer, args, output_dir, result) -> None:
    """The lockstep rows again, generating through vLLM (colocate) from the same weights, once
    per engine dtype. Each batch size is played once untimed first: vLLM compiles and
    allocates per batch shape, and a first call's cost is not throughput. The timed runs
    alternate with HF `generate` runs of the same tasks (HF, vLLM, HF, vLLM, ...), and the
    ratio is taken per pair: on a machine whose load drifts, rows timed minutes apart
    compare the load, not the engines."""
    model.save_pretrained(Path(output_dir) / "policy")
    tokenizer.save_pretrained(Path(output_dir) / "policy")
    for dtype in args.vllm_dtypes:
        engine_model = AutoModelForCausalLM.from_pretrained(Path(output_dir) / "policy")
        with engine_dtype(dtype):
            trainer = make_trainer(
                engine_model, tokenizer, args, output_dir, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=4096
            )
        for row in result["rows"]:
            tasks = task_refs(args.env, row["num_envs"])
            lockstep(trainer, tasks)  # warm-up at this batch size
            pairs = [(lockstep(hf_trainer, tasks), lockstep(trainer, tasks)) for _ in range(args.repeats)]
            ratios = [tokens_per_s(v) / tokens_per_s(hf) for hf, v in pairs]
            run = median_of([v for _, v in pairs])
            run.pop("first_prompts")
            run.update(tokens_per_s=tokens_per_s(run), paired_hf_tokens_per_s=[tokens_per_s(hf) for hf, _ in pairs],
                       paired_ratios=ratios, paired_ratio_median=statistics.median(ratios))
            row[f"lockstep_vllm_{dtype}"] = run
        trainer.close_envs()
        trainer = None  # the next dtype's engine is built after this one is collected
        gc.collect()


def tokens_per_s(run: dict) -> float:
    return run["tokens"] / run["seconds"]


def task_refs(env: str, count: int) -> list[TaskRef]:
    specs = resolve_env_class(env).tasks("train")
    return [TaskRef(specs[i % len(specs)].task_id, group=i) for i in range(count)]


def lockstep(trainer, tasks) -> dict:
    """Play `tasks` in lockstep; the first-turn prompts come back for the single-turn path."""
    envs = VectorEnv(trainer.args.env_name, len(tasks), backend="serial")
    try:
        start = time.perf_counter()
        rollout = run_rollouts(envs, tasks, trainer.collector.generate_turn, trainer.collector.settings)
        seconds = time.perf_counter() - start
    finally:
        envs.close()
    tokens = sum(len(step.completion_ids) for step in rollout.steps)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "generate_s": rollout.seconds["generate"],
        "env_s": rollout.seconds["env"],
        "turns": max(step.t for step in rollout.steps) + 1,
        "first_prompts": [step.prompt_ids for step in rollout.steps if step.t == 0],
    }


def single_turn(trainer, prompt_ids, calls: int) -> dict:
    start = time.perf_counter()
    tokens = 0
    for _ in range(calls):
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        tokens += sum(len(ids) for ids in completion_ids)
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def one_at_a_time(trainer, tasks) -> dict:
    runs = [lockstep(trainer, [task]) for task in tasks]
    return {"tokens": sum(r["tokens"] for r in runs), "seconds": sum(r["seconds"] for r in runs), "episodes": len(runs)}


def median_run(fn, repeats: int) -> dict:
    return median_of([fn() for _ in range(repeats)])


def median_of(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def measure(trainer, args) -> dict:
    rows = []
    for num_envs in args.num_envs:
        tasks = task_refs(args.env, num_envs)
        lockstep(trainer, tasks)  # warm-up at this batch size: first-call costs out of the timings
        multi = median_run(lambda: lockstep(trainer, tasks), args.repeats)
        prompts = multi.pop("first_prompts")
        single = median_run(lambda: single_turn(trainer, prompts, multi["turns"]), args.repeats)
        rows.append({"num_envs": num_envs, "lockstep": multi, "trl_single_turn": single})
    sequential = one_at_a_time(trainer, task_refs(args.env, min(max(args.num_envs), args.sequential_episodes)))
    for row in rows:
        row["lockstep"]["tokens_per_s"] = row["lockstep"]["tokens"] / row["lockstep"]["seconds"]
        row["trl_single_turn"]["tokens_per_s"] = row["trl_single_turn"]["tokens"] / row["trl_single_turn"]["seconds"]
    sequential["tokens_per_s"] = sequential["tokens"] / sequential["seconds"]
    return {"rows": rows, "one_at_a_time": sequential}


def report(result) -> None:
    sequential = result["one_at_a_time"]["tokens_per_s"]
    print(f"\none env at a time (batch-1 generation): {sequential:,.0f} tokens/s")
    print(f"{'envs':>5}{'lockstep tok/s':>16}{'TRL 1-turn tok/s':>18}{'lockstep/TRL':>14}"
          f"{'lockstep/1-at-a-time':>22}{'env share':>11}")
    for row in result["rows"]:
        multi, single = row["lockstep"], row["trl_single_turn"]
        row["ratio_lockstep_vs_trl"] = multi["tokens_per_s"] / single["tokens_per_s"]
        row["ratio_lockstep_vs_one_at_a_time"] = multi["tokens_per_s"] / sequential
        print(
            f"{row['num_envs']:>5}{multi['tokens_per_s']:>16,.0f}{single['tokens_per_s']:>18,.0f}"
            f"{row['ratio_lockstep_vs_trl']:>14.2f}{row['ratio_lockstep_vs_one_at_a_time']:>22.2f}"
            f"{multi['env_s'] / multi['seconds']:>11.1%}"
        )
    dtypes = [k.removeprefix("lockstep_vllm_") for k in result["rows"][0] if k.startswith("lockstep_vllm_")]
    if dtypes:
        machine = result.get("machine") or {}
        print(f"\nvLLM against HF generate (HF in float32) on {machine.get('cpu')} ({' '.join(machine.get('cpu_isa', []))}), "
              f"{machine.get('torch_threads')} torch thread(s); /HF: median of the ratios of alternating HF and vLLM runs")
        print(f"{'envs':>5}{'lockstep HF tok/s':>19}" + "".join(f"{'vLLM ' + d + ' tok/s':>24}{'/HF':>6}" for d in dtypes))
        for row in result["rows"]:
            line = f"{row['num_envs']:>5}{row['lockstep']['tokens_per_s']:>19,.0f}"
            for dtype in dtypes:
                vllm = row[f"lockstep_vllm_{dtype}"]
                row[f"ratio_vllm_{dtype}_vs_hf"] = vllm["paired_ratio_median"]
                line += f"{vllm['tokens_per_s']:>24,.0f}{vllm['paired_ratio_median']:>6.2f}"
            print(line)


def plot(result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = [row["num_envs"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(envs, [r["lockstep"]["tokens_per_s"] for r in result["rows"]], "o-", label="multi-turn lockstep rollout")
    ax.plot(envs, [r["trl_single_turn"]["tokens_per_s"] for r in result["rows"]], "s--", label="TRL single-turn generation")
    for key in [k for k in result["rows"][0] if k.startswith("lockstep_vllm_")]:
        label = f"lockstep rollout, vLLM {key.removeprefix('lockstep_vllm_')}"
        ax.plot(envs, [r[key]["tokens_per_s"] for r in result["rows"]], "^-", label=label)
    ax.axhline(result["one_at_a_time"]["tokens_per_s"], color="grey", linestyle=":", label="one env at a time, batch 1")
    ax.set(xscale="log", yscale="log", xlabel="parallel envs (batch size)", ylabel="completion tokens / s", title=title)
    ax.set_xticks(envs, [str(e) for e in envs])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.vllm:  # vLLM's CPU build otherwise reserves a share of RAM for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.manual_seed(0)
    model, tokenizer = load_policy(args)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(model, tokenizer, args, output_dir)
        result = measure(trainer, args)
        if args.vllm:
            measure_vllm(trainer, model, tokenizer, args, output_dir, result)
        trainer.close_envs()
    out = Path(args.out)
    model_name = args.model or "tiny random Qwen2 (64 x 2)"
    result.update(
        env=args.env,
        model=model_name,
        device=args.device,
        hf_dtype=str(model.dtype).removeprefix("torch."),
        vllm_dtypes=args.vllm_dtypes if args.vllm else [],
        max_turns=args.max_turns,
        max_completion_length=args.max_completion_length,
        machine=common.machine(),
        median_of=args.repeats,
        warm_up="each batch size played once untimed before its timed runs",
    )
    report(result)
    common.write_json(out, result)
    plot(result, out.with_suffix(".png"), f"{args.env}, {model_name}, {args.device}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the bench
    main()
