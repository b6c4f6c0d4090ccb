"""torch's CPU threads on a shared machine: one `generate` call timed per thread setup, idle and beside
a busy process, side by side (docs/performance.md, "Threads on a shared machine").

    python -m bench.threads              # 3 rounds of every setup, idle and loaded
    python -m bench.threads --quick      # 1 round, 8 new tokens (CI size)

The call is the main job's evaluation shape: the embedded SmolLM2-135M-Instruct generating for
4 rows of a ~320-token prompt, 40 new tokens each (greedy, every row to its full length). Setups:

- `default`: torch as it loads with no OMP variable (one thread per core, OpenMP's spinning wait);
- `one_thread`: OMP_NUM_THREADS=1, what the README used to tell users to type;
- `train.py`: what `bipace_trainer.cli` chooses when the user sets nothing (bipace_trainer/cli/threads.py).

"loaded" runs a busy Python loop (`while True: pass`), started here and pinned to core 0, for the
whole measurement, as another job on the machine would be; it is ended by its PID. Each setup
runs in its own process (libgomp reads its variables once, when torch loads), the setups
alternate within each round, and the median of the rounds is printed with its ratio to
`train.py`'s. `--out FILE` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPS = {"default": {}, "one_thread": {"OMP_NUM_THREADS": "1"}, "train.py": {}}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def child(via_cli: bool, new_tokens: int) -> None:
    """One measurement in this process: prints JSON {seconds, threads, policy}."""
    if via_cli:
        import bipace_trainer.cli  # noqa: F401 - chooses the thread setup before torch loads, as train.py does
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bipace_trainer.models import embedded_model_path

    path = str(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a drawer 2. " * 14
    ids = tokenizer([text] * 4, return_tensors="pt", truncation=True, max_length=320)
    kwargs = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        model.generate(**ids, **{**kwargs, "min_new_tokens": 2, "max_new_tokens": 2})  # first-call setup, not timed
        start = time.perf_counter()
        model.generate(**ids, **kwargs)
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads(),
                      "policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "prompt_tokens": ids["input_ids"].shape[1]}))


def measure(setup: str, new_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(SETUPS[setup], PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "bench.threads", "--child", "--new_tokens", str(new_tokens)]
    if setup == "train.py":
        cmd.append("--via_cli")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_load() -> subprocess.Popen:
    """A busy loop pinned to core 0: another program holding one core."""
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(load.pid, {sorted(os.sched_getaffinity(0))[0]})
    return load


def run(rounds: int, new_tokens: int) -> dict:
    results: dict = {f"{setup} {state}": [] for state in ("idle", "loaded") for setup in SETUPS}
    info: dict = {}
    for _ in range(rounds):
        for state in ("idle", "loaded"):
            load = start_load() if state == "loaded" else None
            try:
                for setup in SETUPS:
                    row = measure(setup, new_tokens)
                    results[f"{setup} {state}"].append(row["seconds"])
                    info[setup] = {"threads": row["threads"], "OMP_WAIT_POLICY": row["policy"]}
            finally:
                if load is not None:
                    load.kill()  # by its PID: the one process this script started
                    load.wait()
    return {"seconds": results, "setups": info, "rounds": rounds, "new_tokens": new_tokens,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "machine": platform.processor() or platform.machine()}


def report(data: dict) -> str:
    medians = {key: statistics.median(values) for key, values in data["seconds"].items()}
    lines = [f"generate, 4 rows x ~320-token prompt + {data['new_tokens']} new tokens, SmolLM2-135M, "
             f"{data['cores']} cores, median of {data['rounds']} round(s); ratio = seconds / train.py's in the same state"]
    for state in ("idle", "loaded"):
        ours = medians[f"train.py {state}"]
        for setup, info in data["setups"].items():
            seconds = medians[f"{setup} {state}"]
            lines.append(f"  {state:6s} {setup:10s} threads={info['threads']} OMP_WAIT_POLICY={info['OMP_WAIT_POLICY']:8s} "
                         f"{seconds:6.2f} s  ratio {seconds / ours:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="1 round, 8 new tokens")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--via_cli", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.via_cli, args.new_tokens)
    if args.quick:
        args.rounds, args.new_tokens = 1, 8
    data = run(args.rounds, args.new_tokens)
    print(report(data))
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
