"""How the learning study runs: the warm start and the RL runs as jobs in worker processes.

`warm_start_job` (demonstrations, SFT, the saved policy, its evaluation) and `rl_job` (one
preset and seed from that policy) each return a JSON-able result; `run_jobs` runs them in
fresh processes and writes each result where `--resume` finds it. `StudyTrainer` records
what the statistics read: a row per training step with both partitions measured on its batch.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench import common
from studies.learning.plan import rl_config
from bipace_trainer import BiPACETrainer
from bipace_trainer.advantages import StepAdvantageEstimator, resolve_settings
from bipace_trainer.run.callbacks import TrainingInterrupted
from bipace_trainer.run.demonstrations import collect_demonstrations
from bipace_trainer.models import load_tokenizer, resolve_model_name
from envs.base import resolve_env_class


class StudyTrainer(BiPACETrainer):
    """`BiPACETrainer` that also measures both state partitions on every training batch.

    Overrides `on_rollout` only (it sees each generation's rollout and advantages);
    everything else is inherited. Hidden states are captured for every preset (the
    prefill hook costs no extra pass), and two probes, PACE-Q on the `hash` and on the
    `hidden` partition, read the same batch: their singleton rates and branch fractions
    are what each partition makes of it, whatever the preset trains with. The hidden
    probe calibrates ε as the trainer does (on the first batch, then fixed).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.needs_hidden:  # the hidden probe reads every batch's states, whatever the preset
            raise ValueError("StudyTrainer needs capture_hidden_states=True in its config (plan.rl_config sets it).")
        eps = dict(
            cluster_eps=self.args.cluster_eps,
            target_singleton_rate=self.args.target_singleton_rate,
            max_cluster_eps=self.args.max_cluster_eps,
        )
        self.probes = {
            "hash": StepAdvantageEstimator(resolve_settings("bipace_q", step_partition="hash")),
            "hidden": StepAdvantageEstimator(resolve_settings("bipace_q", **eps)),
        }
        self.curve: list[dict[str, float]] = []

    def on_rollout(self, rollout, advantages, diagnostics):
        batch = rollout.step_batch()
        episodes = rollout.metrics()
        row = {
            "step": self.state.global_step + 1,
            "train_success": episodes["episode/success_rate"],
            "episode_length": episodes["episode/length"],
            "invalid_rate": episodes["episode/invalid_action_rate"],
            "num_steps": len(rollout.steps),
            "advantage_std": float(advantages.std()) if len(advantages) > 1 else 0.0,
            "nonzero_advantage": float((advantages.abs() > 1e-6).float().mean()),
        }
        for name, probe in self.probes.items():
            _, diagnostics = probe(batch)
            row[f"{name}_singleton_rate"] = diagnostics.get("estimator/singleton_rate", math.nan)
            for branch in ("pace", "loo", "singleton"):
                row[f"{name}_branch_{branch}"] = diagnostics.get(f"estimator/branch_{branch}_frac", math.nan)
        row["hidden_eps"] = self.probes["hidden"].cluster_eps
        self.curve.append(row)


def evaluate(trainer, split: str, tag: str) -> dict[str, Any]:
    result = trainer.evaluate_policy(tag=tag, split=split)
    return {"split": split, "step": result["step"], "success_rate": result["success_rate"],
            "episode_length": result["episode_length"], "per_type": result.get("per_type", {})}


def warm_start_job(job: dict[str, Any]) -> dict[str, Any]:
    """Demonstrations → tokenizer (tiny model) → SFT → saved policy → evaluation on every eval split."""
    plan, size, work_dir = job["plan"], job["size"], Path(job["work_dir"])
    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    env_dir = work_dir / plan.env
    specs = resolve_env_class(plan.env).tasks("train", **plan.env_kwargs)
    task_ids = [spec.task_id + k * plan.demo_id_stride for spec in specs for k in range(plan.demo_variants)]
    rows = collect_demonstrations(
        plan.env, task_ids, env_kwargs=plan.env_kwargs, expert_prob=plan.expert_prob,
        episodes_per_task=plan.episodes_per_task, max_turns=plan.max_turns, history_length=size.history_length, seed=0,
    )
    if size.model is None:
        tokenizer = common.train_tokenizer(plan.env, rows)
        model = common.tiny_model(tokenizer, hidden_size=size.hidden_size, layers=size.layers)
    else:
        name = resolve_model_name(size.model)
        tokenizer, model = load_tokenizer(name), AutoModelForCausalLM.from_pretrained(name)
    sft_log = common.sft_warm_start(
        model, tokenizer, rows, env_dir / "sft", steps=plan.sft_steps, batch_size=plan.sft_batch_size,
        learning_rate=plan.sft_learning_rate, use_cpu=size.device == "cpu",
    )
    model.save_pretrained(env_dir / "warm")
    tokenizer.save_pretrained(env_dir / "warm")
    sft_seconds = time.perf_counter() - start

    trainer = StudyTrainer(model, args=rl_config(plan, size, work_dir, env_dir / "warm_eval"),
                                    processing_class=tokenizer)
    try:
        evals = [evaluate(trainer, split, "warm_start") for split in plan.eval_splits]
    finally:
        trainer.close_envs()
    prompt_tokens = [len(tokenizer.apply_chat_template(r["prompt"], tokenize=True, return_dict=True)["input_ids"])
                     for r in rows[:200]]
    return {
        "env": plan.env,
        "demonstrations": len(rows),
        "demonstration_success": statistics.fmean(r["won"] for r in rows),
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_log": sft_log,
        "sft_seconds": sft_seconds,
        "evals": evals,
        "seconds": time.perf_counter() - start,
        "machine": common.machine(),
    }


def rl_job(job: dict[str, Any]) -> dict[str, Any]:
    """One RL run of `preset` with `seed` from the env's warm start."""
    plan, size, work_dir = job["plan"], job["size"], Path(job["work_dir"])
    preset, seed = job["preset"], job["seed"]
    torch.set_num_threads(job["threads"])
    warm = work_dir / plan.env / "warm"
    output_dir = work_dir / plan.env / "runs" / f"{preset}-seed{seed}"
    start, memo_before = time.perf_counter(), common.MemoEnv.totals.copy()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(warm), load_tokenizer(warm)
    trainer = StudyTrainer(model, args=rl_config(plan, size, work_dir, output_dir, preset, seed, job["overrides"]),
                                    processing_class=tokenizer)
    try:
        trainer.train()
        refuse_interrupted(trainer, f"{preset} seed {seed}")
        evals = [dict(e, split=plan.eval_splits[0]) for e in trainer.eval_history]
        evals = [{k: e.get(k) for k in ("split", "step", "success_rate", "episode_length", "per_type")} for e in evals]
        evals += [evaluate(trainer, split, "final") for split in plan.eval_splits[1:]]
    finally:
        trainer.close_envs()
    timed = [e for e in trainer.state.log_history if "step_time" in e]
    timing_keys = ("step_time", "time/rollout_s", "time/generate_s", "time/env_s", "time/hidden_s",
                   "time/estimator_s", "time/logps_s")
    return {
        "env": plan.env,
        "preset": preset,
        "seed": seed,
        "curve": trainer.curve,
        "evals": evals,
        "timing": {k: statistics.fmean(e[k] for e in timed if k in e) for k in timing_keys if any(k in e for e in timed)},
        "memo": dict(common.MemoEnv.totals - memo_before),
        "seconds": time.perf_counter() - start,
        "machine": common.machine(),  # a resumed study's runs may come from different hosts
    }


def refuse_interrupted(trainer, name: str) -> None:
    """A SIGTERM makes the trainer stop gracefully after the step in flight, and `train` returns:
    recorded as a finished run, its short curve would be reused by `--resume` and pooled with full
    runs. Stop the study instead (`TrainingInterrupted`, a BaseException: nothing catches it)."""
    if trainer.interrupted:
        raise TrainingInterrupted(f"{name}: a SIGTERM stopped it at step {trainer.state.global_step} of "
                                  f"{trainer.state.max_steps}; not recorded (rerun the study with --resume)")


def run_jobs(fn, jobs: list[dict[str, Any]], workers: int, paths: list[Path], reuse: bool) -> list[dict[str, Any]]:
    """Run `fn` over `jobs` in `workers` fresh processes (one per job; in this one when workers is 1),
    writing each result to its path.

    With `reuse`, a job whose result file exists is not run again (a long study can resume).
    """
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    todo = []
    for i, path in enumerate(paths):
        if reuse and path.exists():
            results[i] = json.loads(path.read_text())
        else:
            todo.append(i)
    if workers > 1 and len(todo) > 1:
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(todo)), maxtasksperchild=1)
        outcomes = pool.imap(fn, [jobs[i] for i in todo])
    else:  # in this process: no interpreter start-up per job
        pool, outcomes = None, map(fn, [jobs[i] for i in todo])
    for i, result in zip(todo, outcomes):
        results[i] = result
        common.write_json(paths[i], result)
        print(f"  {describe(jobs[i])}: {result['seconds']:.0f} s", flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    return results


def hosts(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct hosts (platform, CPU, torch) that `results` ran on, with how many ran on each.

    Runs are bit-for-bit reproducible only on the same host type: the same code gave SFT
    losses that differ in the 4th digit from the first logged step between two of this
    project's VM hosts, and RL runs of one seed that part after a step or two. Runs of one
    seed on different hosts still draw the same tasks at every step, so they stay paired, but
    a study resumed on another host mixes the two.
    """
    seen: dict[tuple, dict[str, Any]] = {}
    for result in results:
        machine = result.get("machine") or {}
        key = tuple(machine.get(k) for k in ("platform", "cpu", "torch"))
        entry = seen.setdefault(key, {"platform": key[0], "cpu": key[1], "torch": key[2], "jobs": 0})
        entry["jobs"] += 1
    return list(seen.values())


def describe(job: dict[str, Any]) -> str:
    run = f"{job['preset']} seed {job['seed']}" if "preset" in job else "warm start"
    return f"{job['plan'].env} {run}"
