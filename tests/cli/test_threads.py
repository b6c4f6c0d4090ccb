"""The command lines choose how torch's threads wait before torch loads, say so in their first line,
and leave a user's OMP_NUM_THREADS / OMP_WAIT_POLICY alone (bipace_trainer/cli/threads.py; the
speed it buys on shared cores: `python -m bench.threads`, docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
BASE.update(PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
# what libgomp itself was told: its OMP_DISPLAY_ENV report, printed when torch loads it
PROBE = (
    "import os, sys; import bipace_trainer.cli; from bipace_trainer.cli import threads; import torch; "
    "torch.ones(64, 64) @ torch.ones(64, 64); print(os.environ.get('OMP_WAIT_POLICY')); print(threads.describe())"
)


def probe(**env: str) -> tuple[str, str, str]:
    """(OMP_WAIT_POLICY after the import, the first line the run would print, libgomp's own report)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**BASE, "OMP_DISPLAY_ENV": "TRUE", **env},
                          capture_output=True, text=True, timeout=300, check=True)
    policy, line = proc.stdout.strip().splitlines()[-2:]
    return policy, line, proc.stderr + proc.stdout


def test_with_nothing_set_waiting_threads_sleep_and_libgomp_reads_it():
    policy, line, gomp = probe()
    assert policy == "PASSIVE"
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in gomp, gomp[-2000:]  # set before libgomp loaded, so it took effect
    assert line.startswith("threads: torch uses") and "OMP_WAIT_POLICY=PASSIVE" in line and "too late" not in line


@pytest.mark.parametrize("given", [{"OMP_NUM_THREADS": "1"}, {"OMP_WAIT_POLICY": "ACTIVE"},
                                   {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"}])
def test_a_users_omp_variables_win(given):
    policy, line, gomp = probe(**given)
    assert policy == given.get("OMP_WAIT_POLICY", "None")
    if "OMP_WAIT_POLICY" in given:  # (with one thread and no policy libgomp reports PASSIVE itself)
        assert gomp.split("OMP_WAIT_POLICY = ")[1].splitlines()[0] == f"'{given['OMP_WAIT_POLICY'].upper()}'"
    assert all(f"{name}={value}" in line for name, value in given.items()) and "nothing changed" in line


@pytest.mark.parametrize("value", ["0", "abc", "-3"])
def test_an_invalid_omp_num_threads_is_named_as_invalid_and_the_default_setup_is_used(value):
    """libgomp ignores such a value and runs its default, spinning threads: before, the first line called it
    the user's choice and set nothing."""
    policy, line, gomp = probe(OMP_NUM_THREADS=value, OMP_DISPLAY_ENV="VERBOSE")
    # libgomp shows PASSIVE for an unset policy too; its spin count tells: 300000 spins unset, 0 under PASSIVE
    assert policy == "PASSIVE" and "GOMP_SPINCOUNT = '0'" in gomp and "Invalid value" not in gomp, gomp[-2000:]
    assert line.startswith(f"threads: OMP_NUM_THREADS={value!r} is invalid (libgomp ignores it), so it is not used; ")
    assert "OMP_WAIT_POLICY=PASSIVE" in line and "from the environment says" not in line


def test_an_empty_omp_num_threads_counts_as_unset():
    policy, line, _ = probe(OMP_NUM_THREADS="")
    assert policy == "PASSIVE" and "OMP_WAIT_POLICY=PASSIVE" in line


@pytest.mark.slow  # starts train.py
def test_train_py_says_its_thread_setup_in_its_first_line():
    proc = subprocess.run([sys.executable, "train.py", "--env", "tiny", "--max_turns", "0"], cwd=ROOT, env=BASE,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("threads: torch uses") and "OMP_WAIT_POLICY=PASSIVE" in first, proc.stdout[:2000]
