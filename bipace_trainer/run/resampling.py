"""Dynamic sampling (DAPO's, per generation), bounded in attempts and in time, and stoppable.

A generation in which every advantage is 0 on every rank is played again on tasks drawn
afresh, up to `resample_without_signal` times and for at most `resample_max_seconds`
(`BiPACEConfig`). Each attempt is logged as it happens, with the attempt count and the
seconds spent, and a SIGTERM (the graceful stop) ends the resampling after the attempt
in flight, so the step finishes (its update skipped) and the run saves and stops.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Generic, Protocol, TypeVar

__all__ = ["ResampleOutcome", "resample_until_signal"]

logger = logging.getLogger(__name__)


class _Scored(Protocol):
    signal: bool


S = TypeVar("S", bound=_Scored)


class ResampleOutcome(Generic[S]):
    """The batch to train (`scored`), how many redraws it took, every batch played, and why resampling ended."""

    def __init__(self, scored: S, attempts: int, played: list[S], reason: str):
        self.scored, self.attempts, self.played, self.reason = scored, attempts, played, reason


def resample_until_signal(
    scored: S,
    replay: Callable[[int], S],
    *,
    max_attempts: int,
    max_seconds: float,
    stop_requested: Callable[[], bool],
    step: int,
    agree: Callable[[bool], bool] = bool,
    log: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> ResampleOutcome[S]:
    """Replay (`replay(attempt)`, attempt = 1, 2, ...) while the batch has no signal.

    Ends at the first batch with signal ("signal"), after `max_attempts` redraws
    ("attempts"), once `max_seconds` have passed since the first redraw began ("time"; 0:
    no time bound), or when `stop_requested()` says a stop is due ("stop"). Every rank
    must call it alike (`replay` runs collective rollouts): `agree(flag)` makes the stop
    or time decision one for all ranks (any over ranks), since each has its own clock and signals.
    """
    played, attempts = [scored], 0
    start = clock()
    reason = "signal" if scored.signal else "attempts"
    while not scored.signal:
        if attempts >= max_attempts:
            reason = "attempts"
            break
        stop = bool(stop_requested())
        late = bool(max_seconds) and attempts > 0 and clock() - start >= max_seconds
        if agree(stop or late):
            reason = "stop" if stop or not late else "time"
            break
        attempts += 1
        if log:
            logger.warning(
                f"step {step}: no signal (every advantage 0); resampling on fresh tasks, attempt {attempts} of "
                f"at most {max_attempts}" + (f", {clock() - start:.0f} of at most {max_seconds:.0f} s" if max_seconds else "")
            )
        scored = replay(attempts)
        played.append(scored)
        reason = "signal" if scored.signal else reason
    if log and attempts and not scored.signal:
        ends = {"attempts": f"after {attempts} attempts", "time": f"after {clock() - start:.0f} s (resample_max_seconds)",
                "stop": "for the stop request (SIGTERM)"}
        logger.warning(f"step {step}: resampling ended {ends[reason]} without signal; the update is skipped.")
    return ResampleOutcome(scored, attempts, played, reason)
