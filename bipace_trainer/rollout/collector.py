"""The multi-turn rollout collector: the trainer's one way to play episodes, training and evaluation alike.

    collector = RolloutCollector(trainer, TextEnvSource(args))     # or ToolEnvSource(...) for TRL's envs
    rollout = collector.collect("train", collector.task_refs(rows, group_size=G))
    with collector.sampling_temperature(0.4):
        rollout = collector.collect("eval", collector.eval_task_refs("valid"))
    collector.record(rollout, estimate)                            # completions table, rollout dumps

It owns what a rollout needs of the trainer: generation per turn through TRL's own
`_generate_single_turn` (HF generate or vLLM; continuous mode on vLLM streams
requests through the engine instead, `vllm_stream`) with the sampling temperature in force,
the actor's hidden states when the estimator needs them (`hidden`), one `VectorEnv` per
use ("train", "eval") kept across generations, the rollout loop (`rollout.run_rollouts`,
lockstep or continuous per `rollout_mode`) with cross-rank reductions, the progress bar,
the "every episode failed" guard, and the trajectory records (`trajectories`).

A kind of environment is an *env source* (`TextEnvSource`: our registered `TextEnv`s;
`ToolEnvSource`: TRL's `environment_factory` / `tools`) together with its `EnvAdapter`
(`rollout.TextEnvAdapter`, `tool_envs.ToolEnvAdapter`): the source says how to build the
envs, which tasks a dataset row or an evaluation split means, and which adapter plays
them. A third kind is one new source and adapter; neither the collector nor the trainer changes.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import TYPE_CHECKING, Any, Hashable

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from envs.base import resolve_env_class, stratified_subset
from envs.vector import VectorEnv

from .. import trl_compat
from . import trajectories
from .hidden import PrefillCapture, forward_hidden_states
from .loop import EnvAdapter, Generation, LocalSync, Rollout, RolloutSettings, TaskRef, TextEnvAdapter, run_rollouts
from .prefix_cache import PrefixReuse, supports_prefix_reuse
from .tool_envs import PromptAdapter, ToolEnvAdapter, ToolSession
from .vllm_backend import PrefixCacheCounter, WeightSyncs, equal_prompt_counts
from .vllm_stream import StreamTurns

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = [
    "RolloutCollector",
    "CrossRankSync",
    "TextEnvSource",
    "ToolEnvSource",
    "task_dataset",
    "env_reward",
    "MAX_ALL_FAILED_GENERATIONS",
    "SUMMED_OVER_RANKS",
]

# A run stops once every episode of this many generations in a row failed (env broken, not flaky).
MAX_ALL_FAILED_GENERATIONS = 3
# How a training metric combines over ranks: these counts are summed, every other metric
# (rates, means, seconds, settings) is averaged. A name ending in "/" covers the family under it.
SUMMED_OVER_RANKS = (
    "episode/steps", "episode/env_failures", "episode/padded_rows", "env/steps", "env/failures", "env/failures/",
    "train/masked_failed_episodes", "train/masked_failed_steps",
    "rollout/prompt_tokens", "rollout/prompt_tokens_shared", "rollout/prompt_tokens_prefix_of_previous",
    "rollout/prompt_tokens_encoded", "rollout/prompt_tokens_reused",
)
_DUMMY_PROMPT = [{"role": "user", "content": "."}]


def _sharded_forward(trainer) -> bool:
    """Whether every rank must join each forward pass (ZeRO-3 or FSDP shard the parameters)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return (plugin is not None and plugin.zero_stage == 3) or bool(getattr(trainer, "is_fsdp_enabled", False))


class CrossRankSync:
    """The reductions the lockstep rollout needs, over all processes."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def any(self, flag: bool) -> bool:
        return bool(self.max(int(flag)))

    def max(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.gather(tensor).max())

    def mean(self, value: float) -> float:
        """The mean over ranks, NaN ignored (the estimator's `reduce`)."""
        if self.accelerator.num_processes == 1:
            return value
        gathered = self.accelerator.gather(torch.tensor([value], dtype=torch.float64, device=self.accelerator.device))
        return float(torch.nanmean(gathered))

    def combine(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric over ranks: summed if in `SUMMED_OVER_RANKS`, else averaged (a rank without it is left out)."""
        per_rank = gather_object([metrics]) if self.accelerator.num_processes > 1 else [metrics]
        families = tuple(name for name in SUMMED_OVER_RANKS if name.endswith("/"))
        out = {}
        for key in sorted({k for m in per_rank for k in m}):
            values = [m[key] for m in per_rank if key in m and m[key] is not None]
            summed = key in SUMMED_OVER_RANKS or key.startswith(families)
            out[key] = float(sum(values)) if summed else float(sum(values) / len(values))
        return out


def env_reward(completions, **kwargs):
    """Declared reward source for TRL's bookkeeping. Rewards come from the environment:
    `BiPACETrainer` computes advantages from env rewards and never calls this."""
    raise RuntimeError("env_reward is a placeholder: BiPACETrainer takes rewards from the environment.")


def task_dataset(env: str, split: str, env_kwargs: dict[str, Any] | None = None, limit: int = 0) -> Dataset:
    """The tasks of an env split as a dataset of rows {"task_id": int} (the trainer's train set)."""
    env_class = resolve_env_class(env)
    specs = stratified_subset(env_class.tasks(split, **(env_kwargs or {})), limit, env_class.report_key, "train_tasks")
    if not specs:
        raise ValueError(f"env={env!r} has no tasks in split={split!r}; pick another split.")
    return Dataset.from_dict({"task_id": [spec.task_id for spec in specs]})


# ---------------------------------------------------------------------- env sources (one per kind of environment)


class TextEnvSource:
    """Our `TextEnv`s by registry name or dotted path (`args.env_name`, `args.env_kwargs`):
    a dataset row is {"task_id": int}; evaluation plays `eval_tasks` of a split."""

    uses_reward_funcs = False  # the env's own rewards (TRL's reward column is the placeholder `env_reward`)

    def __init__(self, args):
        self.args = args
        self.name = args.env_name  # what the model card calls the env
        self.env_class = resolve_env_class(args.env_name)
        self.report_key = self.env_class.report_key
        self.reports_score = getattr(self.env_class, "reports_score", False)
        self.task_attributes = {
            spec.task_id: spec.attributes
            for split in {args.train_split, args.eval_split}
            for spec in self.env_class.tasks(split, **args.env_kwargs)
        }

    def env_factory(self) -> tuple[Any, dict[str, Any]]:
        return self.args.env_name, self.args.env_kwargs

    def adapter(self, settings: RolloutSettings) -> EnvAdapter:
        return TextEnvAdapter(settings)

    def task_ref(self, row: dict[str, Any], group: int) -> TaskRef:
        task_id = int(row["task_id"])
        return TaskRef(task_id, group=group, attributes=self.task_attributes.get(task_id, {}))

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        """`eval_tasks` tasks of `split` (stratified over `report_key`; 0 = all), each
        `eval_rollouts_per_task` times, one group per task."""
        args = self.args
        specs = self.env_class.tasks(split, **args.env_kwargs)
        specs = stratified_subset(specs, args.eval_tasks, self.report_key, "eval_tasks")
        repeats = args.eval_rollouts_per_task
        return [TaskRef(spec.task_id, group=i, attributes=spec.attributes) for i, spec in enumerate(specs) for _ in range(repeats)]

    def describe(self) -> str:
        return f"env_name={self.args.env_name!r}, env_kwargs={self.args.env_kwargs!r}"


class ToolEnvSource:
    """TRL's envs: `environment_factory` (one callable, or a dict selected by the row's
    "environment") and standalone `tools`, as set up by `GRPOTrainer.__init__` on `trainer`;
    with neither, plain prompts scored by `reward_funcs`, one reply each (`PromptAdapter`).
    A dataset row is passed whole to `reset(**row)`; evaluation plays the rows of
    `eval_dataset` (the first `eval_tasks`, 0 = all), each `eval_rollouts_per_task` times."""

    report_key = None
    reports_score = False
    uses_reward_funcs = True  # the episode reward is TRL's reward_funcs (get_reward and the user's)

    def __init__(self, trainer: GRPOTrainer, num_user_reward_funcs: int, eval_rows: list[dict[str, Any]] | None):
        self.trainer = trainer
        self.num_user_reward_funcs = num_user_reward_funcs
        self.eval_rows = eval_rows or []
        factories = trainer.environment_factories or {}
        names = {getattr(f, "__name__", type(f).__name__) for f in factories.values()}
        self.plain_prompts = trainer.environment_factories is None and not trainer.tools
        self.name = "+".join(sorted(names)) or ("prompts" if self.plain_prompts else "tools")  # the model card's env

    def env_factory(self) -> tuple[Any, dict[str, Any]]:
        factories = self.trainer.environment_factories
        multi = factories is not None and self.trainer._multi_environment
        return functools.partial(ToolSession, factories, self.trainer._standalone_tools, multi, self.trainer.args.tool_errors), {}

    def adapter(self, settings: RolloutSettings) -> EnvAdapter:
        if self.plain_prompts:  # no env, no tools: each row one reply (plain GRPO)
            return PromptAdapter(self.trainer, self.num_user_reward_funcs)
        return ToolEnvAdapter(self.trainer, self.num_user_reward_funcs)

    def task_ref(self, row: dict[str, Any], group: int) -> TaskRef:
        attributes = {"environment": row["environment"]} if "environment" in row else {}
        return TaskRef(int(row.get("task_id", group)), group=group, attributes=attributes, inputs=dict(row))

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        args = self.trainer.args
        rows = self.eval_rows[: args.eval_tasks or None]
        return [self.task_ref(row, i) for i, row in enumerate(rows) for _ in range(args.eval_rollouts_per_task)]

    def describe(self) -> str:
        factories = self.trainer.environment_factories
        return f"environment_factory={factories!r}"


# ---------------------------------------------------------------------- the collector


def _all_encoded(rollout: Rollout) -> dict[str, int]:
    """The prefix counts of an HF `generate` that prefilled every prompt token (nothing reused)."""
    return {"prompt_tokens_encoded": rollout.prompt_counts.get("prompt_tokens", 0), "prompt_tokens_reused": 0}


class RolloutCollector:
    """Plays episodes with `trainer`'s policy on the envs of `source`; see the module docstring.

    `trainer` is a TRL `GRPOTrainer` (`BiPACETrainer`): the collector generates through its
    `_tokenize_prompts` and `_generate_single_turn`, reads its model, accelerator and
    settings, and writes to its completions table.
    """

    def __init__(self, trainer: GRPOTrainer, source, needs_hidden: bool):
        args = trainer.args
        self.trainer = trainer
        self.source = source
        self.needs_hidden = needs_hidden
        self.settings = RolloutSettings(
            max_turns=args.max_turns,
            history_length=args.history_length,
            rollout_batch_size=args.rollout_batch_size,
            require_think=args.require_think,
            action_key_tokens=args.action_key_tokens,
            instruction=getattr(getattr(source, "env_class", None), "instruction", ""),
            invalid_action=getattr(getattr(source, "env_class", None), "invalid_action", "look"),
            mode=args.rollout_mode,
        )
        self.sync = CrossRankSync(trainer.accelerator)
        if args.rollout_mode == "continuous" and _sharded_forward(trainer):
            raise ValueError(
                "rollout_mode='continuous' cannot run under ZeRO-3 or FSDP (every rank must run each forward "
                "together, and continuous ranks make their calls independently); set rollout_mode='lockstep'."
            )
        self.weight_syncs = self.prefix_cache = None
        # Continuous under vLLM goes through the engine's own continuous batching
        # (`vllm_stream`): colocate's engine, or the server's, one request per episode turn.
        # Colocate with tensor parallelism (TRL gathers a call's prompts over the TP group)
        # stays call by call.
        vllm_mode = getattr(args, "vllm_mode", None)
        self.can_stream = bool(
            trainer.use_vllm
            and (vllm_mode == "server" or (vllm_mode == "colocate" and getattr(args, "vllm_tensor_parallel_size", 1) == 1))
        )
        if trainer.use_vllm:
            trl_compat.install_cpu_weight_loading(trainer.vllm_generation)
            self.weight_syncs = WeightSyncs(trainer.vllm_generation)
            self.prefix_cache = PrefixCacheCounter.for_generation(trainer.vllm_generation)
            if self.prefix_cache is None and self.can_stream:  # a server: its streamed replies may say
                self.prefix_cache = PrefixCacheCounter()
        self.hf_prefix = self._hf_prefix_reuse()
        self.envs: dict[str, VectorEnv] = {}
        self.resumed_env_counters: dict[str, Any] | None = None  # added to the next train VectorEnv
        self.train_generations = self.healthy_generations = self.all_failed_streak = 0
        self.last_env_failure = ""

    def _hf_prefix_reuse(self) -> PrefixReuse | None:
        """`PrefixReuse` when `hf_prefix_cache` is on and nothing in TRL's HF path it would skip is in
        use; otherwise None, with one warning saying why TRL's path is kept."""
        trainer, args = self.trainer, self.trainer.args
        if not getattr(args, "hf_prefix_cache", False) or trainer.use_vllm:  # vLLM has its own prefix cache
            return None
        config = trainer.generation_config
        reasons = [
            (trainer.use_transformers_continuous_batching, "use_transformers_continuous_batching is on"),
            (config.cache_implementation is not None, f"cache_implementation={config.cache_implementation!r} is set"),
            (trainer.pad_to_multiple_of is not None, "pad_to_multiple_of is set (the stitched batch has its own width)"),
            (_sharded_forward(trainer), "ZeRO-3/FSDP runs every forward on all ranks together (the shared-prefix "
             "pass runs only where prompts share a prefix)"),
            (getattr(trainer, "_is_vlm", False), "the model is multimodal"),
            ((config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1, "beam search / several sequences per prompt"),
            (getattr(config, "prompt_lookup_num_tokens", None) is not None, "prompt lookup decoding is set"),
        ]
        reason = next((why for bad, why in reasons if bad), "") or supports_prefix_reuse(self._policy_module())
        if reason:
            warnings.warn(f"hf_prefix_cache=True is ignored: {reason}; generation goes through TRL's path.", stacklevel=3)
            return None
        return PrefixReuse(store_bytes=args.hf_prefix_cache_store_mb * 2**20)

    # -- tasks
    def task_refs(self, rows: list[dict[str, Any]], group_size: int) -> list[TaskRef]:
        """The rollouts of a generation batch: row i is task group i // group_size."""
        return [self.source.task_ref(row, group=i // group_size) for i, row in enumerate(rows)]

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        return self.source.eval_task_refs(split)

    # -- generation
    def _policy_module(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    @contextlib.contextmanager
    def sampling_temperature(self, temperature: float):
        """Temporarily sample at `temperature` (0 = greedy) on either generation backend."""
        trainer = self.trainer
        if trainer.use_vllm:
            saved = trainer.vllm_generation.temperature
            trainer.vllm_generation.temperature = max(temperature, 1e-5)  # vLLM has no do_sample switch
            try:
                yield
            finally:
                trainer.vllm_generation.temperature = saved
            return
        sampling = {"temperature": temperature or 1.0, "do_sample": temperature > 0}
        saved = {key: getattr(trainer.generation_config, key) for key in sampling}
        saved_kwargs = {key: trainer.generation_kwargs.get(key) for key in sampling}
        trainer.generation_config.update(**sampling)
        trainer.generation_kwargs.update(sampling)  # TRL re-applies these inside unwrap_model_for_generation
        try:
            yield
        finally:
            trainer.generation_config.update(**saved)
            trainer.generation_kwargs.update(saved_kwargs)

    def _tokenize(self, messages: list, environments: list[Hashable] | None) -> list[list[int]]:
        if environments is not None:  # TRL renders each prompt with its env's tool schema
            self.trainer._batch_environments = environments
        return [list(ids) for ids in self.trainer._tokenize_prompts(messages)[0]]

    def generate_turn(
        self, messages: list[list[dict[str, Any]]], environments: list[Hashable] | None = None, policy=None
    ) -> Generation:
        """One generate call through TRL's own path, plus hidden states if the estimator needs them.

        `policy` (an `overlap.SnapshotPolicy`) generates instead of TRL's `_generate_single_turn`:
        a frozen copy of the weights sampling from its own generator, for a rollout played on a
        background thread while the trainer updates the live weights (a training rollout).

        An empty `messages` (this rank has no active env) still runs a dummy generation,
        so every rank joins the same collective calls (ZeRO-3 parameter gathering). Under
        vLLM with several processes every rank sends the same number of prompts (TRL slices
        the gathered completions by rank assuming it); the padding's completions are dropped.
        """
        trainer, args = self.trainer, self.trainer.args
        count = len(messages)
        dummy_envs = None if environments is None else [self._dummy_environment()]
        prompt_ids = self._tokenize(messages, environments) if messages else self._tokenize([_DUMMY_PROMPT], dummy_envs)
        if trainer.use_vllm and trainer.accelerator.num_processes > 1:
            dummy_ids = self._tokenize([_DUMMY_PROMPT], dummy_envs)[0]
            prompt_ids = equal_prompt_counts(prompt_ids, self.sync.max(len(prompt_ids)), list(dummy_ids))
        # Hidden states: in generate's prefill (HF), in the old-logprob pass (vLLM, see
        # `batching.training_batch`), or by one extra pass (`forward`); training rollouts only.
        wants_hidden = self.needs_hidden and (policy is not None or trainer.model.training)
        hook = wants_hidden and args.hidden_capture == "hook" and not trainer.use_vllm
        module = policy.module if policy is not None else self._policy_module()
        capture = PrefillCapture(module, args.cluster_layer) if hook else contextlib.nullcontext()
        if policy is not None:  # a background rollout (`overlap`): the snapshot samples, never the prefix store
            with capture:
                completion_ids, logprobs = policy.generate(prompt_ids)
        elif self.hf_prefix is not None:
            completion_ids, logprobs = self._generate_reusing_prefixes(prompt_ids, capture, real=bool(count)), None
        else:
            with capture:
                completion_ids, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        hidden, hidden_seconds = (capture.states if hook else None), 0.0
        if wants_hidden and args.hidden_capture == "forward":
            start = time.perf_counter()
            hidden = self._forward_hidden(prompt_ids, None if policy is None else policy.module)[:count]
            hidden_seconds = time.perf_counter() - start  # the rollout reports it apart from generation
        if not count:
            return Generation([], [], [], None, hidden_seconds=hidden_seconds)
        completion_ids = [list(ids) for ids in completion_ids[:count]]
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        logprobs = [list(lp) for lp in logprobs[:count]] if logprobs is not None else None
        return Generation(prompt_ids[:count], completion_ids, texts, hidden, logprobs, hidden_seconds)

    @property
    def streams(self) -> bool:
        """Whether rollouts go through the engine's own continuous batching (`vllm_stream`):
        continuous mode on vLLM server, or colocate without tensor parallelism."""
        return self.can_stream and self.settings.mode == "continuous"

    def generator(self, name: str, mode: str | None = None):
        """What `run_rollouts` generates with in `mode` (default: `rollout_mode`): `generate_turn`,
        or for continuous on vLLM server or colocate (`can_stream`) a `StreamTurns` over the engine."""
        if not (self.can_stream and (mode or self.settings.mode) == "continuous"):
            return self.generate_turn
        trainer, args = self.trainer, self.trainer.args
        wants_forward = self.needs_hidden and trainer.model.training and args.hidden_capture == "forward"
        return StreamTurns(
            trainer, self._tokenize, self.prefix_cache, name=name, hidden=self._forward_hidden if wants_forward else None,
            max_in_flight=self.settings.rollout_batch_size or 256,
        )

    def _generate_reusing_prefixes(self, prompt_ids: list[list[int]], capture, real: bool) -> list[list[int]]:
        """TRL's HF branch of `_generate_single_turn` (same unwrapping, generation config and
        kwargs, EOS cut) through `PrefixReuse`. The shared-prefix pass runs before `capture` is
        entered, so the hook sees generate's prefill, whose last column is still every row's last
        prompt token. A dummy call (`real=False`) is neither counted nor remembered."""
        trainer = self.trainer
        with (
            profiling_context(trainer, "transformers.generate"),
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
        ):
            prepared = self.hf_prefix.prepare(model, prompt_ids, trainer._tokenizer.pad_token_id)
            with capture:
                return self.hf_prefix.generate(
                    model, prepared, trainer.generation_config, trainer.eos_token_ids, remember=real, counted=real
                )

    def _dummy_environment(self) -> Hashable:
        factories = self.trainer.environment_factories
        return next(iter(factories)) if factories else None

    def _forward_hidden(self, prompt_ids: list[list[int]], module=None) -> torch.Tensor:
        trainer = self.trainer
        device = trainer.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=trainer._tokenizer.pad_token_id, padding_side="left").to(device)
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(device)
        if module is not None:  # a background rollout's frozen snapshot (already in eval mode)
            return forward_hidden_states(module, input_ids, mask, trainer.args.cluster_layer, trainer.args.per_device_train_batch_size)
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            return forward_hidden_states(
                trainer.model, input_ids, mask, trainer.args.cluster_layer, trainer.args.per_device_train_batch_size
            )
        finally:
            trainer.model.train(was_training)

    # -- envs
    def _envs(self, name: str, num_envs: int) -> VectorEnv:
        """A VectorEnv of `num_envs` envs, kept across generations (rebuilt if the size changes)."""
        envs = self.envs.get(name)
        if envs is None or envs.num_envs != num_envs:
            if envs is not None:
                envs.close()
            args = self.trainer.args
            env, env_kwargs = self.source.env_factory()
            envs = VectorEnv(
                env,
                num_envs,
                env_kwargs=env_kwargs,
                backend=args.env_backend,
                num_workers=args.env_workers,
                step_timeout=args.env_step_timeout,
            )
            if name == "train" and self.resumed_env_counters:
                envs.add_counters(self.resumed_env_counters)  # env/* metrics continue the checkpointed run's
                self.resumed_env_counters = None
            self.envs[name] = envs
        return envs

    def env_metrics(self, name: str) -> dict[str, float]:
        return self.envs[name].metrics() if name in self.envs else {}

    def env_counters(self, name: str) -> dict[str, Any] | None:
        return self.envs[name].counters() if name in self.envs else None

    def close(self) -> None:
        """Stop every env (worker threads or processes, engines)."""
        for envs in self.envs.values():
            envs.close()
        self.envs.clear()

    # -- the rollout
    def collect(self, name: str, tasks: list[TaskRef], traj_offset: int = 0, policy=None) -> Rollout:
        """Play `tasks` on the `name` envs ("train" or "eval") at the sampling settings in force.
        Every rank must call it, the same number of times (an empty shard still joins every generate call).

        With `policy` (an `overlap.SnapshotPolicy`; HF generation, per rank) the rollout runs on a
        background thread beside training: it generates through `policy`, joins no cross-rank
        call, shows no progress bar and leaves the "every episode failed" guard to the caller,
        which runs it on the main thread (`check_failures`)."""
        if policy is not None:
            return self._collect_in_background(name, tasks, traj_offset, policy)
        trainer = self.trainer
        envs = self._envs(name, len(tasks)) if tasks else None
        with self.weight_syncs.awake() if trainer.use_vllm else contextlib.nullcontext(False) as pushed:
            if pushed:  # sleep mode discarded the weights; they are the current step's again
                trainer._last_loaded_step = trainer.state.global_step
            # Continuous ranks play on their own, unless generation gathers across ranks (vLLM
            # call by call): then every rank makes the same number of calls.
            collective = self.settings.mode == "lockstep" or (trainer.use_vllm and not self.streams)
            if self.prefix_cache is not None:
                self.prefix_cache.take()  # what calls outside rollouts (scoring probes) left
            if self.hf_prefix is not None:
                self.hf_prefix.take_counts()
            try:
                with self._turn_progress(name, len(tasks)) as on_turn:
                    rollout = run_rollouts(
                        envs, tasks, self.generator(name), self.settings, sync=self.sync if collective else LocalSync(),
                        traj_offset=traj_offset, on_turn=on_turn, adapter=self.source.adapter(self.settings),
                    )
            finally:
                if self.hf_prefix is not None:
                    self.hf_prefix.clear()  # the stored KV belongs to this rollout's weights
        rollout.prompt_counts.update(self._prefix_reuse(rollout))
        if name == "train":
            self._stop_if_every_env_failed(rollout)
        return rollout

    def _collect_in_background(self, name: str, tasks: list[TaskRef], traj_offset: int, policy) -> Rollout:
        envs = self._envs(name, len(tasks)) if tasks else None
        rollout = run_rollouts(
            envs, tasks, functools.partial(self.generate_turn, policy=policy), self.settings, sync=LocalSync(),
            traj_offset=traj_offset, adapter=self.source.adapter(self.settings),
        )
        # the snapshot's HF generate prefills every prompt token (the prefix store serves the live weights only)
        rollout.prompt_counts.update(_all_encoded(rollout))
        return rollout

    def check_failures(self, rollout: Rollout) -> None:
        """The "every episode failed" guard of a training rollout played with `collect(policy=...)`."""
        self._stop_if_every_env_failed(rollout)

    def _prefix_reuse(self, rollout: Rollout) -> dict[str, int]:
        """Prompt tokens the engine encoded vs reused from a cache in this rollout: vLLM colocate
        reads its prefix cache back (`PrefixCacheCounter`, dummy calls included); HF `generate`
        with `hf_prefix_cache` counts what `PrefixReuse` prefilled and reused (dummy calls left
        out), and without it prefills every prompt token (nothing reused); vLLM server mode
        reports what the server stream's replies say (nothing call by call, or from a server
        started without `--enable-prompt-tokens-details`)."""
        if self.prefix_cache is not None:
            engine_side = self.trainer.args.vllm_mode == "colocate"
            return self.prefix_cache.take() if engine_side or self.prefix_cache.requests else {}
        if self.hf_prefix is not None:
            return self.hf_prefix.take_counts()
        if self.trainer.use_vllm:
            return {}
        return _all_encoded(rollout)

    @contextlib.contextmanager
    def _turn_progress(self, name: str, num_envs: int):
        """A bar over a rollout's turns, training and evaluation alike (an evaluation on a CPU
        takes minutes), on the main process unless `disable_tqdm`; yields run_rollouts' `on_turn`."""
        args = self.trainer.args
        if args.disable_tqdm or not self.trainer.accelerator.is_main_process:
            yield None
            return
        label = "evaluation" if name == "eval" else "rollout"
        with tqdm(total=args.max_turns, desc=f"{label} ({num_envs} episodes)", unit="turn", leave=False) as bar:

            def on_turn(turn: int, active: int) -> None:
                bar.set_postfix(playing=active, refresh=False)
                bar.update(1)

            yield on_turn

    def _stop_if_every_env_failed(self, rollout: Rollout) -> None:
        """A run whose every episode fails trains on nothing: a flaky generation is skipped,
        but MAX_ALL_FAILED_GENERATIONS in a row (or a whole run, see the trainer's `train`) stop it."""
        self.train_generations += 1
        failures = [e.failure for e in rollout.episodes if e.failed]
        if failures:
            self.last_env_failure = failures[-1]
        if self.sync.any(len(failures) < len(rollout.episodes)):
            self.healthy_generations += 1
            self.all_failed_streak = 0
            return
        self.all_failed_streak += 1
        if self.all_failed_streak >= MAX_ALL_FAILED_GENERATIONS:
            raise RuntimeError(self.every_env_failed(f"the last {self.all_failed_streak} generations"))

    def every_env_failed(self, when: str) -> str:
        return (
            f"Every episode of {when} failed, so nothing was trained; the latest env error: "
            f"{self.last_env_failure or 'unknown'}. Fix the env or its settings ({self.source.describe()}) "
            f"and rerun; checkpoints, if any, are in {self.trainer.args.output_dir}."
        )

    # -- what the agent did
    def record(self, rollout: Rollout, estimate=None, tag: str = "") -> None:
        """What the agent did, readable (`trajectories`): TRL's completions table for a
        training batch when `log_completions` is on, and the rollout dump when one is due
        (`rollout_dump_steps`; evaluations have no `estimate`). A failure here is logged and
        skipped: it never stops training. Every rank joins the same gathers."""
        trainer, args = self.trainer, self.trainer.args
        accelerator = trainer.accelerator
        train = estimate is not None
        every = args.rollout_dump_steps
        if train:  # a generation trains this many optimizer steps, from global_step + 1
            covered = args.steps_per_generation * trainer.num_iterations // args.gradient_accumulation_steps
            step = trajectories.dump_step(trainer.state.global_step + 1, covered, every)
        else:
            step = trainer.state.global_step if every else None
        log = train and trainer.log_completions
        if step is None and not log:
            return
        rows, records = [], []
        try:
            rows = trajectories.step_rows(
                rollout,
                estimate,
                decode=lambda ids: trainer.processing_class.decode(ids, skip_special_tokens=True),
                gamma=args.estimator.gamma,
                invalid_penalty=args.estimator.invalid_penalty,
                rank=accelerator.process_index,
            )
            if step is not None:
                split = "train" if train else "eval"
                rank = accelerator.process_index
                records = trajectories.episode_records(rollout, rows, rank=rank, step=step, split=split, tag=tag)
        except Exception as err:  # noqa: BLE001 - a log must never stop training
            trajectories.logger.warning(f"Trajectory rows at step {step} failed ({type(err).__name__}: {err}); skipped.")
            rows, records = [], []
        if accelerator.num_processes > 1:
            rows = gather_object(rows) if log else rows
            records = gather_object(records) if step is not None else records
        if not accelerator.is_main_process:
            return
        try:
            if log:
                trajectories.fill_completion_logs(trainer._logs, rows)
            if step is not None:
                path = trajectories.dump_path(args.output_dir, step, "train" if train else "eval", tag)
                trajectories.write_jsonl(path, records)
        except Exception as err:  # noqa: BLE001
            trajectories.logger.warning(
                f"Rollout dump at step {step} failed ({type(err).__name__}: {err}); skipped, training continues."
            )
