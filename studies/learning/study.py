"""Learning comparison: GRPO, GiGPO, BiPACE_Q, GAGPO and BiGAGPO from one warm-started policy.

    OMP_NUM_THREADS=1 python -m studies.learning.study                   # CPU study: tiny env, 5 seeds (~15 min)
    OMP_NUM_THREADS=1 python -m studies.learning.study --quick           # CI size: tiny env, 1 seed (~1 min)
    OMP_NUM_THREADS=1 python -m studies.learning.study --size cpu-envs   # TextCraft + ALFWorld, tiny model (see below)
    OMP_NUM_THREADS=1 python -m studies.learning.study --size cpu-textcraft  # TextCraft, 256 x 4 model
    OMP_NUM_THREADS=1 python -m studies.learning.study --size cpu-alfworld   # ALFWorld, 256 x 4 model
    python -m studies.learning.study --size cuda                         # GPU: Qwen2.5-0.5B-Instruct, TextCraft + ALFWorld
    OMP_NUM_THREADS=1 python -m studies.learning.study --size cpu-surface    # tiny env at surface variation 1 (issue 32)
    OMP_NUM_THREADS=1 python -m studies.learning.study --size cpu-textcraft-surface --set train_tasks=8  # TextCraft mix, same

Per env:
1. Warm start. SFT (TRL's SFTTrainer) of a small policy on expert and perturbed-expert
   trajectories of the train split (`bipace_trainer.run.demonstrations`), built with the RL
   prompts' history window, so that rollouts succeed sometimes, as an instruct model's
   do. Evaluated once on the held-out splits: every run starts from these numbers.
2. RL from that checkpoint with every preset, the same budget, `--seeds` seeds each.
   Hidden states are captured for every preset, so the `hash` and the `hidden` partition
   are both measured on the very same training batches whichever one the preset uses.
3. Summary: validation success (final and peak, mean ± std over seeds), success per task
   type and on the out-of-domain split, steps to reach the warm start + a gain, singleton
   rates of both partitions, PACE branch fractions, the spread of the advantages and the
   share of steps that get a non-zero one; a learning-curve plot per env.

Sizes (`learning_plan.SIZES`). `cpu` is what 2 cores can show: the tiny line-walking env
(6 cells, held-out start/goal pairs), a tiny random-init Qwen2 (64 x 2) with a tokenizer
trained on the env's text. `cpu-envs` runs the same recipe on TextCraft (train depth 2 =
"train", held-out depth-2 goals = "valid", out of domain depth 3 = "test_ood") and ALFWorld
(games generated offline; "valid_unseen", "valid_seen", success per task type).
`cpu-textcraft` runs a 256 x 4 policy on TextCraft alone; `cpu-alfworld` gives ALFWorld the
same policy (`--warm-only` stops after its warm start). `cuda` starts from a pretrained
instruct model. What each size showed: docs/RESULTS.md.
ALFWorld's engine is deterministic and slow (README, Performance), so its episodes are
served through an exact transition memo that all runs share (`common.MemoEnv`): the agent
reads what the engine says, each transition is computed once.

The parts: `learning_plan` (sizes, plans, the RL config), `learning_runner` (warm start
and RL jobs in worker processes), `learning_stats` (the summary), `learning_report`
(tables and plots); this module is the command line.

Writes <out>/learning_study.json (<out>/learning_study_<size>.json for other sizes than
cpu), <out>/learning_<env>.png; runs go to --work-dir and are reused with --resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench import common
from studies.learning.plan import PRESETS, SIZES, Size
from studies.learning.report import plot_env, print_env
from studies.learning.runner import hosts, rl_job, run_jobs, warm_start_job
from studies.learning.stats import summarise_env
from bipace_trainer import BiPACEConfig


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--quick", action="store_const", const="quick", dest="size", help="same as --size quick")
    parser.add_argument("--envs", nargs="+", help="subset of the size's envs")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--seeds", type=int, help="seeds per preset (default: the size's)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="run seeds N … N+seeds-1 (default 0): to extend a study, or run its seeds on two machines")
    parser.add_argument("--rl-steps", type=int, help="override every env's RL steps")
    parser.add_argument("--sft-steps", type=int, help="override every env's SFT (warm-start) steps")
    parser.add_argument("--validation-only", action="store_true",
                        help="evaluate only the validation split during training, not the other splits at the end: "
                             "short runs compared at a step with --rl-steps (the first steps are the full runs')")
    parser.add_argument("--model", help="model id or path instead of the size's (None = tiny random Qwen2)")
    parser.add_argument("--jobs", type=int, help="runs in parallel (default: the size's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default=str(common.ROOT / "studies" / "learning" / "results"))
    parser.add_argument("--work-dir", default=str(common.ROOT / "outputs" / "learning_study"))
    parser.add_argument("--resume", action="store_true", help="reuse the warm starts and runs already in --work-dir")
    parser.add_argument("--warm-only", action="store_true",
                        help="stop after the warm starts; write <out>/learning_<size>_<env>_warm.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a BiPACEConfig field in every RL run (ablations), e.g. --set cluster_eps=0.05")
    args = parser.parse_args(argv)
    if args.first_seed < 0:
        parser.error(f"--first-seed {args.first_seed}: seeds start at 0 or above, e.g. --first-seed 3 to add seeds 3, 4, ...")
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
    if args.validation_only:  # the splits evaluated only at the end cost time and change nothing before it
        envs = {name: dataclasses.replace(plan, eval_splits=plan.eval_splits[:1]) for name, plan in envs.items()}
    overrides = {k: v for k, v in (("seeds", args.seeds), ("jobs", args.jobs), ("model", args.model)) if v}
    return dataclasses.replace(size, envs=envs, **overrides)


def main(argv=None):
    args = parse_args(argv)
    size = resolve_size(args)
    work_dir, out = Path(args.work_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    seeds = list(range(args.first_seed, args.first_seed + size.seeds))
    print(f"{args.size} size: envs {list(size.envs)}, presets {args.presets}, seeds {seeds}, {size.jobs} jobs", flush=True)

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
               for seed in seeds for plan in size.envs.values() for preset in args.presets]
    print(f"{len(rl_jobs)} RL runs ...", flush=True)
    paths = [work_dir / job["plan"].env / "runs" / f"{job['preset']}-seed{job['seed']}.json" for job in rl_jobs]
    runs = run_jobs(rl_job, rl_jobs, size.jobs, paths, args.resume)

    ran_on = hosts(warms + runs)
    if sum(1 for host in ran_on if host["platform"]) > 1:  # results written before hosts were recorded have none
        print(f"note: the warm starts and runs come from {len(ran_on)} hosts ({ran_on}): runs of one seed draw the same "
              "tasks but are not batch-identical across hosts", flush=True)
    result = {"size": args.size, "presets": args.presets, "seeds": seeds, "overrides": args.overrides, "model": size.model or
              f"tiny random Qwen2 ({size.hidden_size} x {size.layers})", "machine": common.machine(), "hosts": ran_on, "envs": {}}
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
