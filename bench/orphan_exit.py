"""Seconds from a SIGKILLed trainer to the exit of its process-backend env workers.

    python -m bench.orphan_exit                # 10 kills, workers of a light main module
    python -m bench.orphan_exit --heavy        # workers that imported torch, transformers and trl
    python -m bench.orphan_exit --quick        # 2 kills

Each trial starts the script of `tests/envs/test_vector.py::test_process_workers_exit_when_the_trainer_is_sigkilled`
(a VectorEnv of 2 process workers: one busy in a hung env, one idle), SIGKILLs it, and times until
both workers have exited (a zombie counts as exited: only its reaping is missing). Prints each
time and the load average; the bound docs/RELIABILITY.md promises is the test's `ORPHAN_EXIT_SECONDS`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_kill(script: Path) -> float:
    """Seconds from the SIGKILL of `script`'s process to the exit of both its workers."""
    from tests.envs.test_vector import _alive

    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))  # fmt: skip
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)  # the hung env is inside its step
    proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 60:
        time.sleep(0.01)
    if any(_alive(pid) for pid in pids):
        raise RuntimeError(f"workers {pids} outlived their SIGKILLed parent by 60 s")
    return time.monotonic() - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--heavy", action="store_true", help="the main module imports torch, transformers and trl")
    parser.add_argument("--quick", action="store_true", help="2 trials")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.envs.test_vector import ORPHAN_SCRIPT

    text = ORPHAN_SCRIPT.format(root=str(ROOT))
    if args.heavy:  # spawned workers import the trainer's main module, and with it these
        text = text.replace("import sys, time", "import sys, time\nimport torch, transformers, trl")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "orphans.py"
        script.write_text(text)
        times = sorted(one_kill(script) for _ in range(2 if args.quick else args.trials))
    print(f"{'heavy' if args.heavy else 'light'} workers, load {os.getloadavg()[0]:.1f}: "
          f"exited {' '.join(f'{t:.2f}' for t in times)} s after the SIGKILL (max {times[-1]:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
