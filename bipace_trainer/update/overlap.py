"""The next generation's episodes played while the current update runs (`max_staleness=1`).

    overlap = RolloutOverlap(collector, spec, step, G)      # the trainer builds it when max_staleness=1
    iterator = overlap.lookahead(epoch_iterator)            # its `get_batch_samples`: rows can be peeked
    played = overlap.take(inputs)                           # this generation's rollout, if it was prefetched
    ...                                                     # the batch, its importance ratio, the update
    overlap.start_next(inputs)                              # the next generation plays in the background

A generation's rollout is the longest part of a step on a machine where generation is slow;
with `max_staleness=1` the rollout of generation g+1 runs on a background thread while the
trainer updates the weights on generation g. Its episodes are then sampled by the weights
of one generation ago, so each of its tokens carries the behaviour policy's log-prob, and the
batch is corrected by TRL's importance-sampling ratio ρ = π_current / π_behaviour
(`vllm_importance_sampling_mode` and its clip bounds, as TRL's vLLM correction; the trainer
multiplies the advantages by it, `batching.training_batch` computes it). What makes this safe:

- `SnapshotPolicy`: the background thread never touches the live weights. It generates with
  a copy of the policy taken when the thread starts (frozen parameters shared, so a LoRA run
  copies only its adapter; a full fine-tune holds a second copy of the model, refreshed in
  place each generation), in eval mode, without gradients.
- Its own randomness: sampling goes through `PrivateSampler`, a logits processor that applies
  the sampling warpers of the training generation config (temperature, top-k, top-p, min-p,
  ...) and draws from a `torch.Generator` seeded by (seed, step, rank), under greedy `generate`.
  The global RNG, which the main thread's shuffling and dropout read, is never drawn from, so a
  seeded run repeats its completions whatever the threads' timing.
- Behaviour log-probs: after the rollout, the snapshot scores its own completions through
  TRL's `_get_per_token_logps_and_entropies` (`batching.TRLBatchSpec.per_token_logps`) on the very tensors the old-logprob pass reads
  (`batching.padded_tensors`), so with unchanged weights ρ is exactly 1.
- Rows known in advance: `Lookahead` wraps the Trainer's epoch iterator, so the rows of the
  generation `generate_every` micro-steps ahead can be read before the training loop asks for
  them (or after: with several generations per optimizer step, the next one's rows were handed
  out with the current one's, and it plays beside the current micro-step at staleness 0). At
  an epoch's end nothing is ahead: the next epoch's first generation plays in the foreground,
  with the current weights (staleness 0).
- No collectives off the main thread: the background rollout runs with `LocalSync`, HF
  `generate` on this rank's snapshot; the "every episode failed" guard, metrics and records
  run on the main thread when the rollout is taken, and the ranks take prefetched rollouts all
  together or not at all (`take`). So DDP and ZeRO-2, whose collectives all run in the update
  on the main thread, work on any number of processes; the trainer refuses vLLM, ZeRO-3/FSDP
  (a forward there gathers parameters from every rank) and TRL's tool envs with it.
- Errors: an env failure is an episode failure, as in the foreground; any other exception in
  the thread is raised on the main thread, with its traceback, when the rollout is joined.
  Evaluation and checkpoint saves join the thread first (`join`); a checkpoint stores the
  prefetched rollout (`state_dict`), so a resumed run trains on the same episodes, and logs
  the same env/* counters for them (the train envs are built when it is taken, with the
  checkpoint's counters).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp
from trl.trainer.utils import add_fused_lm_head

from ..trl_compat import forward_closes_over, fused_lm_head_settings
from .batching import TRLBatchSpec, padded_tensors
from ..rollout.loop import Rollout
from ..rollout.policy import ModelPolicy

__all__ = ["RolloutOverlap", "check_overlap", "SnapshotPolicy", "PrivateSampler", "Lookahead", "Prefetched", "sampling_warpers"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- sampling from a private generator


def sampling_warpers(config) -> list[LogitsProcessor]:
    """The warpers `generate` applies when `config.do_sample` (transformers' `_get_logits_processor`, same order)."""
    warpers: list[LogitsProcessor] = []
    keep = 1
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(config.temperature))
    if getattr(config, "top_h", None) is not None:
        warpers.append(lp.TopHLogitsWarper(top_h=config.top_h))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(lp.TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=keep))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=keep))
    if config.min_p is not None:
        warpers.append(lp.MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=keep))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(lp.TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=keep))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(lp.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff, min_tokens_to_keep=keep))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(lp.EtaLogitsWarper(epsilon=config.eta_cutoff, min_tokens_to_keep=keep))
    return warpers


class PrivateSampler(LogitsProcessor):
    """Sampling as `generate(do_sample=True)` does it, drawn from `generator` instead of the global RNG.

    Runs as the last logits processor of a greedy `generate`: it applies `warpers`, draws one
    token per row from softmax of the warped scores, and returns scores that are -inf everywhere
    but the drawn token, which greedy search then picks."""

    def __init__(self, warpers: list[LogitsProcessor], generator: torch.Generator):
        self.warpers = warpers
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=self.generator)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, tokens, 0.0)


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------- the frozen copy of the policy


def snapshot_module(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` for generation: trainable parameters copied, frozen ones and buffers shared.

    `copy.deepcopy` with the frozen tensors in its memo, so a LoRA model copies its adapter
    alone. TRL's fused LM head (`add_fused_lm_head`) patches `forward` with a closure over the
    *original* module's forward; deepcopy would keep that closure, and the copy would generate
    with the live weights. It is patched afresh onto the copy, and any other patched `forward`
    still bound to the original refuses to be copied."""
    memo: dict[int, Any] = {id(p): p for p in module.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in module.buffers()})
    snapshot = copy.deepcopy(module, memo)
    originals = {id(m) for m in module.modules()}
    for part in snapshot.modules():
        settings = fused_lm_head_settings(part)
        if settings is not None:
            del part.__dict__["forward"]
            add_fused_lm_head(part, **settings)
        elif "forward" in part.__dict__ and forward_closes_over(getattr(part.__dict__["forward"], "__func__", None), originals):
            raise TypeError(
                f"max_staleness=1 cannot copy the policy: {type(part).__name__}.forward is patched with a closure "
                "over the live module, so the copy would generate with the live weights. Set max_staleness=0."
            )
    snapshot.eval()
    snapshot.requires_grad_(False)
    return snapshot


class SnapshotPolicy(ModelPolicy):
    """A frozen copy of the live policy (`snapshot_module`) that generates one turn the way TRL's HF
    `_generate_single_turn` does (left-padded prompts, completions cut after the first EOS; a
    `policy.ModelPolicy`), sampling from its own generator (`PrivateSampler`). `refresh` copies the
    live trainable weights into it in place, so a full fine-tune allocates the copy once.

    Args:
        live: the trainer's `update.policy.TRLPolicy` (its module, generation config, tokenizer).
        spec: what scoring the behaviour log-probs takes (`batching.TRLBatchSpec`).
    """

    def __init__(self, live, spec: TRLBatchSpec):
        module = live.module
        super().__init__(
            snapshot_module(module), live.tokenizer, live.generation_config,
            pad_to_multiple_of=live.pad_to_multiple_of, eos_token_ids=live.eos_token_ids,
            per_forward_rows=live.per_forward_rows,  # the extra hidden-state pass in the live policy's chunks
        )
        self.live, self.spec = live, spec
        live_params = dict(module.named_parameters())
        self._pairs = [
            (live_params[name], param) for name, param in self.module.named_parameters()
            if live_params[name].requires_grad
        ]
        self.config = None
        self.sampler: PrivateSampler | None = None
        self.step = -1

    @property
    def device(self):
        return self.spec.accelerator.device

    def refresh(self, step: int, seed: int) -> None:
        """Take the live weights of optimizer step `step` and the training generation settings now,
        and reseed the sampler from (`seed`, `step`)."""
        with torch.no_grad():
            for live, copied in self._pairs:
                copied.copy_(live)
        config = copy.deepcopy(self.live.generation_config)
        warpers = sampling_warpers(config) if config.do_sample else []
        sample = bool(config.do_sample)
        for name in ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"):
            if hasattr(config, name):
                setattr(config, name, None)  # applied by the sampler; greedy `generate` would warn about them
        config.do_sample = False
        self.config = self.generation_config = config
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = PrivateSampler(warpers, generator) if sample else None
        self.logits_processor = LogitsProcessorList([self.sampler] if self.sampler is not None else [])
        self.step = step

    def score(self, steps) -> None:
        """Set each step's `sampling_logprobs` to this policy's per-token log-probs of its completion,
        computed on the training batch's tensors (`batching.padded_tensors`, this rank's row count
        rounded up to `steps_per_generation`) by TRL's `_get_per_token_logps_and_entropies`."""
        if not steps:
            return
        spec = self.spec
        chunks = spec.args.steps_per_generation
        target = max(chunks, -(-len(steps) // chunks) * chunks)
        prompt_ids, prompt_mask, completion_ids, completion_mask = padded_tensors(spec, steps, target)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        with torch.no_grad():
            logps, _, _ = spec.per_token_logps(
                self.module, input_ids, attention_mask, completion_ids.size(1),
                batch_size=spec.args.per_device_train_batch_size,
            )
        for step, row in zip(steps, logps.float().cpu()):
            step.sampling_logprobs = row[: len(step.completion_ids)].tolist()


# ---------------------------------------------------------------------- rows ahead of the training loop


class Lookahead:
    """The Trainer's epoch iterator, with items ahead of it readable (`peek`) and each yielded
    item's position known (`position`, by identity: TRL passes the yielded object on to
    `_prepare_inputs`)."""

    def __init__(self, iterator: Iterator, remember: int = 1024):
        self.iterator = iterator
        self.ahead: deque = deque()
        self.yielded = 0
        self.recent: deque = deque(maxlen=remember)
        self.exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        item = self.ahead.popleft() if self.ahead else next(self.iterator)
        self.recent.append((self.yielded, item))
        self.yielded += 1
        return item

    def position(self, item) -> int | None:
        for position, seen in reversed(self.recent):
            if seen is item:
                return position
        return None

    def peek(self, position: int):
        """The item at `position`, or None past the epoch's end (or yielded too long ago to be remembered).

        An item already yielded counts: the Trainer takes an optimizer step's `gradient_accumulation_steps`
        items at once (`get_batch_samples`), so when a generation spans fewer micro-steps (several
        generations per optimizer step, as when the same batch settings run on more processes) the
        next generation's rows were yielded before its turn comes."""
        index = position - self.yielded
        if index < 0:
            return next((item for seen_at, item in self.recent if seen_at == position), None)
        while len(self.ahead) <= index:
            if self.exhausted:
                return None
            try:
                self.ahead.append(next(self.iterator))
            except StopIteration:
                self.exhausted = True
                return None
        return self.ahead[index]


# ---------------------------------------------------------------------- the background rollout


@dataclass
class Prefetched:
    """A generation played ahead: its dataset rows, its rollout (steps carry the behaviour
    log-probs) and the optimizer step whose weights played it."""

    rows: list[dict[str, Any]]
    rollout: Rollout
    snapshot_step: int


class _Background:
    """One rollout on a daemon thread; `result()` joins it and raises its exception, if any, here."""

    def __init__(self, rows, snapshot_step: int, play: Callable[[], Rollout]):
        self.rows = rows
        self.snapshot_step = snapshot_step
        self._play = play
        self._rollout: Rollout | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bipace-rollout-overlap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():
                self._rollout = self._play()
        except BaseException as err:  # noqa: BLE001 - raised on the main thread by `result`
            self._error = err

    def result(self) -> Prefetched:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            error.add_note(
                f"(raised in the background rollout of the generation prefetched at step {self.snapshot_step}; "
                "max_staleness=0 plays it in the foreground)"
            )
            raise error
        return Prefetched(self.rows, self._rollout, self.snapshot_step)


def check_overlap(sharded: bool, trl_envs: bool) -> None:
    """Refuse `max_staleness=1` where something on the background thread would have to run with the
    other ranks (`sharded`: ZeRO-3/FSDP forwards) or beside training (`trl_envs`: TRL's reward functions)."""
    if sharded:
        raise ValueError(
            "max_staleness=1 cannot run under ZeRO-3 or FSDP: every forward there gathers parameters across "
            "ranks, and the background rollout's forwards run apart from the other ranks'. Set max_staleness=0."
        )
    if trl_envs:
        raise ValueError(
            "max_staleness=1 plays the project's TextEnvs (env_name) only: TRL's environment_factory/tools score "
            "episodes through the trainer's reward functions, which cannot run beside training. Set max_staleness=0."
        )


class RolloutOverlap:
    """The trainer's side of `max_staleness=1`; see the module docstring.

    Args:
        collector: plays the rollouts (its `policy` is the live one the snapshot copies).
        spec: what the training batch takes of the trainer (`batching.TRLBatchSpec`): the behaviour
            log-probs are scored with it.
        step: the trainer's global step now (the weights a snapshot holds).
        num_generations: rows per task group (a generation's tasks are `collector.task_refs(rows, it)`).

    The trainer calls `take` at each training generation, `start_next` after it, `join` before
    evaluations and saves, `close` at the end of `train`.
    """

    def __init__(self, collector, spec: TRLBatchSpec, step: Callable[[], int], num_generations: int):
        self.collector, self.spec, self.step, self.num_generations = collector, spec, step, num_generations
        self.iterator: Lookahead | None = None
        self._source: Iterator | None = None
        self.policy: SnapshotPolicy | None = None
        self.running: _Background | None = None
        self.ready: Prefetched | None = None  # joined, not yet taken (saved by a checkpoint)
        self.resumed: Prefetched | None = None  # loaded from a checkpoint, matched by row content

    @property
    def generate_every(self) -> int:
        return self.spec.args.steps_per_generation * self.spec.num_iterations

    def lookahead(self, epoch_iterator: Iterator) -> Lookahead:
        """`epoch_iterator` wrapped once per epoch (the Trainer makes a new iterator each epoch)."""
        if isinstance(epoch_iterator, Lookahead):
            return epoch_iterator
        if epoch_iterator is not self._source:
            self._source, self.iterator = epoch_iterator, Lookahead(epoch_iterator)
        return self.iterator

    def join(self) -> None:
        """Wait for the rollout in flight (its error, if any, is raised here)."""
        if self.running is not None:
            running, self.running = self.running, None
            self.ready = running.result()

    def take(self, rows: list[dict[str, Any]]) -> Prefetched | None:
        """The prefetched rollout of `rows` (the generation's dataset rows), joined; None if it
        was not prefetched (the first generation, an epoch's first one, a resampled batch).

        All ranks or none: a prefetched batch runs the importance-ratio pass and its gathers, a
        fresh one does not, so ranks that disagreed would wait on each other's collectives. Where
        one rank has nothing (a resume that found no `overlap_rollout_rank{r}.pt` of its own, a
        different process count), every rank plays the generation now, with the current weights."""
        prefetched = self._take(rows)
        if self.collector.sync.any(prefetched is None) and prefetched is not None:
            logger.warning(
                f"Rank {self.spec.accelerator.process_index}: another rank has no prefetched rollout for this "
                "generation; every rank plays it now instead (staleness 0)."
            )
            return None
        return prefetched

    def _take(self, rows: list[dict[str, Any]]) -> Prefetched | None:
        self.join()
        for attr in ("ready", "resumed"):
            prefetched = getattr(self, attr)
            if prefetched is None:
                continue
            if prefetched.rows is rows or (attr == "resumed" and prefetched.rows == rows):
                setattr(self, attr, None)
                if attr == "resumed":
                    self._build_resumed_envs(rows)
                return prefetched
        self.ready = None  # rows it was played for never came (the schedule changed): not trained on
        return None

    def _build_resumed_envs(self, rows: list[dict[str, Any]]) -> None:
        """Build the train envs a resumed generation was played on, now, with the counters the
        checkpoint restored: this step logs the env/* metrics the uninterrupted run logs (they
        count that generation's play) instead of none. The next generation plays on them anyway."""
        tasks = self.collector.task_refs(rows, group_size=self.num_generations)
        if tasks:
            self.collector.envs_for("train", len(tasks))

    def start_next(self, rows: list[dict[str, Any]]) -> bool:
        """Start playing the generation after `rows` on a background thread with a snapshot of
        the current weights. Returns False when its rows are not known yet (an epoch's end)."""
        if self.iterator is None or self.running is not None:
            return False
        position = self.iterator.position(rows)
        upcoming = self.iterator.peek(position + self.generate_every) if position is not None else None
        if upcoming is None:
            return False
        collector, args = self.collector, self.spec.args
        if self.policy is None:
            self.policy = SnapshotPolicy(collector.policy, self.spec)
        step, rank = self.step(), self.spec.accelerator.process_index
        self.policy.refresh(step, _seed(args.seed, "overlap", step, rank))
        policy = self.policy
        tasks = collector.task_refs(upcoming, group_size=self.num_generations)
        penalize = args.penalize_env_failures

        def play() -> Rollout:
            rollout = collector.collect("train", tasks, traj_offset=rank * len(tasks), policy=policy)
            trained = rollout if penalize else rollout.without_failed_episodes()
            policy.score(trained.steps)  # the steps the batch will hold, so the layouts agree
            return rollout

        self.running = _Background(upcoming, step, play)
        return True

    def close(self) -> None:
        """Let a rollout in flight finish (its envs are reused) and drop what is left."""
        try:
            if self.running is not None:
                self.running._thread.join()
        finally:
            self.running = self.ready = None
            self.iterator = self._source = None

    # -- checkpoints (`run.checkpointing`)
    def state_dict(self) -> dict[str, Any] | None:
        """The prefetched generation not yet trained on, for a checkpoint (call `join` first)."""
        if self.ready is None:
            return None
        return {"rows": self.ready.rows, "rollout": self.ready.rollout, "snapshot_step": self.ready.snapshot_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumed = Prefetched(state["rows"], state["rollout"], int(state["snapshot_step"]))
