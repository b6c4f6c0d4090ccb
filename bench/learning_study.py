"""Learning comparison: GRPO, GiGPO, BiPACE_Q, GAGPO and BiGAGPO from one warm-started policy.

    OMP_NUM_THREADS=1 python -m bench.learning_study                   # CPU study: tiny env, 5 seeds (~15 min)
    OMP_NUM_THREADS=1 python -m bench.learning_study --quick           # CI size: tiny env, 1 seed (~1 min)
    OMP_NUM_THREADS=1 python -m bench.learning_study --size cpu-envs   # TextCraft + ALFWorld, tiny model (see below)
    OMP_NUM_THREADS=1 python -m bench.learning_study --size cpu-textcraft  # TextCraft, 256 x 4 model
    OMP_NUM_THREADS=1 python -m bench.learning_study --size cpu-alfworld   # ALFWorld, 256 x 4 model
    python -m bench.learning_study --size cuda                         # GPU: Qwen2.5-0.5B-Instruct, TextCraft + ALFWorld

Per env:
1. Warm start. SFT (TRL's SFTTrainer) of a small policy on expert and perturbed-expert
   trajectories of the train split (`bipace_trainer.demonstrations`), built with the RL
   prompts' history window, so that rollouts succeed sometimes, as an instruct model's
   do. Evaluated once on the held-out splits: every run starts from these numbers.
2. RL from that checkpoint with every preset, the same budget, `--seeds` seeds each.
   Hidden states are captured for every preset, so the `hash` and the `hidden` partition
   are both measured on the very same training batches whichever one the preset uses.
3. Summary: validation success (final and peak, mean ± std over seeds), success per task
   type and on the out-of-domain split, steps to reach the warm start + a gain, singleton
   rates of both partitions, PACE branch fractions, the spread of the advantages and the
   share of steps that get a non-zero one; a learning-curve plot per env.

Sizes. `cpu` is what 2 cores can show: the tiny line-walking env (6 cells, held-out
start/goal pairs), a tiny random-init Qwen2 (64 x 2) with a tokenizer trained on the
env's text. `cpu-envs` runs the same recipe on TextCraft (train depth 2 = "train",
held-out depth-2 goals = "valid", out of domain depth 3 = "test_ood") and ALFWorld
(games generated offline; "valid_unseen", "valid_seen", success per task type): on a CPU
its tiny model learns the reply format but solves no task after SFT, so RL has nothing
to compare (docs/RESULTS.md). `cpu-textcraft` runs a 256 x 4 policy on TextCraft alone:
its warm start wins 44% of training goals and 15% of held-out ones (~2 h for the study
on 2 cores). `cpu-alfworld` gives ALFWorld the same policy (warm start: 8% / 4% of
held-out games; `--warm-only` stops there) and 10 RL steps per run (~2 h for 15 runs).
`cuda` starts from a pretrained instruct model.
ALFWorld's engine is deterministic and slow (resets ~1 s, steps 60-200 ms), so its
episodes are served through an exact transition memo that all runs share
(`common.MemoEnv`): the agent reads what the engine says, each transition is computed once.

Writes <out>/learning_study.json (<out>/learning_study_<size>.json for other sizes than
cpu), <out>/learning_<env>.png; runs go to --work-dir and are reused with --resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench import common
from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.advantages import StepAdvantageEstimator, resolve_settings
from bipace_trainer.demonstrations import collect_demonstrations
from bipace_trainer.models import load_tokenizer, resolve_model_name
from envs.base import resolve_env_class

PRESETS = ("grpo", "gigpo", "bipace_q", "gagpo", "bigagpo")
GAINS = (0.05, 0.1, 0.2)  # steps to reach warm-start success + gain
PAIRED_BASELINE = "grpo"  # training-batch success is also reported as a difference to it, seed by seed


@dataclass(frozen=True)
class EnvPlan:
    """One env's warm start and RL budget."""

    env: str
    eval_splits: tuple[str, ...]  # the first is validated during training; the others at the end
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    memo: bool = False  # serve episodes through common.MemoEnv
    # warm start
    expert_prob: float = 1.0
    episodes_per_task: int = 1
    demo_variants: int = 1  # task ids t + k * demo_id_stride, k < demo_variants (same goals, other distractors)
    demo_id_stride: int = 0
    sft_steps: int = 300
    sft_batch_size: int = 8
    sft_learning_rate: float = 3e-3
    # RL
    rl_steps: int = 30
    tasks_per_iteration: int = 2
    num_generations: int = 8
    max_turns: int = 10
    eval_interval: int = 10
    eval_tasks: int = 0
    eval_rollouts_per_task: int = 1


@dataclass(frozen=True)
class Size:
    """The policy and what every env shares."""

    envs: dict[str, EnvPlan]
    model: str | None = None  # None: tiny random Qwen2 (hidden_size x layers) with a tokenizer trained on the env
    hidden_size: int = 64
    layers: int = 2
    learning_rate: float = 1e-3  # tiny model, full fine-tuning: 1e-3 is stable, 2e-2 broke the reply format
    history_length: int = 1
    max_completion_length: int = 40
    cluster_layer: int = -2  # hidden state of the tiny model's middle (the paper: layer -8 of 28)
    seeds: int = 3
    jobs: int = 2
    device: str = "cpu"


SIZES = {
    "quick": Size(
        envs={
            "tiny": EnvPlan(
                "tiny", ("valid",), env_kwargs={"size": 4}, expert_prob=0.5, episodes_per_task=4, sft_steps=80,
                sft_learning_rate=5e-3, rl_steps=3, tasks_per_iteration=2, num_generations=4, max_turns=4, eval_interval=2,
                eval_rollouts_per_task=4,
            )
        },
        seeds=1,
        jobs=1,
    ),
    "cpu": Size(
        envs={
            "tiny": EnvPlan(
                "tiny", ("valid",), env_kwargs={"size": 6}, expert_prob=0.5, episodes_per_task=4, sft_steps=80,
                sft_learning_rate=5e-3, rl_steps=30, tasks_per_iteration=2, num_generations=8, max_turns=6,
                eval_interval=5, eval_rollouts_per_task=8,
            )
        },
        seeds=5,
    ),
    # TextCraft and ALFWorld with the tiny model: its warm start solves no held-out (nor
    # training) task after 400/300 SFT steps (19/14 min), see docs/RESULTS.md.
    "cpu-envs": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood"), demo_variants=3, demo_id_stride=419, sft_steps=400,
                sft_batch_size=16, rl_steps=30, tasks_per_iteration=2, num_generations=8, max_turns=10,
                eval_interval=10,
            ),
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), memo=True, expert_prob=0.8, episodes_per_task=2,
                sft_steps=300, rl_steps=16, tasks_per_iteration=2, num_generations=8, max_turns=10, eval_interval=8,
            ),
        },
    ),
    # TextCraft alone with a policy 17x the tiny env's (256 x 4, 2.7M parameters): 1,200
    # SFT steps (~21 min on 2 threads) win 44% of 48 training goals and 15% of 48
    # held-out ones. RL at lr 3e-4 lost ground in a 10-step pilot, at 1e-4 it moved within
    # the evaluation's noise; 30 steps x 3 seeds at 1e-4 did not lift any preset above the
    # warm start (docs/RESULTS.md, "TextCraft: 5 presets x 3 seeds"). A step costs ~11 s on
    # 2 threads. Rollouts sample at 0.5 (--set temperature=0.5).
    "cpu-textcraft": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood", "train"), demo_variants=3, demo_id_stride=419, sft_steps=1200,
                sft_batch_size=16, sft_learning_rate=1e-3, rl_steps=30, tasks_per_iteration=2, num_generations=8,
                max_turns=10, eval_interval=10, eval_tasks=48,
            ),
        },
        hidden_size=256,
        layers=4,
        learning_rate=1e-4,
    ),
    # ALFWorld with the same 256 x 4 policy: 240 generated training games (40 per task
    # type), two expert-ish episodes each, 15 turns (the expert needs up to ~12 on them).
    # Its warm start wins 8% / 4% of held-out games. RL is 10 steps: a step is 16 episodes
    # of up to 15 engine turns and ~240 samples, ~60 s on one core, so the 15 runs of the
    # comparison take ~2 h with 2 jobs (docs/RESULTS.md, "ALFWorld"); that is all they show.
    "cpu-alfworld": Size(
        envs={
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), env_kwargs={"train_games_per_type": 40, "eval_games_per_type": 8},
                memo=True, expert_prob=0.8, episodes_per_task=2, sft_steps=1200, sft_batch_size=16,
                sft_learning_rate=1e-3, rl_steps=10, tasks_per_iteration=2, num_generations=8, max_turns=15,
                eval_interval=10,
            ),
        },
        hidden_size=256,
        layers=4,
        learning_rate=1e-4,
    ),
    "cuda": Size(
        envs={
            "textcraft": EnvPlan(
                "textcraft", ("valid", "test_ood"), sft_steps=100, sft_batch_size=16, sft_learning_rate=1e-5,
                rl_steps=150, tasks_per_iteration=16, num_generations=8, max_turns=15, eval_interval=10,
            ),
            "alfworld": EnvPlan(
                "alfworld", ("valid_unseen", "valid_seen"), env_kwargs={"train_games_per_type": 48, "eval_games_per_type": 8},
                expert_prob=0.8, episodes_per_task=2, sft_steps=100, sft_batch_size=16, sft_learning_rate=1e-5,
                rl_steps=150, tasks_per_iteration=16, num_generations=8, max_turns=30, eval_interval=10,
            ),
        },
        model="Qwen/Qwen2.5-0.5B-Instruct",
        learning_rate=1e-6,
        history_length=2,
        max_completion_length=256,
        cluster_layer=-8,
        jobs=1,
        device="cuda",
    ),
}


# ---------------------------------------------------------------------- env and trainer


def env_name_and_kwargs(plan: EnvPlan, work_dir: Path) -> tuple[str, dict[str, Any]]:
    if not plan.memo:
        return plan.env, dict(plan.env_kwargs)
    return common.memo_env(plan.env), {**plan.env_kwargs, "memo_path": str(work_dir / plan.env / "memo.sqlite")}


def rl_config(plan: EnvPlan, size: Size, work_dir: Path, output_dir: Path, preset: str = "grpo", seed: int = 0,
              overrides: dict[str, Any] | None = None):
    """The RL run's `BiPACEConfig`; `overrides` (from --set) replace any field, e.g. cluster_eps."""
    env_name, env_kwargs = env_name_and_kwargs(plan, work_dir)
    fields = dict(
        output_dir=str(output_dir),
        env_name=env_name,
        env_kwargs=env_kwargs,
        preset=preset,
        seed=seed,
        max_steps=plan.rl_steps,
        learning_rate=size.learning_rate,
        lr_scheduler_type="constant",
        tasks_per_iteration=plan.tasks_per_iteration,
        num_generations=plan.num_generations,
        # one rollout batch = one optimizer step, accumulated over one micro-batch per task group
        per_device_train_batch_size=plan.num_generations,
        gradient_accumulation_steps=plan.tasks_per_iteration,
        max_turns=plan.max_turns,
        history_length=size.history_length,
        max_completion_length=size.max_completion_length,
        cluster_layer=size.cluster_layer,
        eval_split=plan.eval_splits[0],
        eval_tasks=plan.eval_tasks,
        eval_rollouts_per_task=plan.eval_rollouts_per_task,
        eval_interval=plan.eval_interval,
        evaluate_before_training=False,  # the warm start is evaluated once for all runs
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=size.device == "cpu",
    )
    return BiPACEConfig(**{**fields, **(overrides or {})})


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
        self.needs_hidden = True
        eps = dict(
            cluster_eps=self.args.cluster_eps,
            target_singleton_rate=self.args.target_singleton_rate,
            max_cluster_eps=self.args.max_cluster_eps,
        )
        self.probes = {
            "hash": StepAdvantageEstimator(resolve_settings("bipace_q", partition="hash")),
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
    trainer.args.eval_split = split
    result = trainer.evaluate_policy(tag=tag)
    return {"split": split, "step": result["step"], "success_rate": result["success_rate"],
            "episode_length": result["episode_length"], "per_type": result.get("per_type", {})}


# ---------------------------------------------------------------------- jobs (run in worker processes)


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
    }


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


def describe(job: dict[str, Any]) -> str:
    run = f"{job['preset']} seed {job['seed']}" if "preset" in job else "warm start"
    return f"{job['plan'].env} {run}"


# ---------------------------------------------------------------------- summary


def final_and_peak(run: dict[str, Any], split: str) -> tuple[float, float]:
    curve = [e["success_rate"] for e in run["evals"] if e["split"] == split]
    return curve[-1], max(curve)


def steps_to_gain(run: dict[str, Any], split: str, target: float) -> int | None:
    return next((e["step"] for e in run["evals"] if e["split"] == split and e["success_rate"] >= target), None)


def window_mean(run: dict[str, Any], window: slice) -> float:
    return statistics.fmean(row["train_success"] for row in run["curve"][window])


def paired_differences(run: dict[str, Any], baseline: dict[str, Any]) -> list[float]:
    """Step by step, run's − baseline's training-batch success.

    Runs with the same seed draw the same tasks at every step, so the difference removes
    how hard each step's tasks are, which dominates a 2-task batch's success.
    """
    return [a["train_success"] - b["train_success"] for a, b in zip(run["curve"], baseline["curve"])]


def paired_gap(run: dict[str, Any], baseline: dict[str, Any]) -> float:
    """`paired_differences` averaged over the second half of the steps."""
    differences = paired_differences(run, baseline)
    return statistics.fmean(differences[len(differences) // 2:])


def curve_mean(runs: list[dict[str, Any]], key: str) -> float:
    values = [row[key] for run in runs for row in run["curve"] if not math.isnan(row[key] if row[key] is not None else math.nan)]
    return statistics.fmean(values) if values else math.nan


def summarise_env(plan: EnvPlan, warm: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    validation = plan.eval_splits[0]
    start = next(e["success_rate"] for e in warm["evals"] if e["split"] == validation)
    presets = {}
    baseline = {run["seed"]: run for run in runs if run["preset"] == PAIRED_BASELINE}
    for preset in dict.fromkeys(run["preset"] for run in runs):
        mine = [run for run in runs if run["preset"] == preset]
        gaps = [paired_gap(run, baseline[run["seed"]]) for run in mine if run["seed"] in baseline]
        finals = {split: [final_and_peak(run, split)[0] for run in mine] for split in plan.eval_splits}
        per_type: dict[str, dict[str, list[float]]] = {split: {} for split in plan.eval_splits}
        for run in mine:
            for split in plan.eval_splits:
                final = [e for e in run["evals"] if e["split"] == split][-1]
                for key, value in (final["per_type"] or {}).items():
                    per_type[split].setdefault(key, []).append(value)
        steps_to = {}
        for gain in GAINS:
            reached = [s for s in (steps_to_gain(run, validation, start + gain) for run in mine) if s is not None]
            steps_to[f"+{gain:g}"] = {"steps": common.mean_std(reached), "reached": len(reached), "runs": len(mine)}
        presets[preset] = {
            "final": {split: common.mean_std(values) for split, values in finals.items()},
            "peak": common.mean_std([final_and_peak(run, validation)[1] for run in mine]),
            # training-batch success (sampled at the rollout temperature): first and last 5 steps of each run
            "train_success_first5": common.mean_std([window_mean(run, slice(None, 5)) for run in mine]),
            "train_success_last5": common.mean_std([window_mean(run, slice(-5, None)) for run in mine]),
            f"train_success_minus_{PAIRED_BASELINE}_2nd_half": common.mean_std(gaps),
            "per_type_final": {key: common.mean_std(values) for key, values in sorted(per_type[validation].items())},
            "per_type_final_by_split": {
                split: {key: common.mean_std(values) for key, values in sorted(types.items())}
                for split, types in per_type.items()
            },
            "steps_to_gain": steps_to,
            **{key: curve_mean(mine, key) for key in CURVE_KEYS},
            "seconds_per_step": statistics.fmean(run["timing"].get("step_time", math.nan) for run in mine),
            "timing": {k: statistics.fmean(run["timing"].get(k, math.nan) for run in mine) for k in mine[0]["timing"]},
        }
    return {"validation_split": validation, "warm_start": warm, "presets": presets}


CURVE_KEYS = (
    "train_success",
    "hash_singleton_rate",
    "hidden_singleton_rate",
    "hidden_eps",
    "hidden_branch_pace",
    "hidden_branch_loo",
    "hidden_branch_singleton",
    "hash_branch_pace",
    "hash_branch_loo",
    "hash_branch_singleton",
    "advantage_std",
    "nonzero_advantage",
)


def print_env(env: str, summary: dict[str, Any], plan: EnvPlan) -> None:
    validation = summary["validation_split"]
    starts = {e["split"]: e["success_rate"] for e in summary["warm_start"]["evals"]}
    print(f"\n== {env}: warm start " + ", ".join(f"{s} {v:.3f}" for s, v in starts.items()))
    extra = plan.eval_splits[1:]
    header = f"{'preset':<10}{validation + ' final':>20}{'peak':>16}" + "".join(f"{s + ' final':>20}" for s in extra)
    header += f"{'train first5 → last5':>24}{'− ' + PAIRED_BASELINE + ' (paired)':>20}{'+0.1 at step':>14}{'hash singl.':>12}{'hidden singl.':>14}{'A≠0':>7}{'s/step':>8}"
    print(header)
    for preset, row in summary["presets"].items():
        fmt = lambda ms: f"{ms['mean']:.3f} ± {ms['std']:.3f}"  # noqa: E731
        reach = row["steps_to_gain"]["+0.1"]
        reach_text = f"{reach['steps']['mean']:.0f} ({reach['reached']}/{reach['runs']})" if reach["reached"] else "never"
        line = f"{preset:<10}{fmt(row['final'][validation]):>20}{fmt(row['peak']):>16}"
        line += "".join(f"{fmt(row['final'][s]):>20}" for s in extra)
        line += f"{row['train_success_first5']['mean']:.3f} → {row['train_success_last5']['mean']:.3f}".rjust(24)
        line += f"{fmt(row[f'train_success_minus_{PAIRED_BASELINE}_2nd_half']):>20}"
        line += f"{reach_text:>14}{row['hash_singleton_rate']:>12.3f}{row['hidden_singleton_rate']:>14.3f}"
        line += f"{row['nonzero_advantage']:>7.2f}{row['seconds_per_step']:>8.1f}"
        print(line)
    for split in plan.eval_splits:
        types = sorted({t for row in summary["presets"].values() for t in row["per_type_final_by_split"][split]})
        if not types:
            continue
        warm = next(e for e in summary["warm_start"]["evals"] if e["split"] == split)["per_type"]
        print(f"\n{split}, final success per task type (mean over seeds; warm start first)")
        width = max(len(t) for t in types) + 2
        print(f"{'preset':<10}" + "".join(f"{t:>{width}}" for t in types))
        print(f"{'warm':<10}" + "".join(f"{warm.get(t, math.nan):>{width}.3f}" for t in types))
        for preset, row in summary["presets"].items():
            cells = row["per_type_final_by_split"][split]
            print(f"{preset:<10}" + "".join(f"{cells[t]['mean'] if t in cells else math.nan:>{width}.3f}" for t in types))


def plot_env(env: str, summary: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    validation = summary["validation_split"]
    start = next(e["success_rate"] for e in summary["warm_start"]["evals"] if e["split"] == validation)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    baseline = {run["seed"]: run for run in runs if run["preset"] == PAIRED_BASELINE}
    for preset in summary["presets"]:
        mine = [run for run in runs if run["preset"] == preset]
        steps = [0] + [e["step"] for e in mine[0]["evals"] if e["split"] == validation]
        values = np.array([[start] + [e["success_rate"] for e in run["evals"] if e["split"] == validation] for run in mine])
        (line,) = axes[0, 0].plot(steps, values.mean(0), "o-", label=preset)
        axes[0, 0].fill_between(steps, values.mean(0) - values.std(0), values.mean(0) + values.std(0),
                                color=line.get_color(), alpha=0.15)
        for ax, key in ((axes[0, 1], "train_success"), (axes[1, 1], "nonzero_advantage")):
            series = np.array([[row[key] for row in run["curve"]] for run in mine]).mean(0)
            window = min(5, len(series))
            smooth = np.convolve(series, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, len(series) + 1), smooth, color=line.get_color(), label=preset)
        paired = [run for run in mine if run["seed"] in baseline]
        if paired and preset != PAIRED_BASELINE:
            gaps = np.array([paired_differences(run, baseline[run["seed"]]) for run in paired])
            window = min(5, gaps.shape[1])
            smooth = np.array([np.convolve(g, np.ones(window) / window, mode="valid") for g in gaps])
            x = np.arange(window, gaps.shape[1] + 1)
            axes[0, 2].plot(x, smooth.mean(0), color=line.get_color(), label=preset)
            axes[0, 2].fill_between(x, smooth.mean(0) - smooth.std(0), smooth.mean(0) + smooth.std(0),
                                    color=line.get_color(), alpha=0.12)
    for key, style in (("hash_singleton_rate", "-"), ("hidden_singleton_rate", "--")):
        series = np.array([[row[key] for row in run["curve"]] for run in runs])
        mean, std = np.nanmean(series, 0), np.nanstd(series, 0)
        steps = np.arange(1, series.shape[1] + 1)
        axes[1, 0].plot(steps, mean, style, color="black", label=key.split("_")[0] + " partition")
        axes[1, 0].fill_between(steps, mean - std, mean + std, color="grey", alpha=0.2)
    for branch, style in (("pace", "-"), ("loo", "--"), ("singleton", ":")):
        for partition, color in (("hash", "black"), ("hidden", "tab:red")):
            series = np.array([[row[f"{partition}_branch_{branch}"] for row in run["curve"]] for run in runs])
            axes[1, 2].plot(np.arange(1, series.shape[1] + 1), np.nanmean(series, 0), style, color=color,
                            label=f"{partition}: {branch}")
    axes[0, 2].axhline(0.0, color="grey", lw=1)
    axes[0, 0].set(title=f"validation success ({validation}), mean ± std over seeds", xlabel="step")
    axes[0, 1].set(title="training-batch success (5-step mean)", xlabel="step")
    axes[0, 2].set(title=f"training-batch success − {PAIRED_BASELINE}'s, same seed and tasks\n(5-step mean ± std over seeds)",
                   xlabel="step")
    axes[1, 0].set(title="singleton rate on the same batches (all runs)", xlabel="step", ylim=(0, 1))
    axes[1, 1].set(title="steps with a non-zero advantage (5-step mean)", xlabel="step")
    axes[1, 2].set(title="PACE-Q branch fractions on the same batches (all runs)", xlabel="step", ylim=(0, 1))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{env}: RL from one warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--quick", action="store_const", const="quick", dest="size", help="same as --size quick")
    parser.add_argument("--envs", nargs="+", help="subset of the size's envs")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--seeds", type=int, help="seeds per preset (default: the size's)")
    parser.add_argument("--rl-steps", type=int, help="override every env's RL steps")
    parser.add_argument("--sft-steps", type=int, help="override every env's SFT (warm-start) steps")
    parser.add_argument("--model", help="model id or path instead of the size's (None = tiny random Qwen2)")
    parser.add_argument("--jobs", type=int, help="runs in parallel (default: the size's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default=str(common.ROOT / "docs" / "results"))
    parser.add_argument("--work-dir", default=str(common.ROOT / "outputs" / "learning_study"))
    parser.add_argument("--resume", action="store_true", help="reuse the warm starts and runs already in --work-dir")
    parser.add_argument("--warm-only", action="store_true",
                        help="stop after the warm starts; write <out>/learning_<size>_<env>_warm.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a BiPACEConfig field in every RL run (ablations), e.g. --set cluster_eps=0.05")
    args = parser.parse_args(argv)
    args.overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(BiPACEConfig, key):
            parser.error(f"--set {item!r}: use FIELD=VALUE with a BiPACEConfig field, e.g. --set cluster_eps=0.05")
        try:
            args.overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            args.overrides[key] = value
    return args


def resolve_size(args) -> Size:
    size = SIZES[args.size]
    envs = {name: plan for name, plan in size.envs.items() if not args.envs or name in args.envs}
    steps = {k: v for k, v in (("rl_steps", args.rl_steps), ("sft_steps", args.sft_steps)) if v}
    envs = {name: dataclasses.replace(plan, **steps) for name, plan in envs.items()}
    overrides = {k: v for k, v in (("seeds", args.seeds), ("jobs", args.jobs), ("model", args.model)) if v}
    return dataclasses.replace(size, envs=envs, **overrides)


def main(argv=None):
    args = parse_args(argv)
    size = resolve_size(args)
    work_dir, out = Path(args.work_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"{args.size} size: envs {list(size.envs)}, presets {args.presets}, {size.seeds} seeds, {size.jobs} jobs", flush=True)

    base = {"size": size, "work_dir": str(work_dir), "threads": args.threads, "overrides": args.overrides}
    warm_jobs = [dict(base, plan=plan) for plan in size.envs.values()]
    print("warm starts ...", flush=True)
    warms = run_jobs(warm_start_job, warm_jobs, size.jobs, [work_dir / p.env / "warm.json" for p in size.envs.values()],
                     args.resume)
    for warm in warms:
        print(f"  {warm['env']}: {warm['demonstrations']} demonstration steps, "
              + ", ".join(f"{e['split']} success {e['success_rate']:.3f}" for e in warm["evals"]), flush=True)

    if args.warm_only:
        paths = [common.write_json(out / f"learning_{args.size}_{warm['env']}_warm.json", warm) for warm in warms]
        print(f"\nwrote {', '.join(map(str, paths))} in {(time.perf_counter() - start) / 60:.1f} min")
        return {"warm_starts": warms}

    rl_jobs = [dict(base, plan=plan, preset=preset, seed=seed)
               for seed in range(size.seeds) for plan in size.envs.values() for preset in args.presets]
    print(f"{len(rl_jobs)} RL runs ...", flush=True)
    paths = [work_dir / job["plan"].env / "runs" / f"{job['preset']}-seed{job['seed']}.json" for job in rl_jobs]
    runs = run_jobs(rl_job, rl_jobs, size.jobs, paths, args.resume)

    result = {"size": args.size, "presets": args.presets, "seeds": size.seeds, "overrides": args.overrides, "model": size.model or
              f"tiny random Qwen2 ({size.hidden_size} x {size.layers})", "machine": common.machine(), "envs": {}}
    for warm, plan in zip(warms, size.envs.values()):
        mine = [run for run in runs if run["env"] == plan.env]
        summary = summarise_env(plan, warm, mine)
        summary["plan"] = dataclasses.asdict(plan)
        summary["runs"] = mine
        result["envs"][plan.env] = summary
        print_env(plan.env, summary, plan)
        plot_env(plan.env, summary, mine, out / f"learning_{plan.env}.png")
    result["wall_seconds"] = time.perf_counter() - start  # of this invocation: runs reused by --resume cost ~0
    # what every warm start and run took when it ran, summed (jobs in parallel overlap)
    result["job_seconds"] = sum(warm["seconds"] for warm in warms) + sum(run["seconds"] for run in runs)
    name = "learning_study.json" if args.size in ("cpu", "quick") else f"learning_study_{args.size}.json"
    path = common.write_json(out / name, result)
    print(f"\nwrote {path} and learning_<env>.png in {result['wall_seconds'] / 60:.1f} min")
    return result


if __name__ == "__main__":
    main()
