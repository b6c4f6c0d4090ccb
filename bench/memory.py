"""Peak resident memory of the main job (`python train.py`), phase by phase, variants side by side.

    python -m bench.memory                                  # the main job, short: 1 RL step, 2 eval goals
    python -m bench.memory --cold                           # each variant with an empty model cache (conversion)
    python -m bench.memory --out docs/results/memory/main_job.json -- --max_steps 3 --eval_tasks 8  # the whole job

Each variant runs `train.py` (the main job's defaults plus the flags after `--`) in a child
process, while this process samples the resident set size (RSS) of the child's whole process
tree every `--interval` seconds (psutil). The child marks the phases it enters in a file
(model conversion, model load, evaluation, rollout, old log-probs, update), so every sample is
attributed to the innermost phase running when it was taken; a phase's peak is the largest
sample inside it. Variants (`VARIANTS`):

- `after`: the code as it is: `bipace_trainer.update.memory.bound_cpu_memory` (small log-prob tiles,
  a fixed glibc mmap threshold) and the main job's gradient checkpointing;
- `before`: the job as it was: `bound_cpu_memory` made a no-op, `--gradient_checkpointing false`;
- `no_checkpointing`: `after` without gradient checkpointing (what the two memory bounds
  alone give);
- `before_trim`: `before` with glibc's `malloc_trim(0)` after every phase (is the memory held
  after the update the allocator's?).

The JSON holds the machine (CPU model, ISA flags, threads, load before and after), each
variant's peak, per-phase peaks and durations, and the summary lines the job printed, so that
a fix that changes the job's numbers shows up next to the memory it saves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# name → (bound_cpu_memory disabled, extra train.py flags)
VARIANTS = {
    "after": (False, []),
    "before": (True, ["--gradient_checkpointing", "false"]),
    "no_checkpointing": (False, ["--gradient_checkpointing", "false"]),
    "before_trim": (True, ["--gradient_checkpointing", "false"]),
}
PHASE_FILE_ENV = "BIPACE_MEMORY_PHASES"
# The main job's summary lines that a memory fix must leave unchanged.
SUMMARY_PREFIXES = ("success before RL", "success after RL", "RL steps with non-zero")


# ---------------------------------------------------------------------- the child: train.py with phase marks


def _mark(name: str, event: str) -> None:
    with open(os.environ[PHASE_FILE_ENV], "a") as f:
        f.write(json.dumps({"t": time.time(), "phase": name, "event": event}) + "\n")


def _trim() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _wrap(owner, attr: str, phase: str, trim: bool) -> None:
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        _mark(phase, "enter")
        try:
            return original(*args, **kwargs)
        finally:
            if trim:
                _trim()
            _mark(phase, "exit")

    setattr(owner, attr, wrapped)


def child(variant: str, train_args: list[str]) -> None:
    """Run train.py as `python train.py` would, with the phases marked (and the variant's change)."""
    from transformers import AutoModelForCausalLM

    import bipace_trainer.update.batching as batching
    import bipace_trainer.run.evaluation as evaluation
    import bipace_trainer.update.memory as memory
    import bipace_trainer.models as models
    from bipace_trainer.trainer import BiPACETrainer

    trim = variant.endswith("_trim")
    if VARIANTS[variant][0]:
        memory.bound_cpu_memory = lambda device: contextlib.nullcontext(False)
    _wrap(models, "embedded_model_path", "model_path", trim)  # the GGUF conversion, on a cold cache
    _wrap(AutoModelForCausalLM, "from_pretrained", "model_load", trim)
    _wrap(evaluation, "evaluate_policy", "evaluation", trim)
    _wrap(BiPACETrainer, "_scored_rollout", "rollout", trim)
    _wrap(batching, "reference_logps", "old_logprobs", trim)
    _wrap(BiPACETrainer, "training_step", "step", trim)  # holds the rollout, then the loss and its backward
    _wrap(BiPACETrainer, "compute_loss", "loss", trim)  # forward and backward of every piece but the last
    sys.argv = [str(ROOT / "train.py"), *train_args]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


# ---------------------------------------------------------------------- the parent: sampling and attribution


def tree_rss(process) -> tuple[int, int]:
    """RSS summed over `process` and its descendants, and how many processes that is."""
    import psutil

    total, count = 0, 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for member in members:
        try:
            total += member.memory_info().rss
            count += 1
        except psutil.NoSuchProcess:
            pass
    return total, count


def attribute(samples: list[tuple[float, int]], marks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each phase's peak RSS (MB), summed time (s) and entries: a sample counts for the innermost
    phase open at its time (marks are nested enters and exits, in time order); 'other' otherwise."""
    events = sorted(marks, key=lambda m: m["t"])
    phases: dict[str, dict[str, float]] = {}
    stack: list[tuple[str, float]] = []
    index = 0

    def entry(name: str) -> dict[str, float]:
        return phases.setdefault(name, {"peak_mb": 0.0, "seconds": 0.0, "entries": 0})

    for t, rss in samples:
        while index < len(events) and events[index]["t"] <= t:
            mark = events[index]
            if mark["event"] == "enter":
                stack.append((mark["phase"], mark["t"]))
                entry(mark["phase"])["entries"] += 1
            elif stack:
                name, start = stack.pop()
                if not stack or stack[-1][0] != name:  # the time of a phase nested in itself counts once
                    entry(name)["seconds"] += mark["t"] - start
            index += 1
        current = entry(stack[-1][0] if stack else "other")
        current["peak_mb"] = max(current["peak_mb"], rss / 2**20)
    for name, item in phases.items():
        item["peak_mb"] = round(item["peak_mb"], 1)
        item["seconds"] = round(item["seconds"], 2)
    return phases


def timeline(samples: list[tuple[float, int]], marks: list[dict[str, Any]], start: float, points: int = 300) -> dict[str, Any]:
    """The RSS curve, at most `points` maxima of equal time bins (s from the start, MB), and the phase marks."""
    if not samples:
        return {"t_s": [], "rss_mb": [], "marks": []}
    width = max((samples[-1][0] - start) / points, 1e-9)
    bins: dict[int, int] = {}
    for t, rss in samples:
        key = int((t - start) / width)
        bins[key] = max(bins.get(key, 0), rss)
    keys = sorted(bins)
    return {
        "t_s": [round(k * width, 1) for k in keys],
        "rss_mb": [round(bins[k] / 2**20) for k in keys],
        "marks": [[round(m["t"] - start, 2), m["phase"], m["event"]] for m in sorted(marks, key=lambda m: m["t"])],
    }


def run_variant(variant: str, train_args: list[str], cold: bool, interval: float, log_dir: Path) -> dict[str, Any]:
    import psutil

    with tempfile.TemporaryDirectory(prefix=f"memory-{variant}-") as scratch:
        scratch = Path(scratch)
        env = dict(os.environ, **{PHASE_FILE_ENV: str(scratch / "phases.jsonl"), "PYTHONPATH": str(ROOT)})
        if cold:
            env["BIPACE_CACHE"] = str(scratch / "cache")
        args = list(train_args) + VARIANTS[variant][1]
        if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in args):
            args += ["--output_dir", str(scratch / "run")]
        log_path = log_dir / f"memory_{variant}{'_cold' if cold else ''}.log"
        command = [sys.executable, "-m", "bench.memory", "--child", variant, "--", *args]
        start = time.time()
        samples: list[tuple[float, int]] = []
        most_processes = 0
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            watched = psutil.Process(proc.pid)
            while proc.poll() is None:
                rss, count = tree_rss(watched)
                if count:
                    samples.append((time.time(), rss))
                    most_processes = max(most_processes, count)
                time.sleep(interval)
        wall = time.time() - start
        marks = []
        if (scratch / "phases.jsonl").exists():
            marks = [json.loads(line) for line in (scratch / "phases.jsonl").read_text().splitlines() if line]
    output = log_path.read_text(errors="replace").splitlines()
    summary = [line for line in output if line.startswith(SUMMARY_PREFIXES)]
    peak = max((rss for _, rss in samples), default=0) / 2**20
    return {
        "variant": variant,
        "cold_cache": cold,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "samples": len(samples),
        "most_processes": most_processes,
        "peak_mb": round(peak, 1),
        "phases": attribute(samples, marks),
        "timeline": timeline(samples, marks, start),
        "summary": summary,
        "log": str(log_path.relative_to(ROOT)) if log_path.is_relative_to(ROOT) else str(log_path),
        "tail": output[-5:] if proc.returncode else [],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="before,after",
                        help=f"comma-separated, run in this order: {', '.join(VARIANTS)}")
    parser.add_argument("--cold", action="store_true", help="an empty model cache for each variant (GGUF conversion)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between RSS samples")
    parser.add_argument("--out", default="outputs/bench_memory/memory.json")
    args = parser.parse_args(ours)
    if args.child:
        child(args.child, train_args)
        return {}
    train_args = train_args or ["--max_steps", "1", "--eval_tasks", "2"]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    from bench.common import machine, write_json

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "train_args": train_args,
        "variant_settings": {v: {"bounds_disabled": VARIANTS[v][0], "extra_flags": VARIANTS[v][1]} for v in variants},
        "variants": [],
    }
    for variant in variants:
        print(f"[memory] {variant}{' (cold cache)' if args.cold else ''}: train.py {' '.join(train_args)}", flush=True)
        row = run_variant(variant, train_args, args.cold, args.interval, out.parent)
        result["variants"].append(row)
        phases = ", ".join(f"{k} {v['peak_mb']:.0f} MB" for k, v in sorted(row["phases"].items()))
        print(f"[memory] {variant}: peak {row['peak_mb']:.0f} MB in {row['wall_s']:.0f} s (rc {row['returncode']}); {phases}",
              flush=True)
        write_json(out, result)
    result["load_average_after"] = list(os.getloadavg())
    rows = {row["variant"]: row for row in result["variants"]}
    if "before" in rows and "after" in rows:
        before, after = rows["before"], rows["after"]
        result["peak_before_over_after"] = round(before["peak_mb"] / max(after["peak_mb"], 1e-9), 2)
        result["wall_after_over_before"] = round(after["wall_s"] / max(before["wall_s"], 1e-9), 2)
        result["same_summary"] = before["summary"] == after["summary"]
    write_json(out, result)
    print(json.dumps({k: result[k] for k in result if k != "variants"}, indent=1))
    return result


if __name__ == "__main__":
    main()
