"""Shared fixtures (the tiny policy, warm-started once per run) and how the suite is scheduled.

The suite runs on pytest-xdist workers (`addopts` in pyproject.toml: `-n auto --dist loadfile`), one per
CPU up to 4, each test file on one worker, so its module fixtures (a trained job, a started server)
are built once. `-n 0` runs it in this one process, as before. Three things keep the wall time down:

- the files that run for minutes go out first (`LONG_FILES`), so no worker picks one up at the end
  while the others sit idle; tests/test_layout.py checks that each name still names a file;
- vLLM's CPU venv (tests/vllm/make_venv.sh, ~6 minutes of pip on a fresh machine) starts building in
  the background as soon as the selection holds a vLLM test, while the workers run others; its tests
  wait on the script's lock for it;
- the warm-started tiny policies are trained once per run, not once per worker (tests/shared_builds.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 10x faster for tiny models on 2 shared cores

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bipace_trainer.models import load_tokenizer  # noqa: E402

from tests.shared_builds import built_once  # noqa: E402
from tests.trainer.tiny_setup import make_model, make_tokenizer, warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The files that run longest (`pytest --durations`, 2026-12-04), longest first, scheduled before all others.
LONG_FILES = (
    "tests/vllm/test_vllm_engine.py",
    "tests/reliability/test_interruption.py",
    "tests/trainer/test_distributed_overlap.py",
    "tests/trainer/test_distributed.py",
    "tests/vllm/test_vllm_server_stream.py",
    "tests/vllm/test_vllm_backend.py",
)
VLLM_TESTS = "tests/vllm/"
_VENV_BUILD = "vllm-venv-build.pid"


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use, at most 4 (the slow tests start processes of their own)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _relative(item) -> str:
    return Path(str(item.path)).relative_to(ROOT).as_posix()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(_relative(item), len(LONG_FILES)))  # stable: the rest keep their order


def _run_dir(config) -> Path:
    """A folder of this run that the controller and every worker see (the workers' base temps' parent)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def pytest_collection_finish(session):
    """Start building vLLM's venv now if a selected test needs it (one process does, gw0 under xdist)."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or session.config.option.collectonly:
        return
    if not any(_relative(item).startswith(VLLM_TESTS) for item in session.items):
        return
    log = open(_run_dir(session.config) / "vllm-venv-build.log", "w")
    build = subprocess.Popen(
        ["bash", str(ROOT / "tests" / "vllm" / "make_venv.sh")], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    (_run_dir(session.config) / _VENV_BUILD).write_text(str(build.pid))


def pytest_sessionfinish(session, exitstatus):
    """The process that owns the run (the controller under xdist) stops a build the run left going."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    pid_file = _run_dir(session.config) / _VENV_BUILD
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    pid_file.unlink()
    try:
        os.killpg(pid, signal.SIGTERM)  # its own session: the script and its pip
    except ProcessLookupError:
        pass  # it finished


@pytest.fixture(scope="session")
def warm_policy_dir(tmp_path_factory):
    """Directory of the tiny model after a format warm start on random-move demonstrations."""

    def build(root: Path) -> None:
        tokenizer = make_tokenizer()
        model = warm_start(make_model(tokenizer), tokenizer, str(root / "sft"))
        model.save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")

    return built_once(tmp_path_factory, "warm_policy", build) / "model"


@pytest.fixture(scope="session")
def raw_tiny_dir(tmp_path_factory):
    """Directory of the tiny model as initialised: it never writes the reply format."""

    def build(root: Path) -> None:
        tokenizer = make_tokenizer()
        make_model(tokenizer).save_pretrained(root)
        tokenizer.save_pretrained(root)

    return built_once(tmp_path_factory, "raw_tiny", build)


@pytest.fixture
def warm_policy(warm_policy_dir):
    """(model, tokenizer), a fresh copy of the warm-started tiny policy."""
    return AutoModelForCausalLM.from_pretrained(warm_policy_dir), load_tokenizer(warm_policy_dir)
