"""Session artefacts built once per test run, however many pytest-xdist workers ask for them.

Without xdist a session fixture runs once per process. With `-n 2` each worker is a process of its
own, so the tiny policy's warm start (~1 minute of SFT) would run on each. `built_once` builds the
artefact into a folder every worker of the run shares (beside the workers' own base temp folders),
under a file lock: the first worker to ask builds it, the others wait and reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` after `build(folder)` has run once in this test run (once per worker pool)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        root = tmp_path_factory.mktemp(name)
        build(root)
        return root
    # Each worker's base temp is <run>/popen-gwN: their parent is the run's, shared by all workers.
    shared = tmp_path_factory.getbasetemp().parent / "shared"
    shared.mkdir(exist_ok=True)
    root, done = shared / name, shared / f"{name}.built"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way left it
            root.mkdir()
            build(root)
            done.touch()
    return root
