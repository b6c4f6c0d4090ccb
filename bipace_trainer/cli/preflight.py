"""Mistakes train.py can know before any model loads, each refused in one line naming the setting and the fix.

`check_launch(argv)` runs before the arguments are parsed (parsing a multi-process run starts its
process group): what the launcher set up (processes against devices, mixed precision on a CPU)
and what the recipe file says. `check_run(...)` runs after parsing, before the output folder and
the weights: sizes, optional dependencies, rollouts that cannot run under sharded parameters, and
`push_to_hub`'s token and network. Each raises `ConfigError`; train.py prints it once (rank 0) as
`train.py: error: ...` and every rank exits with code 2. The settings the dataclasses refuse
themselves (BiPACEConfig's `__post_init__`: sizes, env names and extras, estimator fields) take
the same path. docs/tutorials/scaling.md lists the launch configs these messages point to.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import yaml

CPU_CONFIG = "accelerate_config_cpu.yaml"
ZERO2_CONFIG = "accelerate_config.yaml"


class ConfigError(ValueError):
    """A setting that cannot work, found before any weights load: train.py prints the message
    (field, value, fix) as one line and exits with code 2, without a traceback."""


def is_main_rank() -> bool:
    """Rank 0 of a launched run, or a run without a launcher: the one process that prints a refusal."""
    return os.environ.get("RANK", "0") == "0"


def _true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def deepspeed_on_cpu() -> bool:
    """Launched with DeepSpeed on a machine without a GPU (accelerate_config_cpu.yaml): transformers must be told
    use_cpu, or it sets up one process, not the launcher's world, and DeepSpeed refuses its batch size."""
    return _true("ACCELERATE_USE_DEEPSPEED") and not _cuda_devices()


def check_launch(argv: list[str]) -> None:
    """Before parsing: the recipe file's keys, DeepSpeed's presence, processes against devices, mixed precision."""
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    values = _recipe_values(recipe) if recipe else {}
    if "env" in values and not isinstance(values["env"], dict):
        raise ConfigError(
            f"env: {values['env']!r} in {recipe}: TRL reads a recipe's `env:` as environment variables to set (a "
            f"mapping); write `env_name: {values['env']}` for the environment to train on."
        )
    if ("--deepspeed" in argv or values.get("deepspeed")) and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError('deepspeed is set but DeepSpeed is not installed: pip install -e ".[deepspeed]", or drop it.')
    _check_processes()
    _check_mixed_precision(argv, values)


def _recipe_values(recipe: str) -> dict:
    """The recipe's top-level keys, or {} when it cannot be read (TrlParser then says why, as before)."""
    try:
        values = yaml.safe_load(Path(recipe).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return values if isinstance(values, dict) else {}


def _check_processes() -> None:
    """More processes on this machine than devices (GPUs, or CPU cores on a machine without one)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    gpus = 0 if _true("ACCELERATE_USE_CPU") else _cuda_devices()
    if gpus:
        devices, what = gpus, f"{gpus} GPU{'s' * (gpus > 1)}"
    else:
        devices = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        what = f"{devices} CPU core{'s' * (devices > 1)} and no GPU"
    if local > devices:
        fix = f"`accelerate launch --num_processes {devices}`" + (
            f" (or --config_file {CPU_CONFIG}, 2 processes)" if not gpus else "")
        raise ConfigError(
            f"num_processes={local}: the launcher started {local} processes on a machine with {what}; "
            f"launch one per device: {fix}."
        )


def _check_mixed_precision(argv: list[str], values: dict) -> None:
    """DeepSpeed takes bf16/fp16 from the accelerate config, train.py from its own `bf16`, which is False on a
    machine without a GPU unless asked: DeepSpeed then refuses the pair after every rank has loaded the model."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("bf16", "fp16") or not _true("ACCELERATE_USE_DEEPSPEED") or _cuda_devices():
        return
    given = _last_flag(argv, f"--{precision}")
    asked = str(given if given is not None else values.get(precision, "")).lower() in ("true", "1", "yes")
    if not asked:  # asked: BiPACEConfig checks bf16 on a CPU itself (it needs --use_cpu true)
        raise ConfigError(
            f"mixed_precision={precision} (the accelerate config's) asks DeepSpeed for {precision} on a machine without a "
            f"GPU, where train.py trains in float32 ({precision}=False): launch with --config_file {CPU_CONFIG} "
            f"(float32), or add --mixed_precision no to `accelerate launch` (or --{precision} true --use_cpu true to train.py)."
        )


def _last_flag(argv: list[str], name: str) -> str | None:
    """The value of the last `name` in argv (`--name v`, `--name=v`, or a bare `--name`: 'true'), else None."""
    value = None
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        if flag == name:
            following = argv[i + 1] if i + 1 < len(argv) else ""
            value = inline if eq else ("true" if following.startswith("--") or not following else following)
    return value


def check_run(training_args, model_args) -> None:
    """After parsing, before the output folder and the weights: dependencies, sharding, push_to_hub."""
    if training_args.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            'use_vllm=True but vLLM is not installed: pip install -e ".[vllm]" (a GPU; on a CPU see '
            "tests/vllm/make_venv.sh), or drop --use_vllm to generate with transformers."
        )
    sharded = sharded_parameters(training_args)
    if sharded and training_args.rollout_mode == "continuous":
        raise ConfigError(
            f"rollout_mode='continuous' cannot run under {sharded}: every rank must run each forward together "
            f"there, and continuous ranks generate at their own pace; set --rollout_mode lockstep, or launch "
            f"with ZeRO-2 ({ZERO2_CONFIG})."
        )
    if sharded and training_args.max_staleness:
        raise ConfigError(
            f"max_staleness={training_args.max_staleness} cannot run under {sharded}: the background rollout's "
            "forwards would gather parameters beside the update's; set --max_staleness 0, or launch with ZeRO-2 "
            f"({ZERO2_CONFIG})."
        )
    if training_args.push_to_hub:
        check_hub_access(training_args.hub_model_id or Path(training_args.output_dir).name)


def sharded_parameters(training_args) -> str | None:
    """'ZeRO-3' or 'FSDP' when parameters are sharded across ranks (from the launcher or the arguments), else None."""
    if _true("ACCELERATE_USE_FSDP") or getattr(training_args, "fsdp", None):
        return "FSDP"
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or training_args.deepspeed
    if stage is None and ds_file:
        try:
            ds = ds_file if isinstance(ds_file, dict) else json.loads(Path(ds_file).read_text())
            stage = str(ds.get("zero_optimization", {}).get("stage", ""))
        except (OSError, ValueError, AttributeError):
            stage = None  # DeepSpeed reads its own file and says what is wrong with it
    return "ZeRO-3" if stage == "3" else None


def check_hub_access(repo: str) -> None:
    """A token and a reachable Hub before training, not an 80-line ConnectError after it."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"push_to_hub=True but HF_HUB_OFFLINE is set: unset it to push to {repo}, or drop --push_to_hub "
            "(the model is saved in output_dir either way)."
        )
    if not get_token():
        raise ConfigError(
            f"push_to_hub=True needs a Hugging Face token to push to {repo} and none is set: run `hf auth login` "
            "(or set HF_TOKEN to a write token), or drop --push_to_hub."
        )
    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as err:
        raise ConfigError(
            f"push_to_hub=True but {host}:{port} cannot be reached ({type(err).__name__}: {err}): connect to the "
            "network (or set HF_ENDPOINT to your Hub), or drop --push_to_hub and push the saved output_dir later "
            "with `hf upload`."
        ) from None
    _check_token(host)


def _check_token(host: str) -> None:
    """The Hub knows the token (the trainer creates the repo when it starts, after the model loaded)."""
    from huggingface_hub import whoami
    from huggingface_hub.errors import HfHubHTTPError

    try:
        whoami()
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status in (401, 403):
            raise ConfigError(
                f"push_to_hub=True but {host} refuses the Hugging Face token (HTTP {status}): run `hf auth login` "
                "with a write token (or set HF_TOKEN), or drop --push_to_hub."
            ) from None
        raise ConfigError(
            f"push_to_hub=True but {host} answered HTTP {status} to a token check: try again later, or drop "
            "--push_to_hub and push the saved output_dir later with `hf upload`."
        ) from None
    except Exception as err:  # noqa: BLE001 - a timeout, a proxy, TLS: the Hub cannot be used from here
        raise ConfigError(
            f"push_to_hub=True but the token check at {host} failed ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}): fix the network (or HF_ENDPOINT), or drop --push_to_hub."
        ) from None
