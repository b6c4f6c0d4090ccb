"""The multi-turn rollout collector: the trainer's one way to play episodes, training and evaluation alike.

    collector = RolloutCollector(policy, TextEnvSource(env_spec, settings), settings, accelerator, hidden_plan)
    rollout = collector.collect("train", collector.task_refs(rows, group_size=G))
    with collector.sampling_temperature(0.4):
        rollout = collector.collect("eval", collector.eval_task_refs("valid"))
    collector.record(rollout, estimate, step=global_step)            # completions table, rollout dumps

It holds a `policy.Policy`, never the trainer: generation per turn through it (TRL's own
`_generate_single_turn` for a training run, HF generate or vLLM; continuous mode on vLLM streams
requests through the engine instead, `vllm_stream`; a plain model for `bipace-eval`) with the sampling
temperature in force, the actor's hidden states when the run's `HiddenPlan` captures them in the
generation (`hidden`), one `VectorEnv` per
use ("train", "eval") kept across generations, the rollout loop (`rollout.run_rollouts`,
lockstep or continuous per `rollout_mode`) with cross-rank reductions, the progress bar,
the "every episode failed" guard, and the trajectory records (`trajectories`).

It is built from values, never from the run's config: `RolloutSettings` (what the rollout reads) and
`EnvSpec` (which envs, how stepped), which the trainer derives once (`run.plan`) and `bipace-eval` builds
from its flags (`cli.evaluate`).

A kind of environment is an *env source* (`TextEnvSource`: our registered `TextEnv`s;
`ToolEnvSource`: TRL's `environment_factory` / `tools`) together with its `EnvAdapter`
(`rollout.TextEnvAdapter`, `tool_envs.ToolEnvAdapter`): the source says how to build the
envs, which tasks a dataset row or an evaluation split means, and which adapter plays
them. A third kind is one new source and adapter; neither the collector nor the trainer changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Hashable, Iterable

from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm

from envs.base import EnvUnavailableError, resolve_env_class, stratified_subset
from envs.vector import VectorEnv

from . import trajectories
from .hidden import HiddenPlan
from .loop import (
    EnvAdapter, EnvSpec, Generation, LocalSync, Rollout, RolloutSettings, TaskRef, TextEnvAdapter, run_rollouts,
)
from .policy import Policy
from .sync import CrossRankSync
from .tool_envs import PromptAdapter, ToolEnvAdapter, ToolEnvSetup, ToolSession
from .vllm_backend import equal_prompt_counts
from .vllm_stream import StreamTurns

__all__ = [
    "RolloutCollector",
    "TextEnvSource",
    "ToolEnvSource",
    "env_source",
    "task_dataset",
    "check_env_tasks",
    "env_reward",
    "MAX_ALL_FAILED_GENERATIONS",
]

# A run stops once every episode of this many generations in a row failed (env broken, not flaky).
MAX_ALL_FAILED_GENERATIONS = 3
_DUMMY_PROMPT = [{"role": "user", "content": "."}]


def sharded_forward(accelerator, fsdp: bool = False) -> bool:
    """Whether every rank must join each forward pass (ZeRO-3 or FSDP shard the parameters)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return (plugin is not None and plugin.zero_stage == 3) or bool(fsdp)


def env_reward(completions, **kwargs):
    """Declared reward source for TRL's bookkeeping. Rewards come from the environment:
    `BiPACETrainer` computes advantages from env rewards and never calls this."""
    raise RuntimeError("env_reward is a placeholder: BiPACETrainer takes rewards from the environment.")


def check_env_tasks(env_name: str, env_kwargs: dict[str, Any], splits: dict[str, str]) -> None:
    """Each of `splits` ({field: split}) of `env_name` lists tasks with `env_kwargs`: env I/O (ALFWorld
    generates its games), so the trainer and bipace-train's pre-flight run it before any model loads,
    and a config's build never does. Raises one line naming the field and the fix."""
    env_class = resolve_env_class(env_name)
    for name, split in splits.items():
        try:
            specs = env_class.tasks(split, **env_kwargs)
        except EnvUnavailableError as err:
            raise EnvUnavailableError(f"env_name={env_name!r}: {err}") from None
        except Exception as err:
            raise ValueError(
                f"env_kwargs={env_kwargs!r}: {env_class.__name__}.tasks({split!r}) raised {type(err).__name__}: {err}; "
                "fix the values."
            ) from None
        if not specs:
            raise ValueError(
                f"{name}={split!r} of {env_name!r} has no tasks with env_kwargs={env_kwargs!r}; "
                "pick another split or other env_kwargs."
            )


def task_dataset(env: str, split: str, env_kwargs: dict[str, Any] | None = None, limit: int = 0) -> Dataset:
    """The tasks of an env split as a dataset of rows {"task_id": int} (the trainer's train set)."""
    env_class = resolve_env_class(env)
    specs = stratified_subset(env_class.tasks(split, **(env_kwargs or {})), limit, env_class.report_key, "train_tasks")
    if not specs:
        raise ValueError(f"env={env!r} has no tasks in split={split!r}; pick another split.")
    return Dataset.from_dict({"task_id": [spec.task_id for spec in specs]})


# ---------------------------------------------------------------------- env sources (one per kind of environment)


class TextEnvSource:
    """Our `TextEnv`s by registry name or dotted path (`env.name`, `env.kwargs`): a dataset row is
    {"task_id": int}; evaluation plays `settings.eval_tasks` of a split."""

    uses_reward_funcs = False  # the env's own rewards (TRL's reward column is the placeholder `env_reward`)

    def __init__(self, env: EnvSpec, settings: RolloutSettings):
        self.env, self.settings = env, settings
        self.name = env.name  # what the model card calls the env
        self.env_class = resolve_env_class(env.name)
        self.report_key = self.env_class.report_key
        self.reports_score = getattr(self.env_class, "reports_score", False)
        self.task_attributes = {
            spec.task_id: spec.attributes
            for split in {env.train_split, env.eval_split}
            for spec in self.env_class.tasks(split, **env.kwargs)
        }

    def env_factory(self) -> tuple[Any, dict[str, Any]]:
        return self.env.name, self.env.kwargs

    def adapter(self, settings: RolloutSettings) -> EnvAdapter:
        return TextEnvAdapter(settings)

    def task_ref(self, row: dict[str, Any], group: int) -> TaskRef:
        task_id = int(row["task_id"])
        return TaskRef(task_id, group=group, attributes=self.task_attributes.get(task_id, {}))

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        """`eval_tasks` tasks of `split` (stratified over `report_key`; 0 = all), each
        `eval_rollouts_per_task` times, one group per task."""
        settings = self.settings
        specs = self.env_class.tasks(split, **self.env.kwargs)
        specs = stratified_subset(specs, settings.eval_tasks, self.report_key, "eval_tasks")
        repeats = settings.eval_rollouts_per_task
        return [TaskRef(spec.task_id, group=i, attributes=spec.attributes) for i, spec in enumerate(specs) for _ in range(repeats)]

    def dummy_environment(self) -> Hashable:
        return None

    def describe(self) -> str:
        return f"env_name={self.env.name!r}, env_kwargs={self.env.kwargs!r}"


class ToolEnvSource:
    """TRL's envs: `environment_factory` (one callable, or a dict selected by the row's
    "environment") and standalone `tools`, as `GRPOTrainer.__init__` set them up (`setup`, a
    `tool_envs.ToolEnvSetup` the trainer hands over); with neither, plain prompts scored by
    `reward_funcs`, one reply each (`PromptAdapter`). A dataset row is passed whole to
    `reset(**row)`; evaluation plays the rows of `eval_dataset` (the first `eval_tasks`, 0 = all),
    each `eval_rollouts_per_task` times. `env`: how the sessions are stepped (its name and kwargs unused)."""

    report_key = None
    reports_score = False
    uses_reward_funcs = True  # the episode reward is TRL's reward_funcs (get_reward and the user's)

    def __init__(self, setup: ToolEnvSetup, env: EnvSpec, settings: RolloutSettings, num_user_reward_funcs: int,
                 eval_rows: list[dict[str, Any]] | None):
        self.setup, self.env, self.settings = setup, env, settings
        self.num_user_reward_funcs = num_user_reward_funcs
        self.eval_rows = eval_rows or []
        factories = setup.environment_factories or {}
        names = {getattr(f, "__name__", type(f).__name__) for f in factories.values()}
        self.plain_prompts = setup.environment_factories is None and not setup.tools
        self.name = "+".join(sorted(names)) or ("prompts" if self.plain_prompts else "tools")  # the model card's env

    def env_factory(self) -> tuple[Any, dict[str, Any]]:
        setup = self.setup
        multi = setup.environment_factories is not None and setup.multi_environment
        tool_errors = self.settings.tool_errors
        return functools.partial(ToolSession, setup.environment_factories, setup.standalone_tools, multi, tool_errors), {}

    def adapter(self, settings: RolloutSettings) -> EnvAdapter:
        if self.plain_prompts:  # no env, no tools: each row one reply (plain GRPO)
            return PromptAdapter(self.setup, self.num_user_reward_funcs)
        return ToolEnvAdapter(self.setup, self.num_user_reward_funcs)

    def task_ref(self, row: dict[str, Any], group: int) -> TaskRef:
        attributes = {"environment": row["environment"]} if "environment" in row else {}
        return TaskRef(int(row.get("task_id", group)), group=group, attributes=attributes, inputs=dict(row))

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        rows = self.eval_rows[: self.settings.eval_tasks or None]
        return [self.task_ref(row, i) for i, row in enumerate(rows) for _ in range(self.settings.eval_rollouts_per_task)]

    def dummy_environment(self) -> Hashable:
        """The environment a dummy prompt (a rank with no active env) is rendered with."""
        factories = self.setup.environment_factories
        return next(iter(factories)) if factories else None

    def describe(self) -> str:
        return f"environment_factory={self.setup.environment_factories!r}"


def env_source(env: EnvSpec, settings: RolloutSettings, tool_setup: ToolEnvSetup | None = None,
               num_user_reward_funcs: int = 0, eval_rows: Iterable[dict[str, Any]] | None = None):
    """The env source of a run: TRL's envs (or plain prompts) when the trainer hands over `tool_setup`,
    with `eval_rows` (its `eval_dataset`) as the evaluation's rows; else our `TextEnv` `env.name`."""
    if tool_setup is None:
        return TextEnvSource(env, settings)
    rows = list(eval_rows) if eval_rows is not None else []
    return ToolEnvSource(tool_setup, env, settings, num_user_reward_funcs, rows)


# ---------------------------------------------------------------------- the collector


class RolloutCollector:
    """Plays episodes with `policy` on the envs of `source`; see the module docstring.

    Args:
        policy: what generates (`policy.Policy`: TRL's generation, or a plain model).
        source: the kind of environment (`TextEnvSource`, `ToolEnvSource`; its `env`, an `EnvSpec`, says
            how the envs are stepped).
        settings: what the rollout reads (`RolloutSettings`; the env's instruction and invalid action
            are filled in from the source).
        accelerator: ranks and devices (cross-rank reductions, the progress bar, dumps).
        hidden: where hidden states come from (`hidden.HiddenPlan`, chosen once per run).
        sharded: every forward joins all ranks (ZeRO-3 / FSDP): continuous is refused.
    """

    def __init__(self, policy: Policy, source, settings: RolloutSettings, accelerator, hidden: HiddenPlan | None = None,
                 sharded: bool = False):
        self.policy = policy
        self.source = source
        self.accelerator = accelerator
        self.hidden = hidden or HiddenPlan()
        env_class = getattr(source, "env_class", None)  # TRL's envs have none: their prompts are their own
        self.settings = dataclasses.replace(
            settings, instruction=getattr(env_class, "instruction", ""),
            invalid_action=getattr(env_class, "invalid_action", "look"),
        )
        self.sync = CrossRankSync(accelerator)
        if settings.mode == "continuous" and sharded:
            raise ValueError(
                "rollout_mode='continuous' cannot run under ZeRO-3 or FSDP (every rank must run each forward "
                "together, and continuous ranks make their calls independently); set rollout_mode='lockstep'."
            )
        self.envs: dict[str, VectorEnv] = {}
        self.resumed_env_counters: dict[str, Any] | None = None  # added to the next train VectorEnv
        self.train_generations = self.healthy_generations = self.all_failed_streak = 0
        self.last_env_failure = ""

    @property
    def needs_hidden(self) -> bool:
        return self.hidden.source != "none"

    @property
    def weight_syncs(self):
        return self.policy.weight_syncs

    # -- tasks
    def task_refs(self, rows: list[dict[str, Any]], group_size: int) -> list[TaskRef]:
        """The rollouts of a generation batch: row i is task group i // group_size."""
        return [self.source.task_ref(row, group=i // group_size) for i, row in enumerate(rows)]

    def eval_task_refs(self, split: str) -> list[TaskRef]:
        return self.source.eval_task_refs(split)

    # -- generation
    def sampling_temperature(self, temperature: float):
        """Temporarily sample at `temperature` (0 = greedy) on either generation backend."""
        return self.policy.sampling(temperature)

    def generate_turn(
        self, messages: list[list[dict[str, Any]]], environments: list[Hashable] | None = None, policy: Policy | None = None
    ) -> Generation:
        """One generate call through the policy, plus hidden states if the run captures them in generation.

        `policy` (an `overlap.SnapshotPolicy`) generates instead of the collector's own: a frozen
        copy of the weights sampling from its own generator, for a rollout played on a background
        thread while the trainer updates the live weights (a training rollout).

        An empty `messages` (this rank has no active env) still runs a dummy generation,
        so every rank joins the same collective calls (ZeRO-3 parameter gathering). Under
        vLLM with several processes every rank sends the same number of prompts (TRL slices
        the gathered completions by rank assuming it); the padding's completions are dropped.
        """
        live = self.policy
        count = len(messages)
        dummy_envs = None if environments is None else [self.source.dummy_environment()]
        prompt_ids = live.tokenize(messages, environments) if messages else live.tokenize([_DUMMY_PROMPT], dummy_envs)
        if live.use_vllm and self.accelerator.num_processes > 1:
            dummy_ids = live.tokenize([_DUMMY_PROMPT], dummy_envs)[0]
            prompt_ids = equal_prompt_counts(prompt_ids, self.sync.max(len(prompt_ids)), list(dummy_ids))
        generator = policy if policy is not None else live
        # Hidden states in the generation (the run's `HiddenPlan`): training rollouts only.
        wants_hidden = self.hidden.in_generation and (policy is not None or live.training)
        out = generator.generate(prompt_ids, self.hidden if wants_hidden else None, real=bool(count))
        if not count:
            return Generation([], [], [], None, hidden_seconds=out.hidden_seconds)
        completion_ids = [list(ids) for ids in out.completion_ids[:count]]
        logprobs = [list(lp) for lp in out.logprobs[:count]] if out.logprobs is not None else None
        hidden = out.hidden[:count] if out.hidden is not None else None
        return Generation(prompt_ids[:count], completion_ids, live.decode(completion_ids), hidden, logprobs, out.hidden_seconds)

    @property
    def streams(self) -> bool:
        """Whether rollouts go through the engine's own continuous batching (`vllm_stream`):
        continuous mode on vLLM server, or colocate without tensor parallelism."""
        return self.policy.can_stream and self.settings.mode == "continuous"

    def generator(self, name: str, mode: str | None = None):
        """What `run_rollouts` generates with in `mode` (default: `rollout_mode`): `generate_turn`,
        or for continuous on vLLM server or colocate (`can_stream`) a `StreamTurns` over the engine."""
        policy = self.policy
        if not (policy.can_stream and (mode or self.settings.mode) == "continuous"):
            return self.generate_turn
        wants_forward = self.hidden.source == "forward" and policy.training
        return StreamTurns(
            policy, name=name, hidden=self.hidden if wants_forward else None,
            max_in_flight=self.settings.rollout_batch_size or 256,
        )

    # -- envs
    def envs_for(self, name: str, num_envs: int) -> VectorEnv:
        """A VectorEnv of `num_envs` envs, kept across generations (rebuilt if the size changes)."""
        envs = self.envs.get(name)
        if envs is None or envs.num_envs != num_envs:
            if envs is not None:
                envs.close()
            spec = self.source.env
            env, env_kwargs = self.source.env_factory()
            envs = VectorEnv(
                env,
                num_envs,
                env_kwargs=env_kwargs,
                backend=spec.backend,
                num_workers=spec.workers,
                step_timeout=spec.step_timeout,
                milestones=name == "train" and "milestone" in self.settings.rollout_needs,  # plans at reset (BEACON)
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
    def collect(self, name: str, tasks: list[TaskRef], traj_offset: int = 0, policy: Policy | None = None) -> Rollout:
        """Play `tasks` on the `name` envs ("train" or "eval") at the sampling settings in force.
        Every rank must call it, the same number of times (an empty shard still joins every generate call).

        With `policy` (an `overlap.SnapshotPolicy`; HF generation, per rank) the rollout runs on a
        background thread beside training: it generates through `policy`, joins no cross-rank
        call, shows no progress bar and leaves the "every episode failed" guard to the caller,
        which runs it on the main thread (`check_failures`)."""
        if policy is not None:
            return self._collect_in_background(name, tasks, traj_offset, policy)
        envs = self.envs_for(name, len(tasks)) if tasks else None
        with self.policy.rollout_scope():
            # Continuous ranks play on their own, unless generation gathers across ranks (vLLM
            # call by call): then every rank makes the same number of calls.
            collective = self.settings.mode == "lockstep" or (self.policy.use_vllm and not self.streams)
            with self._turn_progress(name, len(tasks)) as on_turn:
                rollout = run_rollouts(
                    envs, tasks, self.generator(name), self.settings, sync=self.sync if collective else LocalSync(),
                    traj_offset=traj_offset, on_turn=on_turn, adapter=self.source.adapter(self.settings),
                )
            rollout.prompt_counts.update(self.policy.prompt_reuse(rollout))
        if name == "train":
            self._stop_if_every_env_failed(rollout)
        return rollout

    def _collect_in_background(self, name: str, tasks: list[TaskRef], traj_offset: int, policy: Policy) -> Rollout:
        envs = self.envs_for(name, len(tasks)) if tasks else None
        rollout = run_rollouts(
            envs, tasks, functools.partial(self.generate_turn, policy=policy), self.settings, sync=LocalSync(),
            traj_offset=traj_offset, adapter=self.source.adapter(self.settings),
        )
        # the snapshot's HF generate prefills every prompt token (the prefix store serves the live weights only)
        rollout.prompt_counts.update(policy.prompt_reuse(rollout))
        return rollout

    def check_failures(self, rollout: Rollout) -> None:
        """The "every episode failed" guard of a training rollout played with `collect(policy=...)`."""
        self._stop_if_every_env_failed(rollout)

    @contextlib.contextmanager
    def _turn_progress(self, name: str, num_envs: int):
        """A bar over a rollout's turns, training and evaluation alike (an evaluation on a CPU
        takes minutes), on the main process unless `disable_tqdm`; yields run_rollouts' `on_turn`."""
        settings = self.settings
        if settings.disable_tqdm or not self.accelerator.is_main_process:
            yield None
            return
        label = "evaluation" if name == "eval" else "rollout"
        with tqdm(total=settings.max_turns, desc=f"{label} ({num_envs} episodes)", unit="turn", leave=False) as bar:

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
            f"and rerun; checkpoints, if any, are in {self.settings.output_dir}."
        )

    # -- what the agent did
    def record(self, rollout: Rollout, estimate=None, tag: str = "", *, step: int, covered: int = 1,
               completions_log: dict[str, Any] | None = None) -> None:
        """What the agent did, readable (`trajectories`): TRL's completions table (`completions_log`,
        the trainer's `_logs`, given for a training batch when `log_completions` is on), and the rollout
        dump when one is due (`rollout_dump_steps`; evaluations have no `estimate`). `step` is the
        trainer's global step; a training generation trains `covered` optimizer steps from `step + 1`.
        A failure here is logged and skipped: it never stops training. Every rank joins the same gathers."""
        settings, accelerator = self.settings, self.accelerator
        train = estimate is not None
        every = settings.rollout_dump_steps
        dump = trajectories.dump_step(step + 1, covered, every) if train else (step if every else None)
        log = train and completions_log is not None
        if dump is None and not log:
            return
        rank = accelerator.process_index
        rows, records = [], []
        try:
            rows = trajectories.step_rows(
                rollout, estimate, decode=lambda ids: self.policy.decode([ids])[0],
                gamma=settings.step_gamma, invalid_penalty=settings.invalid_action_penalty, rank=rank,
            )
            if dump is not None:
                split = "train" if train else "eval"
                records = trajectories.episode_records(rollout, rows, rank=rank, step=dump, split=split, tag=tag)
        except Exception as err:  # noqa: BLE001 - a log must never stop training
            trajectories.logger.warning(f"Trajectory rows at step {dump} failed ({type(err).__name__}: {err}); skipped.")
            rows, records = [], []
        if accelerator.num_processes > 1:
            rows = gather_object(rows) if log else rows
            records = gather_object(records) if dump is not None else records
        if not accelerator.is_main_process:
            return
        try:
            if log:
                trajectories.fill_completion_logs(completions_log, rows)
            if dump is not None:
                path = trajectories.dump_path(settings.output_dir, dump, "train" if train else "eval", tag)
                trajectories.write_jsonl(path, records)
        except Exception as err:  # noqa: BLE001
            trajectories.logger.warning(
                f"Rollout dump at step {dump} failed ({type(err).__name__}: {err}); skipped, training continues."
            )
