"""Rollout throughput: lockstep against continuous rollouts, TRL's single-turn generation and one env at a time.

    OMP_NUM_THREADS=2 python -m bench.rollout_throughput          # CPU run, TextCraft (~3 minutes)
    OMP_NUM_THREADS=2 python -m bench.rollout_throughput --quick  # CI size, tiny env (~20 s)
    python -m bench.rollout_throughput --device cuda --model Qwen/Qwen2.5-0.5B-Instruct \
        --num-envs 1 8 32 128 --max-completion-length 128
    # the lockstep rollout generating with vLLM next to HF generate (run where vLLM is
    # installed, e.g. the venv of tests/vllm/make_venv.sh on a CPU)
    OMP_NUM_THREADS=1 python -m bench.rollout_throughput --vllm --model embedded --num-envs 8 32 --max-turns 2 \
        --max-completion-length 64

    # the modes through a vLLM server started here (continuous: one request per episode turn)
    OMP_NUM_THREADS=1 python -m bench.rollout_throughput --modes-only --vllm --vllm-server --vllm-dtypes float32 \
        --vllm-max-num-seqs 16

    # lockstep against continuous only, on TextCraft and ALFWorld, 4 and 16 episodes (~4 minutes)
    OMP_NUM_THREADS=1 python -m bench.rollout_throughput --modes-only --mode-envs textcraft alfworld
    # the same scheduler on a simulated engine and envs (virtual clock), up to 512 episodes (~1 minute)
    python -m bench.rollout_throughput --simulate

Rollout modes (`rollout_mode`, run first, on `--mode-envs` at `--mode-episodes` N): the same
tasks played by lockstep with one call per turn (rollout_batch_size 0), lockstep in calls of
N/2, and continuous in calls of N/2 (see `rollout.run_rollouts`), alternating, `--repeats`
times each; per variant episodes/s, completion tokens/s, engine idle share (the share of
wall time no generate call ran), env-wait share (the share the loop waited on envs with
nothing to generate) and the peak resident memory sampled during the runs; the ratio
printed is the median over the alternating rounds of continuous / lockstep.

`--simulate`: `bench.rollout_sim`'s engine and envs (a latency model on a virtual clock;
replies of 50..2,000 tokens; envs with a step-time distribution) played by the same
`run_rollouts` loops and `TextEnvAdapter`, at 8..512 episodes, for a GPU HF engine, a GPU
vLLM-like engine and a CPU HF engine, with fast (20 ms) and slow (500 ms) env steps.

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
import dataclasses
import functools
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench import common, vllm_server
from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.run.demonstrations import collect_demonstrations
from bipace_trainer.models import load_tokenizer
from bipace_trainer.rollout.loop import RolloutSettings, TaskRef, TextEnvAdapter, run_rollouts
from bipace_trainer.rollout.prefix_cache import PrefixReuse
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
    parser.add_argument("--vllm", action="store_true",
                        help="also time the lockstep rollout generating with vLLM (with --modes-only: compare the modes on vLLM)")
    parser.add_argument("--vllm-dtypes", nargs="+", default=None,
                        help="engine dtypes to time with --vllm (default: float32 and bfloat16 on a CPU, auto on CUDA)")
    parser.add_argument("--vllm-server", action="store_true",
                        help="with --modes-only --vllm: generate through a vLLM server started here (bench.vllm_server)"
                             " rather than colocate")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=2,
                        help="with --modes-only --vllm: sequences the engine decodes at once (TRL: per_device_train_batch_size"
                             " x steps_per_generation; the bench's trainer has 2); an even number")
    parser.add_argument("--mode-envs", nargs="+", default=["textcraft"], help="envs of the lockstep/continuous comparison")
    parser.add_argument("--mode-episodes", type=int, nargs="+", default=[4, 16], help="episodes of that comparison (64: option)")
    parser.add_argument("--modes-only", action="store_true", help="only the lockstep/continuous comparison")
    parser.add_argument("--group-size", type=int, default=1,
                        help="episodes per task in the modes comparison (a GRPO group; 1: every episode its own task)")
    parser.add_argument("--prefix-reuse", action="store_true",
                        help="HF path: also play lockstep (1 call/turn) and continuous (N/2) with hf_prefix_cache")
    parser.add_argument("--simulate", action="store_true", help="only the simulated engine (no model): scaling to 512 episodes")
    parser.add_argument("--calibrate", action="store_true",
                        help="with --simulate: also fit this machine's HF generate cost and env step times and simulate them")
    parser.add_argument("--out", default=None, help="JSON path (default docs/results/rollout_throughput[_modes|_sim].json)")
    args = parser.parse_args(argv)
    if args.out is None:
        vllm = "_modes_vllm_server" if args.vllm_server else "_modes_vllm"
        suffix = "_sim" if args.simulate else (vllm if args.vllm else "_modes") if args.modes_only else ""
        args.out = str(common.ROOT / "docs" / "results" / f"rollout_throughput{suffix}.json")
    if args.vllm_dtypes is None:
        args.vllm_dtypes = ["float32", "bfloat16"] if args.device == "cpu" else ["auto"]
    if args.vllm_server and not (args.vllm and args.modes_only):
        parser.error("--vllm-server goes with --modes-only --vllm")
    if args.quick:
        args.env, args.num_envs, args.max_turns, args.sequential_episodes, args.repeats = "tiny", [1, 2, 4, 8], 2, 2, 1
        args.max_completion_length = 16
        args.mode_envs, args.mode_episodes = ["tiny"], [4]
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


def make_trainer(model, tokenizer, args, output_dir, batch_size: int = 2, **vllm) -> BiPACETrainer:
    """The bench's trainer. `batch_size` is also what TRL's colocated engine may decode at once
    (`max_num_seqs` = per_device_train_batch_size x steps_per_generation)."""
    config = BiPACEConfig(
        output_dir=output_dir,
        env_name=args.env,
        preset="grpo",  # no hidden-state capture: generation alone, as TRL's GRPO does it
        num_generations=2,
        tasks_per_iteration=max(batch_size // 2, 1),  # a generation fills the batch (the bench never trains)
        per_device_train_batch_size=batch_size,
        max_turns=args.max_turns,
        history_length=HISTORY_LENGTH,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        use_cpu=args.device == "cpu",
        bf16=args.device != "cpu",  # float32 on a CPU
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


def task_refs(env: str, count: int, group_size: int = 1) -> list[TaskRef]:
    """`count` episodes, `group_size` in a row on the same task (a GRPO group: G rollouts of one task)."""
    specs = resolve_env_class(env).tasks("train")
    return [TaskRef(specs[(i // group_size) % len(specs)].task_id, group=i // group_size) for i in range(count)]


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


class PeakRSS:
    """The largest resident set size of this process while the block runs, sampled every 20 ms."""

    def __init__(self):
        self.peak = 0

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        import threading

        self.stop = threading.Event()
        self.peak = self.now()

        def sample():
            while not self.stop.wait(0.02):
                self.peak = max(self.peak, self.now())

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())


MODE_VARIANTS = (("lockstep", "all"), ("lockstep", "half"), ("continuous", "half"))
# vLLM colocate streams continuous through its engine: there "all" (no cap on the requests in the
# engine) is the natural setting, and it no longer degenerates into lockstep
STREAM_VARIANTS = MODE_VARIANTS + (("continuous", "all"),)
# with --prefix-reuse (HF generate): the same tasks again with `hf_prefix_cache` (rollout.prefix_cache)
REUSE_VARIANTS = (("lockstep", "all"), ("continuous", "half"))


def mode_variants(args, trainer) -> list[tuple[str, str, bool]]:
    """(mode, call size, prefix reuse) of each variant: the streaming one where vLLM colocate streams,
    the reuse ones with --prefix-reuse on HF generate."""
    plain = STREAM_VARIANTS if trainer.policy.can_stream else MODE_VARIANTS
    reuse = [(m, s, True) for m, s in REUSE_VARIANTS] if args.prefix_reuse and not args.vllm else []
    return [(m, s, False) for m, s in plain] + reuse


def variant_name(mode: str, size: str, reuse: bool) -> str:
    return f"{mode}_{size}" + ("_reuse" if reuse else "")


def play_mode(trainer, env: str, tasks, mode: str, batch_size: int, reuse=None) -> dict:
    """One rollout of `tasks` in `mode`, calls of at most `batch_size` (0: all); HF generate
    through `reuse` (a `PrefixReuse`) when given, as `hf_prefix_cache=True` does."""
    settings = dataclasses.replace(trainer.collector.settings, mode=mode, rollout_batch_size=batch_size)
    envs = VectorEnv(env, len(tasks), backend="serial")
    prefix_cache = trainer.policy.prefix_cache  # vLLM colocate: what its prefix cache reused
    if prefix_cache is not None:
        prefix_cache.take()
    if not trainer.use_vllm:
        trainer.policy.hf_prefix = reuse
        if reuse is not None:
            reuse.take_counts()
    try:
        with PeakRSS() as rss:
            start = time.perf_counter()
            # continuous on vLLM colocate: through the engine's own continuous batching, as training
            rollout = run_rollouts(envs, tasks, trainer.collector.generator("train", mode), settings)
            seconds = time.perf_counter() - start
    finally:
        envs.close()
        if reuse is not None:
            reuse.clear()
    # as the collector adds them to a training rollout's counts: vLLM's prefix cache (colocate; a
    # server's streamed replies), what PrefixReuse saved, or every prompt token encoded
    rollout.prompt_counts.update(trainer.policy.prompt_reuse(rollout))
    if not trainer.use_vllm:
        trainer.policy.hf_prefix = None
    metrics = rollout.metrics()
    return {
        "seconds": seconds,
        "episodes": len(rollout.episodes),
        "steps": len(rollout.steps),
        "tokens": sum(len(step.completion_ids) for step in rollout.steps),
        "generate_calls": rollout.generate_calls,  # engine steps when streamed (engine_steps > 0)
        "engine_steps": rollout.engine_steps,
        "generate_s": rollout.seconds["generate"],
        "env_s": rollout.seconds["env"],
        "engine_idle_share": metrics["rollout/engine_idle_share"],
        "env_wait_share": metrics["rollout/env_wait_share"],
        "prompt_tokens": metrics["rollout/prompt_tokens"],
        "prompt_tokens_shared": metrics["rollout/prompt_tokens_shared"],
        "prompt_tokens_prefix_of_previous": metrics["rollout/prompt_tokens_prefix_of_previous"],
        "peak_rss_bytes": rss.peak,
        **{name: metrics[f"rollout/{name}"] for name in ("prompt_tokens_encoded", "prompt_tokens_reused",
                                                           "prefix_cache_hit_rate") if f"rollout/{name}" in metrics},
    }


def compare_modes(trainer, args) -> list[dict]:
    """Lockstep and continuous on the same tasks, alternating, for each env and episode count."""
    rows = []
    for env in args.mode_envs:
        trainer.collector.settings = dataclasses.replace(
            trainer.collector.settings,
            instruction=resolve_env_class(env).instruction,
            invalid_action=resolve_env_class(env).invalid_action,
        )
        for count in args.mode_episodes:
            tasks = task_refs(env, count, args.group_size)
            sizes = {"all": 0, "half": max(count // 2, 1)}
            variants = mode_variants(args, trainer)
            reuse = PrefixReuse(store_bytes=trainer.args.hf_prefix_cache_store_mb * 2**20) if variants[-1][2] else None
            play_mode(trainer, env, tasks, "lockstep", 0)  # warm-up: first-call costs out of the timings
            if reuse is not None:
                play_mode(trainer, env, tasks, "lockstep", 0, reuse)
            rounds = []
            for _ in range(args.repeats):
                rounds.append({
                    variant_name(mode, size, r): play_mode(trainer, env, tasks, mode, sizes[size], reuse if r else None)
                    for mode, size, r in variants
                })
            row = {"env": env, "episodes": count, "batch_sizes": sizes, "rounds": rounds}
            for name in rounds[0]:
                run = median_of([r[name] for r in rounds])
                run.update(episodes_per_s=run["episodes"] / run["seconds"], tokens_per_s=run["tokens"] / run["seconds"],
                           peak_rss_bytes=max(r[name]["peak_rss_bytes"] for r in rounds))
                row[name] = run
            for base in ("lockstep_all", "lockstep_half"):
                ratios = [r["continuous_half"]["tokens"] / r["continuous_half"]["seconds"]
                          / (r[base]["tokens"] / r[base]["seconds"]) for r in rounds]
                row[f"ratio_continuous_vs_{base}"] = statistics.median(ratios)
            if "continuous_all" in rounds[0]:
                row["ratio_continuous_all_vs_lockstep_all"] = statistics.median(
                    r["continuous_all"]["tokens"] / r["continuous_all"]["seconds"]
                    / (r["lockstep_all"]["tokens"] / r["lockstep_all"]["seconds"]) for r in rounds)
            for base in [variant_name(m, s, False) for m, s, r in variants if r]:  # episodes/s, reuse / without
                ratios = [r[base]["seconds"] / r[f"{base}_reuse"]["seconds"] for r in rounds]
                row[f"ratio_{base}_reuse_vs_without"] = statistics.median(ratios)
            rows.append(row)
    return rows


def report_modes(rows) -> None:
    print("\nlockstep against continuous (same tasks, alternating; continuous/lockstep: median of per-round tokens/s ratios;"
          " calls: engine steps where continuous streams through vLLM's engine)")
    print(f"{'env':>10}{'eps':>5}{'variant':>24}{'calls':>7}{'eps/s':>8}{'tok/s':>9}{'idle':>7}{'envwait':>9}{'RSS MB':>8}")
    for row in rows:
        for name in [variant_name(m, s, r) for m, s, r in variants_of(row)]:
            run = row[name]
            print(f"{row['env']:>10}{row['episodes']:>5}{name:>24}{run['generate_calls']:>7}{run['episodes_per_s']:>8.3f}"
                  f"{run['tokens_per_s']:>9,.0f}{run['engine_idle_share']:>7.1%}{run['env_wait_share']:>9.1%}"
                  f"{run['peak_rss_bytes'] / 2**20:>8,.0f}"
                  + (f"  prefix cache hit {run['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in run else ""))
        print(f"{'':>15}continuous/lockstep(all) {row['ratio_continuous_vs_lockstep_all']:.2f}, "
              f"continuous/lockstep(half) {row['ratio_continuous_vs_lockstep_half']:.2f}"
              + (f", continuous(all)/lockstep(all) {row['ratio_continuous_all_vs_lockstep_all']:.2f}"
                 if "ratio_continuous_all_vs_lockstep_all" in row else ""))
        reuse = [k for k in row if k.endswith("_reuse_vs_without")]
        if reuse:
            print(f"{'':>15}episodes/s with prefix reuse / without: " + ", ".join(
                f"{k.removeprefix('ratio_').removesuffix('_reuse_vs_without')} {row[k]:.2f}" for k in reuse))


def variants_of(row) -> list[tuple[str, str, bool]]:
    """The variants a row of `compare_modes` holds, in the printed order."""
    return [(m, s, r) for m, s in STREAM_VARIANTS for r in (False, True) if variant_name(m, s, r) in row]


@contextlib.contextmanager
def reply_length(trainer, tokens: int):
    """HF generate replies of exactly `tokens` tokens (min = max new tokens), for the latency fit."""
    keys = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    saved = {key: getattr(trainer.generation_config, key) for key in keys}
    saved_kwargs = {key: trainer.generation_kwargs.get(key) for key in keys}
    trainer.generation_config.update(**keys)
    trainer.generation_kwargs.update(keys)
    try:
        yield
    finally:
        trainer.generation_config.update(**saved)
        trainer.generation_kwargs.update(saved_kwargs)


def fit_latency(trainer, env: str, batches=(1, 4, 16), lengths=(8, 32), repeats: int = 3) -> dict:
    """This machine's HF generate cost, fitted by least squares to
    per_call + per_prompt_token x prompt tokens + per_step x steps + per_token x batch x steps
    from calls on `env`'s first-turn prompts at each (batch, reply length), median of `repeats`."""
    import numpy as np

    tasks = task_refs(env, max(batches))
    with VectorEnv(env, len(tasks), backend="serial") as envs:
        adapter = TextEnvAdapter(trainer.collector.settings)
        adapter.start(envs, tasks)
        messages = [adapter.messages(i, 0) for i in range(len(tasks))]
    points = []
    for length in lengths:
        with reply_length(trainer, length):
            for batch in batches:
                trainer.collector.generate_turn(messages[:batch])  # warm-up at this shape
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    out = trainer.collector.generate_turn(messages[:batch])
                    times.append(time.perf_counter() - start)
                prompt_tokens = sum(len(ids) for ids in out.prompt_ids)
                points.append({"batch": batch, "reply_tokens": length, "prompt_tokens": prompt_tokens,
                               "seconds": statistics.median(times)})
    design = np.array([[1.0, p["prompt_tokens"], p["reply_tokens"], p["batch"] * p["reply_tokens"]] for p in points])
    coef, *_ = np.linalg.lstsq(design, np.array([p["seconds"] for p in points]), rcond=None)
    coef = np.maximum(coef, 0.0)  # a cost is not negative; noise can make a small one so
    return {"per_call": float(coef[0]), "per_prompt_token": float(coef[1]), "per_step": float(coef[2]),
            "per_token": float(coef[3]), "engine": "hf", "points": points}


def measure_env_steps(env: str, count: int = 4, turns: int = 4) -> tuple[float, float]:
    """Mean seconds of one env reset and of one env step of `env` (its invalid action, the
    tiny model's usual reply; serial backend), the first build of each env included in the reset."""
    env_class = resolve_env_class(env)
    with VectorEnv(env, count, backend="serial") as envs:
        start = time.perf_counter()
        envs.reset([t.task_id for t in task_refs(env, count)])
        reset = (time.perf_counter() - start) / count
        start = time.perf_counter()
        for _ in range(turns):
            envs.step([env_class.invalid_action] * count)
        return reset, (time.perf_counter() - start) / (count * turns)


SIM_ENGINES = ("gpu_hf", "gpu_vllm", "cpu_hf")
SIM_ENVS = {"fast_env_20ms": 0.02, "slow_env_500ms": 0.5}
SIM_VARIANTS = (("lockstep", 0), ("lockstep", 8), ("continuous", 2), ("continuous", 4), ("continuous", 8))  # N / divisor


def simulate(episode_counts=(8, 32, 128, 512), max_turns: int = 12, seed: int = 0, measured: dict | None = None) -> list[dict]:
    """Every variant on the simulated engine and envs; figures are virtual seconds. `measured`
    adds an engine "cpu_measured" (`fit_latency`'s model) with this machine's env step times."""
    from bench.rollout_sim import EnvModel, LatencyModel, SimClock, SimEngine, SimEnvRunner, SimEnvs

    setups = [(engine, getattr(LatencyModel, engine)(), SIM_ENVS) for engine in SIM_ENGINES]
    if measured:
        fields = {k: measured["latency"][k] for k in ("per_call", "per_prompt_token", "per_step", "per_token", "engine")}
        env_steps = {f"{env}_measured_{seconds * 1000:.2f}ms": seconds for env, seconds in measured["env_step_s"].items()}
        setups.append(("cpu_measured", LatencyModel(**fields), env_steps))
    rows = []
    for engine, latency, env_models in setups:
        for env_name, step_median in env_models.items():
            for count in episode_counts:
                row = {"engine": engine, "env": env_name, "episodes": count, "latency": dataclasses.asdict(latency)}
                for mode, divisor in SIM_VARIANTS:
                    batch = count // divisor if divisor else 0
                    clock = SimClock()
                    tasks = [TaskRef(i, group=i // 8) for i in range(count)]
                    settings = RolloutSettings(max_turns=max_turns, rollout_batch_size=batch, mode=mode, history_length=1)
                    engine_fn = SimEngine(clock, latency, seed=seed)
                    envs = SimEnvs(clock, count, EnvModel(step_median=step_median), seed=seed)
                    rollout = run_rollouts(envs, tasks, engine_fn, settings, clock=clock, env_runner=SimEnvRunner(clock))
                    metrics = rollout.metrics()
                    tokens = sum(len(step.completion_ids) for step in rollout.steps)
                    row[f"{mode}_n/{divisor}" if divisor else f"{mode}_all"] = {
                        "batch_size": batch, "seconds": rollout.seconds["rollout"], "steps": len(rollout.steps),
                        "generate_calls": rollout.generate_calls, "tokens_per_s": tokens / rollout.seconds["rollout"],
                        "episodes_per_s": count / rollout.seconds["rollout"],
                        "engine_idle_share": metrics["rollout/engine_idle_share"],
                        "env_wait_share": metrics["rollout/env_wait_share"],
                    }
                base = row["lockstep_all"]["seconds"]
                row["speedup_vs_lockstep_all"] = {k: base / v["seconds"] for k, v in row.items() if isinstance(v, dict) and "seconds" in v}
                rows.append(row)
    return rows


def report_simulation(rows) -> None:
    print("\nsimulated engine (virtual seconds): speed-up over lockstep with one call per turn; idle = engine idle share")
    names = [k for k in rows[0]["speedup_vs_lockstep_all"]]
    print(f"{'engine':>13}{'env':>30}{'eps':>5}" + "".join(f"{n:>24}" for n in names))
    for row in rows:
        cells = "".join(f"{row['speedup_vs_lockstep_all'][n]:>10.2f}x idle {row[n]['engine_idle_share']:>6.1%}" for n in names)
        print(f"{row['engine']:>13}{row['env']:>30}{row['episodes']:>5}{cells}")


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
    if args.simulate:
        measured = None
        if args.calibrate:
            torch.manual_seed(0)
            model, tokenizer = load_policy(args)
            with tempfile.TemporaryDirectory() as output_dir:
                trainer = make_trainer(model, tokenizer, args, output_dir)
                measured = {"latency": fit_latency(trainer, args.env, lengths=(4, 16) if args.quick else (8, 32)),
                            "env_reset_and_step_s": {env: measure_env_steps(env) for env in args.mode_envs}}
                measured["env_step_s"] = {env: step for env, (_, step) in measured["env_reset_and_step_s"].items()}
                trainer.close_envs()
            latency = measured["latency"]
            print("fitted HF generate cost on this machine: " + ", ".join(
                f"{k} {latency[k] * 1000:.3f} ms" for k in ("per_call", "per_prompt_token", "per_step", "per_token")))
            print("env reset / step: " + ", ".join(
                f"{env} {r * 1000:.1f} / {s * 1000:.2f} ms" for env, (r, s) in measured["env_reset_and_step_s"].items()))
        rows = simulate((8, 32) if args.quick else (8, 32, 128, 512), measured=measured)
        report_simulation(rows)
        result = {"simulation": rows, "measured": measured, "max_turns": 12, "clock": "virtual seconds (bench.rollout_sim)",
                  "replies": "log-normal, median 300, clipped to 50..2000 tokens", "machine": common.machine()}
        common.write_json(args.out, result)
        print(f"wrote {args.out}")
        return result
    if args.vllm:  # vLLM's CPU build otherwise reserves a share of RAM for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.manual_seed(0)
    model, tokenizer = load_policy(args)
    with tempfile.TemporaryDirectory() as output_dir, contextlib.ExitStack() as server:
        if args.modes_only and args.vllm:  # the modes compared with generation through vLLM
            model.save_pretrained(Path(output_dir) / "policy")  # the engine loads the weights from a path
            tokenizer.save_pretrained(Path(output_dir) / "policy")
            model = AutoModelForCausalLM.from_pretrained(Path(output_dir) / "policy")
            if args.vllm_server:  # the same weights in a server; nothing trains, so none are pushed
                url = server.enter_context(vllm_server.serve(
                    Path(output_dir) / "policy", Path(output_dir) / "server.log", max_num_seqs=args.vllm_max_num_seqs,
                    dtype=args.vllm_dtypes[0], max_model_len=4096))
                server.enter_context(vllm_server.without_weight_transfer())
                trainer = make_trainer(model, tokenizer, args, output_dir, batch_size=args.vllm_max_num_seqs,
                                       use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
            else:
                with engine_dtype(args.vllm_dtypes[0]):
                    trainer = make_trainer(model, tokenizer, args, output_dir, batch_size=args.vllm_max_num_seqs,
                                           use_vllm=True, vllm_mode="colocate",
                                           vllm_max_model_length=4096)
        else:
            trainer = make_trainer(model, tokenizer, args, output_dir)
        modes = compare_modes(trainer, args)
        report_modes(modes)
        if args.modes_only:
            trainer.close_envs()
            result = {"modes": modes, "env": args.env, "model": args.model or "tiny random Qwen2 (64 x 2)",
                      "engine": (f"vllm {'server' if args.vllm_server else 'colocate'} {args.vllm_dtypes[0]}"
                                 if args.vllm else "hf generate"),
                      **({"vllm_max_num_seqs": args.vllm_max_num_seqs} if args.vllm else {}),
                      "prefix_reuse": "variants *_reuse: hf_prefix_cache (rollout.prefix_cache)" if args.prefix_reuse else "",
                      "max_turns": args.max_turns, "max_completion_length": args.max_completion_length,
                      "group_size": args.group_size, "machine": common.machine(), "median_of": args.repeats}
            common.write_json(args.out, result)
            print(f"wrote {args.out}")
            return result
        trainer.collector.settings = dataclasses.replace(
            trainer.collector.settings, instruction=resolve_env_class(args.env).instruction,
            invalid_action=resolve_env_class(args.env).invalid_action, mode="lockstep", rollout_batch_size=0,
        )
        result = measure(trainer, args)
        result["modes"] = modes
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
