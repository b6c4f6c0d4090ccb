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
  played during the update before the save (`update.overlap`; the save joins it first): its
  dataset rows, its rollout with the behaviour log-probs and the step whose weights played it,
  so the resumed run trains on the same episodes, corrected by the same ratio.

`bipace_state.json` also records the run's id, TensorBoard folder name and config
(`run_dir`): a resume compares the config with its own, and takes the identity with it,
so a checkpoint copied anywhere resumes as the same run. `save_atomically` writes all of it into a staging folder and
renames it into place (a full disk stops the run with `CheckpointWriteError`, the
previous checkpoint intact); the state it saves is a value (`RunState`), not the trainer;
`load_run_state` reads it back; `EpochSeededRepeatSampler` makes a resumed
run draw the same task order as an uninterrupted one.

The final model is written the same way (`save_final_model`): into `<output_dir>/.final.staging/`,
then each file renamed into place, so no half-written file ever carries a final name; a full disk
there is a `FinalModelWriteError` naming what was kept. `rng_state` / `set_rng_state` take and put
back the generators a checkpoint saves (the final evaluation's starting point, `trainer.py`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers.trainer_utils import rotate_checkpoints
from trl.trainer.utils import RepeatSampler

from . import run_dir as run_files
from .run_dir import STATE_FILE

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "BUFFER_FILE",
    "ENV_COUNTERS_FILE",
    "OVERLAP_FILE",
    "CheckpointWriteError",
    "FinalModelWriteError",
    "FINAL_STAGING",
    "RunState",
    "save_atomically",
    "load_run_state",
    "EpochSeededRepeatSampler",
    "save_final_model",
    "rng_state",
    "set_rng_state",
]

BUFFER_FILE = "rollout_buffer_rank{rank}.pt"  # a generation's samples not yet trained on, per rank
ENV_COUNTERS_FILE = "env_counters_rank{rank}.json"  # the train VectorEnv's cumulative counters, per rank
OVERLAP_FILE = "overlap_rollout_rank{rank}.pt"  # the generation played ahead during the last update, per rank
FINAL_STAGING = ".final.staging"  # under output_dir: the final model while it is written


# A write that failed for want of space: errno, or the words torch's zip writer
# ("[enforce fail at inline_container.cc] . unexpected pos") and safetensors' Rust writer use.
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_WORDS = ("unexpected pos", "file write failed", "no space left", "file too large", "quota exceeded",
                   "storagefull", "filetoolarge", "code: 28", "code: 27")  # fmt: skip


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written for want of disk space; the message is one line
    naming the checkpoint, the folder, the previous checkpoint (intact) and the fix."""


class FinalModelWriteError(CheckpointWriteError):
    """The final model could not be written for want of disk space; the message is one line naming
    the folder and what was kept (the last checkpoint, a copy elsewhere, or nothing)."""


def _out_of_space(err: BaseException | None) -> bool:
    """Whether `err` (or an error it was raised from) is a write that ran out of space."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _NO_SPACE_ERRNOS:
            return True
        if any(word in str(err).lower() for word in _NO_SPACE_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


@dataclass
class RunState:
    """What a checkpoint holds besides TRL's files, as a value: the trainer builds it for
    `save_atomically` and gets it back from `load_run_state`.

    estimator: the estimator's `state_dict()` (the calibrated ε). eval_history: every evaluation so far.
    env_counters: this rank's training `VectorEnv` counters (None: no train envs yet).
    buffer: TRL's buffered generation when saved mid-generation ({"step", "buffered_inputs",
    "skip_update"}; None otherwise). prefetched: the generation played ahead (`overlap.state_dict()`), or None.
    """

    estimator: dict[str, Any] | None = None
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    env_counters: dict[str, Any] | None = None
    buffer: dict[str, Any] | None = None
    prefetched: dict[str, Any] | None = None


def save_atomically(
    run_dir: Path, state: RunState, trl_save: Callable[[Path], None], *, accelerator: Accelerator, args: Any,
    step: int, model_name: str, best_model_checkpoint: str | None = None,
) -> None:
    """Write the checkpoint of optimizer step `step` into a staging folder, then rename it into place.

    `trl_save(staging)` is TRL's own `_save_checkpoint`, writing under the `staging` folder (the
    trainer points its output folder there while it runs). A kill during the save (SIGKILL, OOM,
    preemption) leaves only the staging folder, which resuming ignores and the next save clears:
    `checkpoint-N` either exists complete, the run's state included, or not at all. `args` gives
    `should_save`, `save_total_limit`, `output_dir` and the run's config; `model_name` the run's
    identity. Every rank takes part.
    """
    staging = run_dir / ".staging"
    name = f"checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        trl_save(staging)
        _write_run_state(state, staging / name, args, accelerator.process_index, model_name)
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
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(run_dir / name, ignore_errors=True)  # a re-save of the same step after a resume
        os.replace(staging / name, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        if args.should_save:
            rotate_checkpoints(
                output_dir=str(run_dir), save_total_limit=args.save_total_limit,
                best_model_checkpoint=best_model_checkpoint, use_mtime=True,
            )
    accelerator.wait_for_everyone()


def _write_run_state(state: RunState, directory: Path, args: Any, rank: int, model_name: str) -> None:
    if args.should_save:
        saved = {"estimator": state.estimator, "eval_history": state.eval_history}
        # whose run this is and with which settings, for a resume to compare (`run_dir.compare_with_checkpoint`)
        saved.update(run_files.run_identity(args.output_dir))  # its run id, carried wherever it is copied
        saved["config"] = run_files.run_config(args, model_name)
        (directory / STATE_FILE).write_text(json.dumps(saved))
    if state.env_counters is not None:
        path = directory / ENV_COUNTERS_FILE.format(rank=rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state.env_counters))
    if state.buffer is not None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(state.buffer, directory / BUFFER_FILE.format(rank=rank))
    if state.prefetched is not None:  # joined by the trainer's `run_state`
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(state.prefetched, directory / OVERLAP_FILE.format(rank=rank))


def load_run_state(checkpoint: str | Path | None, rank: int, device: torch.device) -> RunState | None:
    """What `save_atomically` added to `checkpoint` for rank `rank` (None without a checkpoint); the
    tensors of the buffered generation and the prefetched rollout on `device`."""
    if checkpoint is None:
        return None
    checkpoint, state = Path(checkpoint), RunState()
    if (checkpoint / STATE_FILE).exists():
        saved = json.loads((checkpoint / STATE_FILE).read_text())
        state.estimator, state.eval_history = saved["estimator"], saved.get("eval_history", [])
    counters_path = checkpoint / ENV_COUNTERS_FILE.format(rank=rank)
    if counters_path.exists():  # added to the train VectorEnv when the trainer builds it
        state.env_counters = json.loads(counters_path.read_text())
    buffer_path = checkpoint / BUFFER_FILE.format(rank=rank)
    if buffer_path.exists():  # saved mid-generation
        buffer = _load_tensors(buffer_path, device)
        # older checkpoints carried the flag inside each micro-batch
        carried = [bool(chunk.pop("skip_update", False)) for chunk in buffer["buffered_inputs"]]
        buffer["skip_update"] = buffer.get("skip_update", any(carried))
        state.buffer = buffer
    overlap_path = checkpoint / OVERLAP_FILE.format(rank=rank)
    if overlap_path.exists():
        state.prefetched = _load_tensors(overlap_path, device)
    return state


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


def save_final_model(output_dir: Path, write: Callable[[Path], None], *, accelerator: Accelerator) -> None:
    """`write(folder)` (the trainer's save: weights, tokenizer, card) into `<output_dir>/.final.staging`,
    then every file it wrote renamed into `output_dir`: a kill leaves whole files under the final names
    (the previous ones, or the new ones), never half of one. Every rank takes part. A full disk removes
    the staging copy and, on one process, saves the model into the system's temporary folder instead
    (another disk, often): `FinalModelWriteError` says which it was and what else was kept."""
    staging = output_dir / FINAL_STAGING
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        write(staging)
    except Exception as err:
        if not _out_of_space(err):
            raise
        shutil.rmtree(staging, ignore_errors=True)
        raise FinalModelWriteError(_final_model_lost(output_dir, err, write, accelerator.num_processes)) from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for path in sorted(staging.iterdir()):
            if path.is_dir():
                shutil.rmtree(output_dir / path.name, ignore_errors=True)
            os.replace(path, output_dir / path.name)
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()


def _final_model_lost(output_dir: Path, err: BaseException, write: Callable[[Path], None], processes: int) -> str:
    """The one line of a final save that ran out of space: the folder, the writer's words, what was kept."""
    detail = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    kept = []
    last = run_files.last_checkpoint(output_dir)
    if last is not None:
        kept.append(f"{last.name} (resume with --resume_from_checkpoint true once there is space: it trains "
                    "nothing more if that is the last step, and writes the final model)")
    if processes == 1:  # a sharded save would need every rank to write again
        elsewhere = Path(tempfile.mkdtemp(prefix="bipace-final-model-"))
        try:
            write(elsewhere)
            kept.insert(0, f"the final model in {elsewhere} (move its files into {output_dir} once there is space; "
                           f"`bipace-report {output_dir}` then writes the report)")
        except Exception:  # noqa: BLE001 - no room there either: nothing more to keep
            shutil.rmtree(elsewhere, ignore_errors=True)
    logs = [name for name in ("eval_results.json", "trainer_state.json") if (output_dir / name).is_file()]
    kept += [f"the run's evaluations and log ({', '.join(logs)}) in {output_dir}"] if logs else []
    return (f"no space left on device while writing the final model in {output_dir} ({detail}); kept: "
            + ("; ".join(kept) if kept else "nothing of the trained weights (no checkpoint, no room elsewhere)") + ".")


def rng_state() -> dict[str, Any]:
    """The generators a checkpoint saves (Python, NumPy, torch CPU and CUDA), as they are now."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what `rng_state` took."""
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.random.set_rng_state_all(state["cuda"])
