"""Mistakes train.py can know before any model loads, each refused in one line naming the setting and the fix.

`check_launch(argv)` runs before the arguments are parsed (parsing a multi-process run starts its
process group): what the launcher set up (processes against devices, a GPU config's mixed precision
on a machine without one) and what the recipe file says; `check_recipe_types` compares a recipe's
values with the flags' types, and `cpu_precision` decides the precision of a run on a CPU (float32
unless asked, said in one line). `check_run(...)` runs after parsing, before the output folder and
the weights: values TRL takes as given (learning rate, temperature, clip range, KL coefficient),
optional dependencies, rollouts that cannot run under sharded parameters, and `push_to_hub`'s token
and network; `check_output_dir` and `check_checkpoint` the folder a run writes to and resumes from. Each raises `ConfigError`; train.py prints it once (rank 0) as
`train.py: error: ...` and every rank exits with code 2. The settings the dataclasses refuse
themselves (BiPACEConfig's `__post_init__`: sizes, env names and extras, estimator fields) take
the same path. docs/tutorials/scaling.md lists the launch configs these messages point to.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import yaml

from bipace_trainer import trl_compat

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
    """A launcher's mixed precision (the accelerate config's `mixed_precision`) on a machine without a GPU: a GPU
    config there (accelerate_config_1gpu.yaml) trains under bf16 autocast on the CPU, and DeepSpeed refuses the
    pair after every rank has loaded the model. Asked for in train.py's own flags too (`--bf16 true`), it stands."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("bf16", "fp16") or _cuda_devices():
        return
    if _asked(argv, values, precision):  # the user's choice on this CPU: BiPACEConfig checks it (it needs --use_cpu true)
        return
    raise ConfigError(
        f"mixed_precision={precision} (the accelerate config's) is a GPU config's, and this machine has no GPU: launch "
        f"with --config_file {CPU_CONFIG} (float32 on the CPU), or run python train.py, or add --mixed_precision no to "
        "`accelerate launch`."
    )


def _asked(argv: list[str], values: dict, name: str) -> bool:
    """Whether the user set the boolean `name` true, by flag or recipe key."""
    given = _last_flag(argv, f"--{name}")
    return str(given if given is not None else values.get(name, "")).lower() in ("true", "1", "yes")


def trains_on_cpu(argv: list[str], values: dict) -> bool:
    """The run trains on the CPU: no CUDA GPU here, or --use_cpu (flag, recipe key, or the launcher's)."""
    return not _cuda_devices() or _true("ACCELERATE_USE_CPU") or _asked(argv, values, "use_cpu")


def cpu_precision(argv: list[str], values: dict) -> str | None:
    """On the CPU, the precision train.py decides itself (whatever `bf16` defaults to in the config): float32,
    unless the user asked for bf16 or fp16. Returns the line that says so, or None (a GPU, or the user chose)."""
    if not trains_on_cpu(argv, values) or any(f"--{name}" in argv or name in values for name in ("bf16", "fp16")):
        return None
    return ("precision: float32 (training on the CPU; bf16 autocast there is slower on most CPUs and drifts from "
            "float32 log-probs: --bf16 true --use_cpu true asks for it).")


def recipe_values(recipe: str | None) -> dict:
    """A recipe's top-level keys (`--config`), or {} without one or when it cannot be read (TrlParser says why)."""
    return _recipe_values(recipe) if recipe else {}


def check_recipe_types(parser, values: dict, recipe: str) -> None:
    """A recipe's value of a type its field cannot take (a list for a float, a float for an int, a mapping
    for a name): TrlParser hands YAML's non-string values to the config unconverted, where they fail after
    the model loads. Strings are converted and checked by argparse itself, as flags are."""
    fields = {}  # name -> annotation as written (HfArgumentParser rewrites the fields' own `type` to the flag's)
    for kind in parser.dataclass_types:
        for klass in reversed(kind.__mro__):
            fields.update({name: str(hint) for name, hint in vars(klass).get("__annotations__", {}).items()})
    actions = {action.dest: action for action in parser._actions}
    for key, value in values.items():
        action = actions.get(key)
        if action is None or value is None or isinstance(value, str) or action.type is None:
            continue
        problem = _type_problem(action, value, fields.get(key, ""))
        if problem:
            raise ConfigError(f"{key}: {value!r} in {recipe} is {problem}; write it as the flag --{key} takes it.")


def _type_problem(action, value, annotation: str) -> str | None:
    """What is wrong with YAML `value` for the flag `action` of a field annotated `annotation`, or None."""
    wanted = _type_name(action.type)
    if isinstance(value, dict):
        return None if "dict" in annotation else f"a mapping, for a {wanted}"
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int) or "list" in annotation
    if isinstance(value, list) and not many:
        return f"a list, for a single {wanted}"
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, (dict, list)):
            return f"a nested {'mapping' if isinstance(item, dict) else 'list'}, for a list of {wanted}s"
        if action.type in (int, float) and isinstance(item, bool):
            return f"a boolean, for a {wanted}"
        if action.type is int and isinstance(item, float):
            return "a float, for a whole number"
        try:
            action.type(str(item))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            return f"not a {wanted}"
    return None


def _type_name(kind) -> str:
    return {int: "whole number", float: "number", str: "name"}.get(kind, "true/false" if "bool" in str(kind) else "value")


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
    """After parsing, before the output folder and the weights: values, dependencies, sharding, push_to_hub."""
    check_training_values(training_args)
    try:  # every private name of TRL, transformers (vLLM) the package borrows is installed, before the weights
        trl_compat.verify_ledger(training_args.use_vllm and importlib.util.find_spec("vllm") is not None)
    except trl_compat.LedgerError as error:
        raise ConfigError(str(error)) from None
    from bipace_trainer.rollout.collector import check_env_tasks  # datasets, accelerate: past --help
    from envs.base import EnvUnavailableError

    try:  # the env's splits list tasks: env I/O, done here (and by the trainer), not when the config is built
        training_args.require_env()
        check_env_tasks(training_args.env_name, training_args.env_kwargs,
                        {"train_split": training_args.train_split, "eval_split": training_args.eval_split})
    except (ValueError, EnvUnavailableError) as error:
        raise ConfigError(str(error)) from None
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


def check_training_values(training_args) -> None:
    """Values GRPOConfig and TRL take as given, which fail after the model loads (a negative learning rate:
    torch's error at the optimizer; temperature 0: a traceback from the first rollout) or train silently
    wrong (a negative clip range clips every token; a negative KL coefficient rewards drifting away)."""
    args = training_args
    checks = (
        (args.learning_rate >= 0, "learning_rate", "must be >= 0 (the optimizer's step size: the papers use 1e-6, "
         "the main job's LoRA 5e-4)"),
        (args.temperature > 0, "temperature", "must be > 0: at 0 sampling is greedy decoding, every rollout of a task "
         "plays the same episode and no group-relative advantage is non-zero (transformers' sampling refuses it too); "
         "train at e.g. 0.7 (the main job's) or 1.0 (TRL's), and decode greedily in evaluation with --eval_temperature 0 "
         "(bipace-eval --temperature 0)"),
        (args.epsilon > 0, "epsilon", "must be > 0: PPO's clip range around ratio 1 (TRL's default 0.2); at 0 or "
         "below every token's ratio is clipped and no gradient flows"),
        (args.epsilon_high is None or args.epsilon_high > 0, "epsilon_high", "must be > 0 (the upper clip range; "
         "unset: epsilon)"),
        (args.beta >= 0, "beta", "must be >= 0: the KL penalty's coefficient (0: no KL term and no reference model; "
         "the papers use 0.01); below 0 it rewards moving away from the reference"),
    )
    for ok, name, message in checks:
        if not ok:
            raise ConfigError(f"{name}={getattr(args, name)!r} {message}.")


def check_output_dir(output_dir: str) -> None:
    """`output_dir` is a folder this process can write in (made here if missing): not a file, not under a
    file, not on a read-only or full file system."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} is a file, not a folder: pass a folder to --output_dir "
                          "(it is made if missing).")
    under = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if under is not None:
        raise ConfigError(f"output_dir={output_dir!r} lies under the file {str(under)!r}: pass a folder path to "
                          "--output_dir whose parents are folders.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".bipace-write-check.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir={output_dir!r} cannot be written ({err.strerror or type(err).__name__}): "
                          "pass a folder you can write to with --output_dir.") from None


def check_checkpoint(checkpoint: str) -> None:
    """`--resume_from_checkpoint PATH` names a complete checkpoint (every checkpoint-N holds trainer_state.json)."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"resume_from_checkpoint={checkpoint!r} is not a folder; give a checkpoint-N folder, or true.")
    if not (folder / "trainer_state.json").is_file():
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint!r} holds no complete checkpoint (no trainer_state.json, which every "
            "saved checkpoint-N has): give a complete one, or true (the newest complete one in --output_dir)."
        )


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
