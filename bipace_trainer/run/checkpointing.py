"""What a checkpoint holds besides TRL's, how it is written atomically, and how a run resumes exactly.

`checkpoint-N` is TRL's (weights or adapter, optimizer, scheduler, RNG states, trainer
state) plus the run's own state:

- `bipace_state.json`: the estimator's state (the calibrated ε) and the evaluation history;
- `env_counters_rank{r}.json`: each rank's training `VectorEnv` counters, so the env/*
  metrics of a resumed run continue the checkpointed run's;
- `rollout_buffer_rank{r}.pt`, only when saved while one generation still feeds further
  optimizer steps: each rank's buffered samples and TRL's micro-step counter, so resuming
  trains on the same samples (and skips their update or not, as before) instead of
  generating new ones.
- `overlap_rollout_rank{r}.pt`, only with `max_staleness=1` when the next generation was
  played during the update before the save (`rollout.overlap`; the save joins it first): its
  dataset rows, its rollout with the behaviour log-probs and the step whose weights played it,
  so the resumed run trains on the same episodes, corrected by the same ratio.

`bipace_state.json` also records the run's id, TensorBoard folder name and config
(`run_dir`): a resume compares the config with its own, and takes the identity with it,
so a checkpoint copied anywhere resumes as the same run. `save_atomically` writes all of it into a staging folder and
renames it into place (a full disk stops the run with `CheckpointWriteError`, the
previous checkpoint intact);
`load_run_state` reads the run's state back; `EpochSeededRepeatSampler` makes a resumed
run draw the same task order as an uninterrupted one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from transformers.trainer_utils import rotate_checkpoints
from trl.trainer.utils import RepeatSampler

from . import run_dir as run_files
from .run_dir import STATE_FILE

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn
    from transformers import TrainerState

    from ..advantages import StepAdvantageEstimator
    from ..rollout.collector import RolloutCollector

__all__ = [
    "BUFFER_FILE",
    "ENV_COUNTERS_FILE",
    "OVERLAP_FILE",
    "CheckpointWriteError",
    "CheckpointedTrainer",
    "save_atomically",
    "load_run_state",
    "EpochSeededRepeatSampler",
]

BUFFER_FILE = "rollout_buffer_rank{rank}.pt"  # a generation's samples not yet trained on, per rank
ENV_COUNTERS_FILE = "env_counters_rank{rank}.json"  # the train VectorEnv's cumulative counters, per rank
OVERLAP_FILE = "overlap_rollout_rank{rank}.pt"  # the generation played ahead during the last update, per rank


# A write that failed for want of space: errno, or the words torch's zip writer
# ("[enforce fail at inline_container.cc] . unexpected pos") and safetensors' Rust writer use.
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_WORDS = ("unexpected pos", "file write failed", "no space left", "file too large", "quota exceeded",
                   "storagefull", "filetoolarge", "code: 28", "code: 27")  # fmt: skip


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written for want of disk space; the message is one line
    naming the checkpoint, the folder, the previous checkpoint (intact) and the fix."""


def _out_of_space(err: BaseException | None) -> bool:
    """Whether `err` (or an error it was raised from) is a write that ran out of space."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _NO_SPACE_ERRNOS:
            return True
        if any(word in str(err).lower() for word in _NO_SPACE_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


class CheckpointedTrainer(Protocol):
    """What a checkpoint reads from and restores into the trainer besides TRL's own files, and nothing else."""

    args: Any  # TRL's should_save, save_total_limit, output_dir, steps_per_generation (+ the run's config)
    accelerator: Accelerator
    state: TrainerState  # global_step, best_model_checkpoint
    model: nn.Module  # its config's _name_or_path, for the run's identity
    estimator: StepAdvantageEstimator  # its state (the calibrated ε)
    eval_history: list[dict[str, Any]]
    collector: RolloutCollector  # the training env counters
    num_iterations: int
    _checkpoint_staging: str | None  # where TRL's save writes while it runs
    _step: int  # TRL's buffered generation, saved mid-generation
    _buffered_inputs: list[dict[str, Any]] | None
    _skip_update: bool
    _overlap: Any  # `rollout.overlap.RolloutOverlap` with max_staleness=1, else None


def save_atomically(trainer: CheckpointedTrainer, run_dir: Path, trl_save: Callable[[], None]) -> None:
    """Write the checkpoint into a staging folder, then rename it into place.

    `trl_save` is TRL's own `_save_checkpoint`; while it runs, `trainer._checkpoint_staging`
    points the trainer's output folder (`_get_output_dir`) at the staging folder. A kill
    during the save (SIGKILL, OOM, preemption) leaves only the staging folder, which
    resuming ignores and the next save clears: `checkpoint-N` either exists complete,
    the run's state included, or not at all. Every rank takes part.
    """
    accelerator = trainer.accelerator
    staging = run_dir / ".staging"
    name = f"checkpoint-{trainer.state.global_step}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    trainer._checkpoint_staging = str(staging)
    try:
        trl_save()
        _write_run_state(trainer, staging / name)
    except Exception as err:
        if not _out_of_space(err):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # the half-written copy holds space the next save needs
        previous = run_files.last_checkpoint(run_dir)
        detail = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CheckpointWriteError(
            f"no space left on device while writing {name} in {run_dir} ({detail}); "
            + (f"the previous checkpoint {previous.name} is intact: free space, then resume with --resume_from_checkpoint true."
               if previous else "no earlier checkpoint exists: free space and rerun."),
        ) from None
    finally:
        trainer._checkpoint_staging = None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(run_dir / name, ignore_errors=True)  # a re-save of the same step after a resume
        os.replace(staging / name, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        if trainer.args.should_save:
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
                use_mtime=True,
            )
    accelerator.wait_for_everyone()


def _write_run_state(trainer: CheckpointedTrainer, directory: Path) -> None:
    rank = trainer.accelerator.process_index
    if trainer.args.should_save:
        state = {"estimator": trainer.estimator.state_dict(), "eval_history": trainer.eval_history}
        # whose run this is and with which settings, for a resume to compare (`run_dir.compare_with_checkpoint`)
        state.update(run_files.run_identity(trainer.args.output_dir))  # its run id, carried wherever it is copied
        state["config"] = run_files.run_config(trainer.args, getattr(trainer.model.config, "_name_or_path", "") or "")
        (directory / STATE_FILE).write_text(json.dumps(state))
    counters = trainer.collector.env_counters("train")
    if counters is not None:
        path = directory / ENV_COUNTERS_FILE.format(rank=rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(counters))
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    if trainer._step % generate_every and trainer._buffered_inputs is not None:
        directory.mkdir(parents=True, exist_ok=True)
        buffer = {"step": trainer._step, "buffered_inputs": trainer._buffered_inputs, "skip_update": trainer._skip_update}
        torch.save(buffer, directory / BUFFER_FILE.format(rank=rank))
    overlap = getattr(trainer, "_overlap", None)
    prefetched = overlap.state_dict() if overlap is not None else None
    if prefetched is not None:  # joined by the trainer's `_save_checkpoint`
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(prefetched, directory / OVERLAP_FILE.format(rank=rank))


def load_run_state(trainer: CheckpointedTrainer, checkpoint: str | None) -> None:
    """Restore what `save_atomically` added to `checkpoint` (after TRL has loaded its own)."""
    if checkpoint is None:
        return
    checkpoint, rank = Path(checkpoint), trainer.accelerator.process_index
    if (checkpoint / STATE_FILE).exists():
        state = json.loads((checkpoint / STATE_FILE).read_text())
        trainer.estimator.load_state_dict(state["estimator"])
        trainer.eval_history = state.get("eval_history", [])
    counters_path = checkpoint / ENV_COUNTERS_FILE.format(rank=rank)
    if counters_path.exists():  # added to the train VectorEnv when the trainer builds it
        trainer.collector.resumed_env_counters = json.loads(counters_path.read_text())
    buffer_path = checkpoint / BUFFER_FILE.format(rank=rank)
    if buffer_path.exists():  # saved mid-generation
        buffer = _load_tensors(buffer_path, trainer.accelerator.device)
        trainer._step, trainer._buffered_inputs = buffer["step"], buffer["buffered_inputs"]
        # older checkpoints carried the flag inside each micro-batch
        carried = [bool(chunk.pop("skip_update", False)) for chunk in trainer._buffered_inputs]
        trainer._skip_update = buffer.get("skip_update", any(carried))
    overlap_path = checkpoint / OVERLAP_FILE.format(rank=rank)
    overlap = getattr(trainer, "_overlap", None)
    if overlap_path.exists() and overlap is not None:  # without max_staleness the generation plays again, now
        overlap.load_state_dict(_load_tensors(overlap_path, trainer.accelerator.device))


def _load_tensors(path: Path, device: torch.device) -> Any:
    """A per-rank file of `_write_run_state`, its tensors on `device`. A multi-process CPU run's
    device is `cpu:0` (accelerate indexes every device it sets), a location `torch.load` refuses
    ("don't know how to restore data location ... cpu:0"): CPU files load to plain "cpu"."""
    return torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=False)


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose task order in epoch e depends on (seed, e) alone.

    TRL seeds the generator once and draws one permutation per epoch, so a resumed run
    (a new sampler) replayed the first epoch's order. `set_epoch(e)` (called by the
    Trainer before each epoch, resumed or not) reseeds and draws the e earlier
    permutations: the same orders as TRL's, and a resumed run continues them exactly.
    """

    @classmethod
    def like(cls, sampler: RepeatSampler) -> EpochSeededRepeatSampler:
        """This sampler with the settings of TRL's `sampler`."""
        return cls(
            data_source=sampler.data_source,
            mini_repeat_count=sampler.mini_repeat_count,
            batch_size=sampler.batch_size,
            repeat_count=sampler.repeat_count,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
        )

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None:
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.num_samples, generator=self.generator)
