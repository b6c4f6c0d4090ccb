"""Evaluate a model the way the papers do: fixed task panels, fixed seeds, intervals, paired comparisons.

    bipace-eval Qwen/Qwen2.5-1.5B-Instruct --env alfworld                    # a Hub id
    bipace-eval outputs/my-run --env textcraft --split valid                 # a run's output dir / adapter / checkpoint
    bipace-eval warm_starts/smollm2-135m-textcraft outputs/my-run --env textcraft   # two models: paired difference
    accelerate launch --num_processes 4 -m bipace_trainer.cli.evaluate MODEL --env webshop --use_vllm

A run's output dir (or a checkpoint in it) is evaluated as the run evaluated itself: its
saved evaluation settings (`eval_results.json`'s `settings`, else a checkpoint's config: env,
env_kwargs, split, turns, history, reply length, temperature, tasks, the sampling seed, prompts
per generate call and the generation fields of `evaluation.REPLAYED_FIELDS`) are the defaults.
So `bipace-eval OUTPUT_DIR` plays the run's final evaluation again: the same tasks, on the run's
seed, in one chunk, and prints the summary's held-out line next to its own (the same number, on
the same hardware and number of processes, with transformers' generate; vLLM samples on its own).
`--seeds 123 456 789` plays more seeds (the first lines say which are played); each flag wins.
Without saved settings, the env's protocol applies.

Protocol (`PROTOCOLS`, each value overridable by its flag): the papers validate at temperature
0.4 with seeds 123, 456 and 789 (docs/concepts/math.md#paper-setups); ALFWorld on `valid_seen` and `valid_unseen` (the
official games when `alfworld-download` put them where `envs.alfworld` looks, else the generated
ones) at 50 turns; WebShop on its `test` goals at 15 turns; TextCraft on its held-out goals
(`test_ood`, the recipes' evaluation split) at 30 turns; history window 2. Every task of a split
is played once per seed (`--tasks N`: N tasks stratified over task types; `--episodes_per_task`).

A model is anything `BiPACETrainer` takes (a Hub id, a local model, "embedded"), a LoRA adapter
folder (its base from `adapter_config.json`, or `--base_model`), a training checkpoint
(`checkpoint-N/`), or a run's output directory (its final model, else its newest checkpoint).
No trainer and no training config are built: the model is loaded as a plain model and played through a
`Policy` (`rollout.policy.ModelPolicy`, or `VLLMPolicy`), on the rollout's values built from the flags
(`eval_values`: `RolloutSettings`, `EnvSpec`), by the evaluation every training run uses
(`evaluation.play_evaluation`; each rank plays a slice, results are gathered), in chunks of
`--chunk_size` episodes; a finished chunk is appended to `<output_dir>/<label>/episodes.jsonl` at
once, and a rerun with the same settings skips the chunks it finds there (an interrupted run
resumes, replaying only the unfinished chunk). Each chunk samples under its own seed
(`chunk_seed`), so a resumed run plays what an uninterrupted one would on the same hardware.

`--use_vllm` generates with TRL's vLLM path (colocate by default; `--vllm_mode server` and
`--vllm_server_base_url` for a running `trl vllm-serve`). A colocated engine runs in this
process, so each chunk's seed drives its sampling too (a resumed chunk replays exactly; checked
with vLLM's CPU build by tests/vllm/test_vllm_engine.py); a server samples with its own RNG.
Each model and its engine are freed before the next model's are built.

Results go into `--output_dir`: by default a run's own folder, `<run>/bipace_eval/`, when a model is
a run's output dir or a checkpoint in one (so `bipace-report RUN_DIR` shows them next to the run's
evaluations), else `outputs/bipace_eval`. Success rate (and WebShop's score) overall and per task type, each with its 95% Wilson
interval over the episodes of all seeds and its spread over seeds (mean ± sd of the per-seed
rates); with two models, the paired difference on the same (task, seed) episodes with a 95%
interval (normal approximation over tasks, each task's difference averaged over its seeds and
repeats first: episodes of one task are not independent). Written to
`<output_dir>/bipace_eval.json` and `bipace_eval.md`; the episodes' turns are in
`<output_dir>/<label>/rollouts/` for `bipace-report`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "PROTOCOLS",
    "Protocol",
    "protocol_for",
    "run_settings",
    "resolve_model",
    "chunk_seed",
    "evaluate_model",
    "summarise_model",
    "paired_difference",
    "markdown_report",
    "run",
    "main",
]

RESULT_FILE = "bipace_eval.json"
DEFAULT_OUTPUT_DIR = "outputs/bipace_eval"  # for a model that is not a run's (a Hub id, an adapter elsewhere)
RUN_EVAL_DIR = "bipace_eval"  # inside a run's output dir: where `bipace-report` looks for these results
MARKDOWN_FILE = "bipace_eval.md"
EPISODES_FILE = "episodes.jsonl"
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Protocol:
    """An env's evaluation protocol; every field is a `bipace-eval` flag of the same name."""

    splits: tuple[str, ...]
    max_turns: int
    temperature: float = 0.4
    seeds: tuple[int, ...] = (123, 456, 789)
    history_length: int = 2
    max_completion_length: int = 512
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # where the numbers come from


# The papers' validation settings (docs/concepts/math.md#paper-setups, and the recipes under recipes/, which cite them).
PROTOCOLS: dict[str, Protocol] = {
    "alfworld": Protocol(("valid_seen", "valid_unseen"), 50, source="GiGPO/BiPACE: ALFWorld valid splits, <= 50 steps"),
    "webshop": Protocol(("test",), 15, source="GiGPO/BiPACE: WebShop test goals, <= 15 steps"),
    "textcraft": Protocol(("test_ood",), 30, source="BiPACE: TextCraft held-out goals (recipes/textcraft_*.yaml)"),
}
DEFAULT_PROTOCOL = Protocol(("valid",), 30, source="project default for envs without a published protocol")


def protocol_for(env_name: str) -> Protocol:
    """The env's protocol (`PROTOCOLS`), or `DEFAULT_PROTOCOL` with the env's own evaluation split."""
    if env_name in PROTOCOLS:
        return PROTOCOLS[env_name]
    from envs.base import resolve_env_class

    splits = resolve_env_class(env_name).splits()
    split = next((s for s in ("valid", "test") if s in splits), splits[-1])
    return Protocol((split,), DEFAULT_PROTOCOL.max_turns, source=DEFAULT_PROTOCOL.source)


# A checkpoint's config key -> the bipace-eval setting it defaults (`run_settings`)
_CONFIG_SETTINGS = {
    "env_name": "env", "env_kwargs": "env_kwargs", "eval_split": "split", "max_turns": "max_turns",
    "history_length": "history_length", "max_completion_length": "max_completion_length",
    "eval_temperature": "temperature", "eval_tasks": "tasks", "eval_rollouts_per_task": "episodes_per_task",
    "seed": "seed", "rollout_batch_size": "rollout_batch_size",
}  # fmt: skip


def final_evaluation(spec: str) -> dict[str, Any] | None:
    """The run's final evaluation (`eval_results.json`'s last "final" entry) when `spec` is a run's
    output dir (its final model: not a checkpoint's), else None."""
    try:
        history = json.loads((Path(spec) / "eval_results.json").read_text())
    except (OSError, ValueError):
        return None
    finals = [e for e in history if isinstance(e, dict) and e.get("tag") == "final"] if isinstance(history, list) else []
    return finals[-1] if finals else None


def run_settings(specs: Sequence[str]) -> tuple[dict[str, Any], str]:
    """(settings, where they were read) of the first of `specs` that is a run's output dir or a
    checkpoint in one: how the run played its evaluations, in this tool's flag names; ({}, "")
    when none saved any (a Hub id, a plain model folder, a run from before they were recorded)."""
    for spec in specs:
        path = Path(spec)
        if not path.is_dir():
            continue
        run = path.parent if path.name.startswith("checkpoint-") else path
        checkpoints = [path] if run is not path else []
        newest = _newest_checkpoint(run)
        for source in [*checkpoints, run / "eval_results.json", *([newest] if newest else [])]:
            found = _saved_settings(source)
            if found:
                return found, str(source)
    return {}, ""


def run_folder(specs: Sequence[str]) -> Path | None:
    """The output dir of the first of `specs` that is a run's (train.py's record or evaluations in it, or
    its checkpoints), or a checkpoint in one; None when none is."""
    from ..run.run_dir import RUN_FILE

    for spec in specs:
        path = Path(spec)
        run = path.parent if path.name.startswith("checkpoint-") else path
        if run.is_dir() and ((run / RUN_FILE).is_file() or (run / "eval_results.json").is_file() or _newest_checkpoint(run)):
            return run
    return None


def _saved_settings(source: Path) -> dict[str, Any]:
    """The evaluation settings in an `eval_results.json` (its last evaluation's) or a checkpoint
    (`bipace_state.json`: its evaluation history's, else its config's); {} if it holds none."""
    from ..run.run_dir import STATE_FILE

    try:
        saved = json.loads((source / STATE_FILE if source.is_dir() else source).read_text())
    except (OSError, ValueError):
        return {}
    history = saved if isinstance(saved, list) else saved.get("eval_history", []) if isinstance(saved, dict) else []
    played = [e for e in history if isinstance(e, dict) and isinstance(e.get("settings"), dict)]
    if played:
        return {**played[-1]["settings"], "split": played[-1].get("split")}
    config = saved.get("config") if isinstance(saved, dict) else None
    if isinstance(config, dict) and config.get("env_name"):
        return {name: config[key] for key, name in _CONFIG_SETTINGS.items() if key in config}
    return {}


def chunk_seed(seed: int, chunk: int) -> int:
    """The sampling seed of one chunk: `seed` for the first, distinct and fixed for the others."""
    return (seed + 1_000_003 * chunk) % (2**31 - 1)


# ---------------------------------------------------------------------------------------------- models


@dataclass
class ResolvedModel:
    """What to load: `model` (a name/path `BiPACETrainer` takes) and an optional LoRA `adapter` on it."""

    model: str
    adapter: str | None = None
    note: str = ""


def _newest_checkpoint(folder: Path) -> Path | None:
    steps = [(int(p.name.rpartition("-")[2]), p) for p in folder.glob("checkpoint-*") if p.name.rpartition("-")[2].isdigit()]
    return max(steps)[1] if steps else None


def resolve_model(spec: str, base_model: str | None = None) -> ResolvedModel:
    """A Hub id, a local model, "embedded", a LoRA adapter folder, a checkpoint or a run's output dir → what to load.

    An adapter's base is `base_model`, else its `adapter_config.json`'s `base_model_name_or_path`;
    a base recorded as the converted embedded model on another machine is the embedded model here.
    """
    from ..models import embedded_model_path

    path = Path(spec)
    if not path.is_dir():
        return ResolvedModel(spec)  # a Hub id, "embedded", or a typo the loader names
    note = ""
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        newest = _newest_checkpoint(path)
        if newest is None:
            raise ValueError(
                f"model={spec!r} is a folder with no model (config.json), adapter (adapter_config.json) or checkpoint-N/ "
                "in it; pass a model folder, an adapter folder, a checkpoint or a run's --output_dir."
            )
        path, note = newest, f"no final model in {spec}: its newest checkpoint, {newest.name}"
    if (path / "adapter_config.json").is_file():
        base = base_model or json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"adapter {path} names no base model; pass --base_model NAME_OR_PATH.")
        if not base_model and not Path(base).exists() and Path(base).name == embedded_model_path().name:
            base = "embedded"  # converted on another machine: the same weights are converted here
        return ResolvedModel(base, str(path), note)
    return ResolvedModel(str(path), None, note)


def load_policy(resolved: ResolvedModel, trust_remote_code: bool = False, dtype: str = "float32"):
    """(model, tokenizer) of `resolved`: a name or path (or "embedded") loaded in `dtype` as TRL's
    `GRPOTrainer` loads it, or a `PeftModel` on its base loaded in `dtype`; the tokenizer pads on the
    left and agrees with the model on the pad token (TRL's rule)."""
    from trl.trainer.utils import create_model_from_path

    from ..models import load_tokenizer, resolve_model_name

    base = resolve_model_name(resolved.model)
    adapter = resolved.adapter
    tokenizer_source = adapter if adapter and Path(adapter, "tokenizer_config.json").is_file() else base
    tokenizer = load_tokenizer(tokenizer_source, truncation_side="left", padding_side="left",
                               trust_remote_code=trust_remote_code)  # fmt: skip
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = create_model_from_path(base, dtype=dtype, trust_remote_code=trust_remote_code)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def model_label(spec: str, taken: Sequence[str] = ()) -> str:
    """A short, file-safe name for a model (its folder or Hub id), unique among `taken`."""
    name = Path(spec.rstrip("/")).name or spec
    label = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "model"
    candidate, n = label, 2
    while candidate in taken:
        candidate, n = f"{label}-{n}", n + 1
    return candidate


# ---------------------------------------------------------------------------------------------- playing


def run_defaults(names: Sequence[str]) -> dict[str, Any]:
    """`BiPACEConfig`'s declared defaults of `names` (read off its fields, no config built): what a run
    that set none of them samples with."""
    import dataclasses

    from ..config import BiPACEConfig

    fields = {f.name: f for f in dataclasses.fields(BiPACEConfig)}
    return {name: None if fields[name].default is dataclasses.MISSING else fields[name].default for name in names}


def run_values(settings: argparse.Namespace) -> dict[str, Any]:
    """The run's sampling and reply fields (`evaluation.REPLAYED_FIELDS`, recorded with its evaluations, in
    `settings.generation`) over the config's defaults (the base temperature too: `ModelEvaluation.play`
    samples at the evaluation's, `settings.temperature`)."""
    from ..rollout.policy import SAMPLING_FIELDS
    from ..run.evaluation import REPLAYED_FIELDS

    names = tuple(dict.fromkeys((*SAMPLING_FIELDS, *REPLAYED_FIELDS)))
    recorded = {name: settings.generation[name] for name in REPLAYED_FIELDS if name in settings.generation}
    return {**run_defaults(names), **recorded}


def eval_values(settings: argparse.Namespace, output_dir: Path, split: str):
    """(`RolloutSettings`, `EnvSpec`) an evaluation of `split` plays with: the protocol's values (flags, the
    run's), every episode dumped to `output_dir` (one dump per chunk); the rest the rollout's defaults."""
    from ..rollout.loop import EnvSpec, RolloutSettings

    values = run_values(settings)
    rollout = RolloutSettings(
        max_turns=settings.max_turns, history_length=settings.history_length, rollout_batch_size=settings.rollout_batch_size,
        require_think=bool(values["require_think"]), action_key_tokens=values["action_key_tokens"], eval_tasks=0,
        eval_rollouts_per_task=1, disable_tqdm=settings.no_progress, rollout_dump_steps=1, output_dir=str(output_dir),
    )  # fmt: skip
    return rollout, EnvSpec(name=settings.env, kwargs=dict(settings.env_kwargs), train_split=split, eval_split=split)


def generation_backend(settings: argparse.Namespace) -> str:
    """How the replies are generated, as the results record it."""
    if not settings.use_vllm:
        return "transformers"
    if settings.vllm_mode == "server":
        return f"vllm server ({settings.vllm_server_base_url or 'http://0.0.0.0:8000'})"
    return "vllm colocate"


class ModelEvaluation:
    """One model's evaluation, no trainer: a plain model's policy (`ModelPolicy`, or `VLLMPolicy` with
    `--use_vllm`), the env source and a rollout collector, played by `evaluation.play_evaluation`, the
    code every training run evaluates with. `close` stops the envs and frees the model and engine before
    the next model's are built (two colocated engines would each hold `--vllm_gpu_memory_utilization`)."""

    def __init__(self, resolved: ResolvedModel, settings: argparse.Namespace, output_dir: Path, split: str):
        from accelerate import Accelerator

        from ..rollout.collector import RolloutCollector, TextEnvSource

        self.accelerator = Accelerator(cpu=settings.use_cpu)
        model, tokenizer = load_policy(resolved, settings.trust_remote_code, settings.dtype)
        model = model.to(self.accelerator.device).eval()
        self.policy = build_policy(model, tokenizer, settings, self.accelerator)
        rollout, env = eval_values(settings, output_dir, split)
        self.collector = RolloutCollector(self.policy, TextEnvSource(env, rollout), rollout, self.accelerator)
        self.temperature = settings.temperature

    def play(self, panel: list, split: str, tag: str, seed: int) -> dict[str, Any]:
        from ..run.evaluation import play_evaluation

        return play_evaluation(self.collector, panel, temperature=self.temperature, step=0, tag=tag, split=split, seed=seed)

    def close(self) -> None:
        import gc

        import torch

        self.collector.close()
        generation = self.policy.vllm_generation
        if generation is not None and getattr(generation, "llm", None) is not None:
            generation.llm = None
        self.policy = self.collector = None
        self.accelerator.free_memory()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# TRL's vLLM engine settings an evaluation leaves at the config's defaults (no flag for them)
_VLLM_DEFAULTS = (
    "vllm_structured_outputs_regex", "vllm_server_host", "vllm_server_port", "vllm_group_port", "vllm_server_timeout",
    "vllm_tensor_parallel_size", "vllm_enable_sleep_mode", "vllm_model_impl",
)  # fmt: skip
# sequences a colocated engine runs at once: the 2 an evaluation's former training values gave (2 rows x 1 x 1)
_VLLM_MAX_NUM_SEQS = 2


def build_policy(model, tokenizer, settings: argparse.Namespace, accelerator):
    """The policy a plain model evaluates with: HF generate with TRL's generation config, or TRL's
    `VLLMGeneration` (colocate or server) built as `GRPOTrainer` builds it."""
    from ..rollout.policy import ModelPolicy, VLLMPolicy, eos_token_ids_of, generation_config_for

    eos = eos_token_ids_of(model, tokenizer)
    values = run_values(settings)
    reply = values["max_turn_length"] or settings.max_completion_length  # one reply's cap, as in training
    if not settings.use_vllm:
        generation_config = generation_config_for(values, tokenizer, eos, max_new_tokens=reply)
        return ModelPolicy(model, tokenizer, generation_config, reply, eos_token_ids=eos)
    from trl.generation.vllm_generation import VLLMGeneration

    engine = {name.removeprefix("vllm_"): value for name, value in run_defaults(_VLLM_DEFAULTS).items()}
    generation = VLLMGeneration(
        model=model, accelerator=accelerator, processing_class=tokenizer, mode=settings.vllm_mode,
        structured_outputs_regex=engine["structured_outputs_regex"], server_base_url=settings.vllm_server_base_url,
        server_host=engine["server_host"], server_port=engine["server_port"], group_port=engine["group_port"],
        server_timeout=engine["server_timeout"], tensor_parallel_size=engine["tensor_parallel_size"],
        gpu_memory_utilization=settings.vllm_gpu_memory_utilization, max_model_length=settings.vllm_max_model_length,
        max_num_seqs=_VLLM_MAX_NUM_SEQS * engine["tensor_parallel_size"], enable_sleep_mode=engine["enable_sleep_mode"],
        model_impl=engine["model_impl"], trust_remote_code=settings.trust_remote_code,
        repetition_penalty=values["repetition_penalty"], temperature=values["temperature"], top_p=values["top_p"],
        top_k=values["top_k"], min_p=values["min_p"], max_completion_length=reply, logprobs=0,
        generation_kwargs=values["generation_kwargs"],
    )
    return VLLMPolicy(generation, model, tokenizer, reply, eos)


def panel_units(specs: Sequence[Any], episodes_per_task: int) -> list[tuple[Any, int]]:
    """(task spec, repeat) of every episode one seed plays, in a fixed order."""
    return [(spec, repeat) for spec in specs for repeat in range(episodes_per_task)]


def _read_done(path: Path) -> dict[tuple[str, int, int], list[dict[str, Any]]]:
    """{(split, seed, chunk): episodes} of every complete chunk line; a cut last line is ignored (replayed)."""
    done: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[(entry["split"], int(entry["seed"]), int(entry["chunk"]))] = entry["episodes"]
    return done


def _append_line(path: Path, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _episode_result(record: dict[str, Any], unit: tuple[Any, int], reports_score: bool) -> dict[str, Any]:
    spec, repeat = unit
    result = {
        "task_id": record["task_id"], "repeat": repeat, "attributes": record.get("attributes") or spec.attributes,
        "won": bool(record["won"]), "turns": record.get("turns_taken"), "invalid_steps": record.get("invalid_steps"),
        "failed": bool(record.get("failed")), "reward": record.get("reward"),
    }  # fmt: skip
    if reports_score:  # WebShop pays its score at the purchase, the episode's only reward
        result["score"] = float(record.get("score", record.get("reward") or 0.0))
    return result


def evaluate_model(spec: str, settings: argparse.Namespace, label: str, progress=None) -> dict[str, list[dict[str, Any]]]:
    """Play `spec` on every split × seed × chunk of the protocol not already in its episodes file.

    Returns {split: episodes}, each episode {task_id, repeat, seed, attributes, won, turns, ...}.
    Every rank must call it (the evaluation gathers over ranks); the main process writes.
    """
    from envs.base import resolve_env_class, stratified_subset

    from ..rollout.loop import TaskRef
    from ..rollout.trajectories import dump_path

    folder = Path(settings.output_dir) / label
    episodes_file = folder / EPISODES_FILE
    done = _read_done(episodes_file)
    env_class = resolve_env_class(settings.env)
    reports_score = getattr(env_class, "reports_score", False)
    plan = []
    for split in settings.split:
        specs = stratified_subset(env_class.tasks(split, **settings.env_kwargs), settings.tasks, env_class.report_key, "tasks")
        units = panel_units(specs, settings.episodes_per_task)
        size = settings.chunk_size or max(len(units), 1)  # 0: the whole panel in one chunk, as a run plays it
        chunks = [units[i : i + size] for i in range(0, len(units), size)]
        plan += [(split, seed, index, chunk) for seed in settings.seeds for index, chunk in enumerate(chunks)]
    todo = [item for item in plan if item[:3] not in done]
    resolved = resolve_model(spec, settings.base_model)
    if progress:
        progress(f"{label}: {len(plan) - len(todo)} of {len(plan)} chunks already played" if len(todo) < len(plan)
                 else f"{label}: {len(plan)} chunks of {f'<= {settings.chunk_size} episodes' if settings.chunk_size else 'a whole panel'} "
                 "to play")  # fmt: skip
        if resolved.note:
            progress(f"{label}: {resolved.note}")
    evaluation = None
    try:
        for number, (split, seed, index, chunk) in enumerate(todo, 1):
            if evaluation is None:
                evaluation = ModelEvaluation(resolved, settings, folder, split)
            panel = [TaskRef(spec.task_id, group=i, attributes=spec.attributes) for i, (spec, _) in enumerate(chunk)]
            tag = f"{split}-seed{seed}-chunk{index:04d}"
            result = evaluation.play(panel, split, tag, chunk_seed(seed, index))
            if evaluation.accelerator.is_main_process:
                records = match_records(_read_dump(dump_path(folder, 0, "eval", tag)), chunk)
                episodes = [_episode_result(r, unit, reports_score) for r, unit in zip(records, chunk)]
                _append_line(episodes_file, {"split": split, "seed": seed, "chunk": index, "episodes": episodes})
                done[(split, seed, index)] = episodes
                if progress:
                    progress(f"{label}: chunk {number}/{len(todo)} ({split}, seed {seed}): "
                             f"{result['success_rate']:.3f} of {len(chunk)} episodes")  # fmt: skip
    finally:
        if evaluation is not None:
            evaluation.close()
            del evaluation
    by_split: dict[str, list[dict[str, Any]]] = {split: [] for split in settings.split}
    for split, seed, index, _ in plan:
        for episode in done.get((split, seed, index), []):
            by_split[split].append(episode | {"seed": seed})
    return by_split


def _read_dump(path: Path) -> list[dict[str, Any]]:
    from ..reports.show import load_episodes

    return load_episodes(path)


def match_records(records: Sequence[dict[str, Any]], chunk: Sequence[tuple[Any, int]]) -> list[dict[str, Any]]:
    """The dump's episode records in the order of `chunk`'s (task, repeat) units.

    Ranks play interleaved slices of the chunk, so records are matched by task id; the repeats of
    one task go in (rank, episode) order, the same on every run with the same number of processes."""
    by_task: dict[int, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (r.get("rank", 0), r["episode"])):
        by_task.setdefault(int(record["task_id"]), []).append(record)
    ordered = []
    for spec, _ in chunk:
        mine = by_task.get(int(spec.task_id))
        if not mine:
            raise RuntimeError(f"the evaluation dump holds no episode of task {spec.task_id}; was it cut short?")
        ordered.append(mine.pop(0))
    return ordered


# ---------------------------------------------------------------------------------------------- statistics


def wilson(successes: int, n: int) -> list[float] | None:
    from ..reports.run_summary import wilson_interval

    return list(wilson_interval(successes, n)) if n else None


def _rates(episodes: Sequence[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Success (k of n, 95% Wilson interval), the per-seed rates with their mean and sd, and the mean score."""
    n = len(episodes)
    won = sum(e["won"] for e in episodes)
    per_seed = {}
    for seed in seeds:
        mine = [e["won"] for e in episodes if e["seed"] == seed]
        if mine:
            per_seed[str(seed)] = sum(mine) / len(mine)
    values = list(per_seed.values())
    out = {
        "episodes": n, "successes": won, "success_rate": won / n if n else None, "ci95": wilson(won, n),
        "per_seed": per_seed, "seed_mean": statistics.fmean(values) if values else None,
        "seed_sd": statistics.stdev(values) if len(values) > 1 else 0.0 if values else None,
    }  # fmt: skip
    if episodes and "score" in episodes[0]:
        out["score"] = statistics.fmean(e["score"] for e in episodes)
    return out


def summarise_model(episodes: Sequence[dict[str, Any]], report_key: str | None, seeds: Sequence[int]) -> dict[str, Any]:
    """Overall and per task type (`report_key` attribute) `_rates`, plus invalid replies and env failures."""
    summary = {"overall": _rates(episodes, seeds), "per_type": {}}
    if report_key:
        kinds = sorted({str(e["attributes"].get(report_key)) for e in episodes})
        for kind in kinds:
            mine = [e for e in episodes if str(e["attributes"].get(report_key)) == kind]
            summary["per_type"][f"{report_key}={kind}"] = _rates(mine, seeds)
    turns = sum(e.get("turns") or 0 for e in episodes)
    if turns:
        summary["valid_action_rate"] = 1 - sum(e.get("invalid_steps") or 0 for e in episodes) / turns
    summary["env_failures"] = sum(e.get("failed", False) for e in episodes)
    return summary


def paired_difference(first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Success of `first` minus `second` on the episodes both played (same task, seed, repeat).

    d_task = mean over the task's shared episodes of (won_1 − won_2); the difference is the mean
    of d_task over T tasks and its 95% interval mean ± 1.96 · sd(d_task) / √T (tasks are the
    independent unit; T < 2 gives no interval)."""
    key = lambda e: (e["task_id"], e["seed"], e["repeat"])  # noqa: E731
    second_by_key = {key(e): e for e in second}
    per_task: dict[int, list[float]] = {}
    for e in first:
        other = second_by_key.get(key(e))
        if other is not None:
            per_task.setdefault(e["task_id"], []).append(float(e["won"]) - float(other["won"]))
    diffs = [statistics.fmean(v) for v in per_task.values()]
    pairs = sum(len(v) for v in per_task.values())
    if not diffs:
        return {"pairs": 0, "tasks": 0, "difference": None, "ci95": None}
    mean = statistics.fmean(diffs)
    half = Z95 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"pairs": pairs, "tasks": len(diffs), "difference": mean,
            "ci95": [mean - half, mean + half] if half is not None else None}  # fmt: skip


# ---------------------------------------------------------------------------------------------- output


def _cell_rate(rates: dict[str, Any]) -> str:
    if not rates["episodes"]:
        return "–"
    low, high = rates["ci95"]
    return f"{rates['success_rate']:.3f} ({rates['successes']}/{rates['episodes']}, {low:.3f}–{high:.3f})"


def _cell_seeds(rates: dict[str, Any]) -> str:
    return "–" if rates["seed_mean"] is None else f"{rates['seed_mean']:.3f} ± {rates['seed_sd']:.3f}"


def markdown_report(result: dict[str, Any]) -> str:
    """The tables: per model and split, success per task type; then the paired differences."""
    protocol = result["protocol"]
    lines = [
        f"# bipace-eval: {protocol['env']}",
        "",
        f"temperature {protocol['temperature']}, seeds {', '.join(map(str, protocol['seeds']))}, "
        f"≤ {protocol['max_turns']} turns, history {protocol['history_length']}, "
        f"{protocol['episodes_per_task']} episode(s) per task and seed"
        + (f", generated with {protocol['generation']}" if protocol.get("generation") else "")
        + ". Success: k/n with the 95% Wilson interval "
        "over all seeds' episodes; seeds: mean ± sd of the per-seed rates.",
    ]
    for model in result["models"]:
        for split, summary in model["splits"].items():
            score = "score" in summary["overall"]
            lines += ["", f"## {model['label']} on {split}", "", f"model: `{model['model']}`"
                      + (f", adapter `{model['adapter']}`" if model.get("adapter") else ""), ""]  # fmt: skip
            header = "| task type | success (k/n, 95% CI) | seeds (mean ± sd) |" + (" score |" if score else "")
            lines += [header, "|---|---|---|" + ("---|" if score else "")]
            rows = [("all", summary["overall"]), *summary["per_type"].items()]
            for kind, rates in rows:
                extra = f" {rates['score']:.3f} |" if score else ""
                lines.append(f"| {kind} | {_cell_rate(rates)} | {_cell_seeds(rates)} |{extra}")
    if result.get("paired"):
        lines += ["", "## Paired difference (same tasks and seeds)", "",
                  "| split | first − second | pairs (tasks) | difference | 95% CI |", "|---|---|---|---|---|"]  # fmt: skip
        for pair in result["paired"]:
            interval = "–" if pair["ci95"] is None else f"{pair['ci95'][0]:+.3f} to {pair['ci95'][1]:+.3f}"
            difference = "–" if pair["difference"] is None else f"{pair['difference']:+.3f}"
            lines.append(f"| {pair['split']} | {pair['first']} − {pair['second']} | {pair['pairs']} ({pair['tasks']}) | "
                         f"{difference} | {interval} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(settings: argparse.Namespace, progress=print) -> dict[str, Any] | None:
    """Evaluate every model of `settings.models`, compare the first two, write the files; the result (main process)."""
    from accelerate import PartialState

    from envs.base import resolve_env_class

    state = PartialState(cpu=settings.use_cpu)  # first: the trainers' TrainingArguments share this state
    say = progress if state.is_main_process else None
    labels: list[str] = []
    models = []
    for spec in settings.models:
        label = model_label(spec, labels)
        labels.append(label)
        episodes = evaluate_model(spec, settings, label, say)
        resolved = resolve_model(spec, settings.base_model)
        models.append({"label": label, "model": resolved.model, "adapter": resolved.adapter, "spec": spec,
                       "episodes": episodes})  # fmt: skip
    if not state.is_main_process:
        return None
    report_key = resolve_env_class(settings.env).report_key
    result: dict[str, Any] = {
        "protocol": {
            "env": settings.env, "splits": list(settings.split), "temperature": settings.temperature,
            "seeds": list(settings.seeds), "max_turns": settings.max_turns, "history_length": settings.history_length,
            "max_completion_length": settings.max_completion_length, "episodes_per_task": settings.episodes_per_task,
            "tasks": settings.tasks, "env_kwargs": settings.env_kwargs, "source": settings.protocol_source,
            "generation": generation_backend(settings),
        },
        "models": [],
        "paired": [],
    }  # fmt: skip
    for model in models:
        splits = {split: summarise_model(eps, report_key, settings.seeds) for split, eps in model["episodes"].items()}
        result["models"].append({k: v for k, v in model.items() if k != "episodes"} | {"splits": splits})
    if len(models) >= 2:
        first, second = models[0], models[1]
        for split in settings.split:
            pair = paired_difference(first["episodes"][split], second["episodes"][split])
            result["paired"].append({"split": split, "first": first["label"], "second": second["label"], **pair})
    result["markdown"] = markdown_report(result)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
    (out / MARKDOWN_FILE).write_text(result["markdown"])
    return result


# ---------------------------------------------------------------------------------------------- command line


# vLLM flags: given without --use_vllm they are an error, not silently ignored; None = not given.
VLLM_FLAGS = ("vllm_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_server_base_url")
VLLM_DEFAULTS = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bipace-eval", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+", help="one model, or two to compare (Hub id, folder, adapter, checkpoint, run)")
    # Defaults marked "the run's" come from a run's saved evaluation settings (`run_settings`), else the protocol.
    parser.add_argument("--env", help="a registered env or package.module:Class (default: the run's, else textcraft)")
    parser.add_argument("--split", nargs="+", help="splits to play (default: the run's, else the env's protocol)")
    parser.add_argument("--seeds", nargs="+", type=int,
                        help="sampling seeds (default: the run's, which replays its final evaluation, else 123 456 789)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the run's, else 0.4)")
    parser.add_argument("--max_turns", type=int, help="turn budget (default: the run's, else the env's protocol)")
    parser.add_argument("--history_length", type=int, help="past turns in each prompt (default: the run's, else 2)")
    parser.add_argument("--max_completion_length", type=int, help="tokens per reply (default: the run's, else 512)")
    parser.add_argument("--env_kwargs", type=json.loads,
                        help='env options as JSON, e.g. \'{"max_expert_steps": 3}\' (default: the run\'s)')
    parser.add_argument("--tasks", type=int,
                        help="tasks per split, stratified over task types (default: the run's eval_tasks, else 0: all)")
    parser.add_argument("--episodes_per_task", type=int, help="episodes per task and seed (default: the run's, else 1)")
    parser.add_argument("--chunk_size", type=int, help="episodes played (and saved) together; 0: a seed's whole "
                        "panel at once (default: 0 on a run's settings, as the run played it, else 64)")
    parser.add_argument("--base_model", help="base model of a LoRA adapter (default: the adapter's own record)")
    parser.add_argument("--output_dir", help="where results and episodes go (default: RUN/bipace_eval for a run's "
                        f"output dir or checkpoint, else {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--rollout_batch_size", type=int,
                        help="prompts per generate call (default: the run's, else 0: all active)")
    parser.add_argument("--use_vllm", action="store_true", help="generate with vLLM (TRL's; pip install 'trl[vllm]')")
    parser.add_argument("--vllm_mode", choices=("colocate", "server"),
                        help="colocate (default): an engine in each process; server: a running `trl vllm-serve`")
    parser.add_argument("--vllm_gpu_memory_utilization", type=float,
                        help="share of the GPU a colocated engine takes (default 0.3)")
    parser.add_argument("--vllm_max_model_length", type=int,
                        help="the engine's context length (default: the model's; lower it if the KV cache does not fit)")
    parser.add_argument("--vllm_server_base_url", help="the server of --vllm_mode server (default http://0.0.0.0:8000)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                        help="weights' dtype (default float32, as train.py loads them)")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--use_cpu", action="store_true", help="run on the CPU even with a GPU (gloo across processes)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bars")
    return parser


def apply_defaults(settings: argparse.Namespace, protocol: Protocol, saved: dict[str, Any]) -> dict[str, Any]:
    """Fill each setting no flag gave: the run's (`saved`, from `run_settings`), else the protocol's. A
    run's seed is its evaluations' one seed, its chunk the whole panel: the run's final evaluation again.
    Returns the settings taken from the run."""
    defaults = {
        "split": list(protocol.splits), "seeds": list(protocol.seeds), "temperature": protocol.temperature,
        "max_turns": protocol.max_turns, "history_length": protocol.history_length,
        "max_completion_length": protocol.max_completion_length, "env_kwargs": dict(protocol.env_kwargs),
        "tasks": 0, "episodes_per_task": 1, "rollout_batch_size": 0, "chunk_size": 64,
    }  # fmt: skip
    taken = {name: saved[name] for name in defaults if saved.get(name) is not None}
    if "split" in taken:
        taken["split"] = [taken["split"]]
    if saved.get("seed") is not None:
        taken |= {"seeds": [saved["seed"]], "chunk_size": 0}
    defaults.update(taken)
    for name, value in defaults.items():
        if getattr(settings, name) is None:
            setattr(settings, name, value)
    settings.generation = saved.get("generation") if isinstance(saved.get("generation"), dict) else {}
    return taken


def replayed_evaluation(settings: argparse.Namespace) -> dict[str, Any] | None:
    """The run's final evaluation when `settings` play it again (the first model is a run's output dir,
    every setting is the one it recorded, one chunk), else None."""
    final = final_evaluation(settings.models[0])
    played = final.get("settings") if final else None
    if not isinstance(played, dict) or "seed" not in played or settings.chunk_size != 0:
        return None
    ours = {"env": settings.env, "env_kwargs": settings.env_kwargs, "split": settings.split, "seeds": settings.seeds,
            "max_turns": settings.max_turns, "history_length": settings.history_length,
            "max_completion_length": settings.max_completion_length, "temperature": settings.temperature,
            "tasks": settings.tasks, "episodes_per_task": settings.episodes_per_task,
            "rollout_batch_size": settings.rollout_batch_size}  # fmt: skip
    theirs = {**{name: played.get(name) for name in ours}, "split": [final.get("split")], "seeds": [played["seed"]]}
    return final if ours == theirs else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags over the env's protocol; bad values exit with one line naming the flag."""
    parser = make_parser()
    settings = parser.parse_args(argv)
    saved, where = run_settings(settings.models)
    if settings.env is not None and saved.get("env") not in (None, settings.env):
        saved, where = {}, ""  # the run played another env: its settings do not apply
    settings.env = settings.env or saved.get("env") or "textcraft"
    try:
        protocol = protocol_for(settings.env)
    except ValueError as err:
        parser.error(f"--env {settings.env}: {err}")
    taken = apply_defaults(settings, protocol, saved)
    settings.protocol_source = f"the run's own evaluation settings ({where})" if taken else protocol.source
    if settings.output_dir is None:
        run = run_folder(settings.models)
        settings.output_dir = str(run / RUN_EVAL_DIR) if run is not None else DEFAULT_OUTPUT_DIR
    vllm_flags = [f"--{name}" for name in VLLM_FLAGS if getattr(settings, name) is not None]
    if vllm_flags and not settings.use_vllm:
        parser.error(f"{', '.join(vllm_flags)}: vLLM settings without --use_vllm; add --use_vllm or drop them.")
    for name, value in VLLM_DEFAULTS.items():
        if getattr(settings, name) is None:
            setattr(settings, name, value)
    if settings.use_vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            parser.error("--use_vllm: vLLM is not installed here; pip install 'trl[vllm]' (vLLM <= 0.31 for TRL 1.16), "
                         "or drop --use_vllm to generate with transformers.")  # fmt: skip
    checks = (
        (len(settings.models) <= 2, "models", "give one model, or two to compare"),
        (settings.temperature >= 0, "--temperature", "must be >= 0"),
        (settings.max_turns >= 1, "--max_turns", "must be >= 1"),
        (settings.episodes_per_task >= 1, "--episodes_per_task", "must be >= 1"),
        (settings.chunk_size >= 0, "--chunk_size", "must be >= 0 (0: a seed's whole panel at once)"),
        (settings.tasks >= 0, "--tasks", "must be >= 0 (0: all)"),
        (len(set(settings.seeds)) == len(settings.seeds), "--seeds", "must not repeat a seed"),
        (isinstance(settings.env_kwargs, dict), "--env_kwargs", "must be a JSON object"),
        (0 < settings.vllm_gpu_memory_utilization <= 1, "--vllm_gpu_memory_utilization", "must be in (0, 1]"),
        (settings.vllm_max_model_length is None or settings.vllm_max_model_length >= 1, "--vllm_max_model_length",
         "must be >= 1"),
        (settings.vllm_server_base_url is None or settings.vllm_mode == "server", "--vllm_server_base_url",
         "is for --vllm_mode server"),
    )
    for ok, name, fix in checks:
        if not ok:
            parser.error(f"{name}: {fix}")
    settings.replays = replayed_evaluation(settings)
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if os.environ.get("RANK", "0") == "0" and not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        from . import threads

        print(threads.describe(), flush=True)  # first, as train.py's: how torch's threads wait on shared cores
    settings = parse_args(argv)
    if settings.protocol_source.startswith("the run's"):  # say what is played, and that flags change it
        print(f"settings from {settings.protocol_source[4:]}: env {settings.env}, split {' '.join(settings.split)}, "
              f"{settings.max_turns} turns, history {settings.history_length}, temperature {settings.temperature}, "
              f"{settings.tasks or 'all'} tasks x {settings.episodes_per_task} per seed (flags override)", flush=True)
        print(seeds_line(settings), flush=True)
    result = run(settings, progress=lambda line: print(line, flush=True))
    if result is not None:
        print(result["markdown"])
        print(f"results: {Path(settings.output_dir) / RESULT_FILE} and {MARKDOWN_FILE}")
        if settings.replays is not None:
            print(replay_lines(settings.replays, result["models"][0]["splits"][settings.split[0]]["overall"]))
    return 0


def seeds_line(settings: argparse.Namespace) -> str:
    """Which seeds a run's output dir is played on, and whether that replays its final evaluation."""
    seeds = " ".join(map(str, settings.seeds))
    if settings.replays is not None:
        return (f"seed {seeds}, the one the run's final evaluation sampled with: it is played again (the summary's "
                "held-out figure); --seeds 123 456 789 plays more seeds")
    final = final_evaluation(settings.models[0])
    recorded = (final or {}).get("settings", {}).get("seed")
    if recorded is None:
        return f"seeds {seeds}: this run recorded no evaluation seed, so its final evaluation is not replayed"
    return f"seeds {seeds}, asked for (the run's final evaluation sampled seed {recorded}; other settings do not replay it)"


def replay_lines(final: dict[str, Any], overall: dict[str, Any]) -> str:
    """The run's summary line of its final evaluation, and the same line of this replay, one above the other."""
    from ..reports.run_summary import evaluation_summary, format_evaluation

    replayed = {"num_tasks": overall["episodes"], "success_rate": overall["success_rate"]}
    return "\n".join([format_evaluation("the run's summary (held-out)", evaluation_summary(final) | {"valid_action_rate": None}),
                      format_evaluation("played again here         ", evaluation_summary(replayed))])


if __name__ == "__main__":
    sys.exit(main())
