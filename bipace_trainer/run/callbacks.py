"""The trainer's own callbacks: a graceful stop on SIGTERM and a numeric progress bar.

The evaluation's callbacks (before, every `eval_interval` steps, final) live with the
evaluation, in `evaluation.py`.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Protocol

from transformers import ProgressCallback, TrainerCallback

if TYPE_CHECKING:
    from transformers import TrainerState

    from ..rollout.sync import CrossRankSync

__all__ = ["TrainingInterrupted", "Stoppable", "GracefulStopCallback", "NumericProgressCallback"]


class TrainingInterrupted(BaseException):
    """SIGTERM that could not wait for the end of a step (a second SIGTERM, or one during
    the final evaluation). A BaseException, so no `except Exception` in an env swallows it."""


class Stoppable(Protocol):
    """What the graceful stop reads and sets on the trainer, and nothing else."""

    interrupted: bool  # set on SIGTERM: `train` returns None, the final evaluation is skipped
    state: TrainerState  # TRL's: global_step, max_steps
    saving_checkpoint: bool  # a checkpoint is being written: a second SIGTERM waits for it


class GracefulStopCallback(TrainerCallback):
    """On SIGTERM (a scheduler's preemption notice), finish the current step, save a
    checkpoint and stop, instead of dying mid-step. A hung env cannot hold the step
    forever: every backend ends a call at `env_step_timeout`. A second SIGTERM, or one
    once the last step is done and saved (during the final evaluation), stops at once,
    but never inside a checkpoint save. SIGKILL cannot be caught: atomic checkpoint
    writes (`checkpointing.save_atomically`) keep the last one loadable.
    """

    def __init__(self, trainer: Stoppable, sync: CrossRankSync):
        self.trainer = trainer
        self.sync = sync  # so every rank stops at the same step
        self._requested = False
        self._training_over = False
        self._previous = None

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM asked this rank to stop at the end of the current step."""
        return self._requested

    def _request_stop(self, signum, frame):
        self.trainer.interrupted = True
        state = self.trainer.state
        trained = bool(state.max_steps) and state.global_step >= state.max_steps and not self.trainer.saving_checkpoint
        if self._requested or self._training_over or trained:
            raise TrainingInterrupted(f"SIGTERM at step {self.trainer.state.global_step}")
        self._requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._requested = self._training_over = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request_stop)

    def on_step_end(self, args, state, control, **kwargs):
        if self.sync.any(self._requested):  # every rank stops at the same step
            self.trainer.interrupted = True
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self._training_over = True

    def restore_handler(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class NumericProgressCallback(ProgressCallback):
    """transformers' progress bar, printing each logged value as a number: its own `on_log`
    formats floats into strings, so every value showed quoted ({'loss': '0.0123'})."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in logs.items() if k != "total_flos"}
            self.training_bar.write(str(shown))
