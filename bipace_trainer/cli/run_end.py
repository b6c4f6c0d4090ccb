"""The end of a train.py run: what it writes once training is over, guarded against SIGTERM, the
summary, and the completion of a finished run that is resumed (a requeued job).

    with EndGuard() as guard:                        # SIGTERM once training is over: the write in progress finishes
        trainer.train(...)
        summary = finish(trainer, guard, run)        # final model, plot, report, one phase at a time
    summary = complete_finished(run, step, args)     # a finished run resumed: nothing loads, nothing trains

The phases after training, in order: the log (`trainer_state.json`) and the final model (written
atomically, `checkpointing.save_final_model`), then the record that the run finished
(`run_dir.finish_run`); the push; the learning curve; the report. A SIGTERM during any of them lets
that phase finish (a save, a plot, a page: bounded) and skips the rest: the run stops with exit code
143 and names what is missing, which `--resume_from_checkpoint true` writes without training. A
SIGTERM during the final evaluation (inside `train()`) stops at once; the trainer keeps a checkpoint
of the last step to resume it from (`save_stopped_end`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import STARTED
from ..reports.report import load_eval_history, load_log_history, write_report
from ..reports.run_summary import CURVE_FILE, evaluation_summary, format_evaluation, learning_curve, plot_learning_curve
from ..run import run_dir

__all__ = [
    "EXIT_STOPPED", "EndGuard", "RunDescription", "finish", "complete_finished", "print_summary", "summary_of",
    "write_run_report", "save_log",
]

# Exit code of a run stopped by SIGTERM before it finished (128 + SIGTERM, the shell's convention).
EXIT_STOPPED = 143


class EndGuard:
    """SIGTERM around a run, from the main thread. Until `arm()` a SIGTERM ends the process as it
    would without the guard (while it trains, the trainer's graceful stop handles it instead); once
    armed (training is over) it is recorded in `requested` and the phase in progress finishes."""

    def __init__(self):
        self.requested = False
        self.armed = False
        self._previous = None

    def __enter__(self) -> EndGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def arm(self) -> None:
        self.armed = True

    def _on_sigterm(self, signum, frame) -> None:
        if not self.armed:  # loading the model, say: stop as if there were no guard
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._previous = None
            os.kill(os.getpid(), signum)
            return
        if not self.requested:
            print("SIGTERM: the write in progress finishes, then the run stops.", flush=True)
        self.requested = True


@dataclass(frozen=True)
class RunDescription:
    """What a run's summary and report are titled with, and where it writes."""

    model: str
    env: str
    preset: str
    output_dir: str
    summary_file: str | None = None

    @property
    def title(self) -> str:
        return f"{self.model} on {self.env}, {self.preset}"


def elapsed() -> dict[str, float]:
    """Seconds since the program started (`cli.STARTED`): wall clock, and this process's CPU."""
    wall, cpu = STARTED
    return {"wall": time.time() - wall, "cpu": time.process_time() - cpu}


def summary_of(
    run: RunDescription, steps: int, eval_history: list[dict], log_history: list[dict], *, stopped: bool = False,
    push_error: str | None = None, warm_start: dict | None = None,
) -> dict[str, Any]:
    """The run's summary (printed, and written to --summary_file), from its evaluations and log."""
    evals = {e.get("tag"): e for e in eval_history}
    return {
        "model": run.model, "env": run.env, "preset": run.preset, "steps": steps,
        "success_before": evals.get("before", {}).get("success_rate"),
        "success_after": evals.get("final", {}).get("success_rate"),
        "per_type_after": evals.get("final", {}).get("per_type", {}),
        "output_dir": run.output_dir,
        "stopped": stopped,
        "push_error": push_error,  # the model is saved in output_dir; the exit code is 1
        "warm_start": warm_start,
        "before": evaluation_summary(evals.get("before")),
        "after": evaluation_summary(evals.get("final")),
        "curve": learning_curve(log_history),
        "seconds": elapsed(),
        "plot": None,
        "report": None,
    }  # fmt: skip


def save_log(trainer) -> None:
    """`<output_dir>/trainer_state.json` (TRL's log, which the report and a resumed summary read), replaced
    whole (main process)."""
    if trainer.accelerator.is_main_process:
        path = Path(trainer.args.output_dir) / "trainer_state.json"
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        trainer.state.save_to_json(str(partial))
        os.replace(partial, path)


def finish(trainer, guard: EndGuard, run: RunDescription, push, warm_start: dict | None = None) -> dict[str, Any]:
    """Everything a run writes once `trainer.train()` returned, one phase at a time (module docstring);
    `push(trainer)` pushes and returns its error or None. Returns the summary, printed by the main process."""
    guard.arm()
    args, main = trainer.args, trainer.accelerator.is_main_process
    push_error, skipped = None, []
    if not trainer.interrupted:  # a stopped run is not final: its weights stay in its last checkpoint
        save_log(trainer)
        trainer.save_model(args.output_dir)
        if main:
            run_dir.finish_run(args.output_dir, trainer.state.global_step, args.max_steps, args.num_train_epochs)
        if args.push_to_hub and guard.requested:
            skipped.append("the push")
        elif args.push_to_hub:
            push_error = push(trainer)
    summary = summary_of(run, trainer.state.global_step, trainer.eval_history, trainer.state.log_history,
                         stopped=trainer.interrupted, push_error=push_error, warm_start=warm_start)
    pages = (("the learning curve", "plot", lambda: _plot(summary, trainer.eval_history, run)),
             ("the report", "report", lambda: write_run_report(trainer, run)))
    for name, key, write in pages if main else ():
        if guard.requested:
            skipped.append(name)
        else:
            summary[key] = write()
    summary["stopped"] = trainer.interrupted or guard.requested
    if main:
        _say_how_it_ended(trainer, guard, summary, skipped)
        print_summary(summary, warm_start, cut=guard.requested)
        _write_summary_file(run, summary)
    return summary


def _plot(summary: dict, eval_history: list[dict], run: RunDescription) -> str | None:
    if not summary["curve"]:
        return None
    return str(plot_learning_curve(summary["curve"], Path(run.output_dir) / CURVE_FILE, eval_history, run.title))


def write_run_report(trainer, run: RunDescription) -> str | None:
    """`<output_dir>/trainer_state.json` (the log the page reads, `save_log`) and `<output_dir>/report.html`
    (`reports.report`), by the main process; None if the page fails (the run is done)."""
    try:
        save_log(trainer)
        path = write_report(run.output_dir, log_history=trainer.state.log_history, eval_history=trainer.eval_history,
                            title=run.title, report_key=trainer.collector.source.report_key)
    except Exception as err:  # noqa: BLE001 - a page must not cost a finished run its summary
        print(f"warning: the report could not be written ({type(err).__name__}: {err}); "
              f"`bipace-report {run.output_dir}` retries it.")
        return None
    return str(path)


def _say_how_it_ended(trainer, guard: EndGuard, summary: dict, skipped: list[str]) -> None:
    output_dir = trainer.args.output_dir
    if trainer.interrupted:
        print(
            f"\n=== stopped by SIGTERM at step {summary['steps']} ===\nNothing was saved as the final model or "
            f"pushed; {run_dir.stop_message(output_dir)} Exit code {EXIT_STOPPED}."
        )
    elif guard.requested:
        push = f" (`hf upload REPO {output_dir}` pushes it)" if "the push" in skipped else ""
        print(
            f"\n=== stopped by SIGTERM after the final model was saved (step {summary['steps']}) ===\nNot written: "
            f"{', '.join(skipped) or 'nothing'}{push}; --resume_from_checkpoint true writes the learning curve and "
            f"the report without training. Exit code {EXIT_STOPPED}."
        )


def _write_summary_file(run: RunDescription, summary: dict) -> None:
    if run.summary_file:
        with open(run.summary_file, "w") as f:
            json.dump(summary, f, indent=2)


def complete_finished(run: RunDescription, step: int, warm_start: dict | None, push_to_hub: bool,
                      main: bool = True) -> dict[str, Any]:
    """A finished run resumed (its final model saved at `step`, as far as it was asked to go): nothing
    loads and nothing trains; its learning curve, report and summary are written again from its files
    (`eval_results.json`, `trainer_state.json`), by the main process. Returns the summary."""
    summary = summary_of(run, step, load_eval_history(run.output_dir), load_log_history(run.output_dir),
                         warm_start=warm_start)
    if not main:
        return summary
    print(f"resume: the run in {run.output_dir} finished at step {step} and its final model is saved: nothing to "
          "train; its learning curve, report and summary are written again.")
    if push_to_hub:
        print(f"push_to_hub: this resume pushes nothing; `hf upload REPO {run.output_dir}` pushes the saved model.")
    summary["plot"] = _plot(summary, load_eval_history(run.output_dir), run)
    try:
        summary["report"] = str(write_report(run.output_dir, title=run.title))
    except Exception as err:  # noqa: BLE001 - as after training: the page is not the run
        print(f"warning: the report could not be written ({type(err).__name__}: {err}).")
    print_summary(summary, warm_start)
    _write_summary_file(run, summary)
    return summary


def signal_line(curve: list[dict[str, float]]) -> str:
    """'RL steps with non-zero advantages: 3 of 3 (...); training-batch success 0.50 at step 1 -> 1.00 at
    step 3'. A step whose episodes all won has no outcome signal, so when it still trained the line says
    why: the discounted returns (γ < 1) pay a shorter win more than a longer one."""
    signal_steps = sum(row.get("skipped", 0.0) == 0.0 for row in curve)
    resamples = sum(row.get("resamples", 0.0) for row in curve)
    all_won = [row["step"] for row in curve if row.get("skipped", 0.0) == 0.0 and row.get("batch_success") == 1.0]
    notes = [f"{resamples:.0f} batch{'es' * (resamples != 1)} without signal played again on another goal"] * bool(resamples)
    if all_won:
        steps = " and ".join(map(str, all_won))
        notes.append(f"step{'s' * (len(all_won) > 1)} {steps} won every episode: the advantages come from the "
                     "discount, which pays a shorter win more")  # fmt: skip
    first, last = curve[0], curve[-1]
    return (f"RL steps with non-zero advantages: {signal_steps} of {len(curve)}" + (f" ({'; '.join(notes)})" if notes else "")
            + f"; training-batch success {first['batch_success']:.2f} at step {first['step']} -> "
            f"{last['batch_success']:.2f} at step {last['step']}")  # fmt: skip


def print_summary(summary: dict, warm_start: dict | None, cut: bool = False) -> None:
    """The run's summary, as the README shows it (main process); `cut`: a SIGTERM skipped the plot and report."""
    print("\n=== summary ===")
    print(f"{summary['model']} on {summary['env']} with {summary['preset']}, {summary['steps']} steps")
    if warm_start and warm_start.get("reused"):
        print(f"warm start: the finished one in {warm_start['adapter']} (not trained again on resume)")
    elif warm_start and "steps" in warm_start:
        print(f"warm start: {warm_start['steps']} SFT steps on {warm_start['rows']} expert steps "
              f"({warm_start['seconds']:.0f} s), adapter {warm_start['adapter']}")
    elif warm_start:
        print(f"warm start: adapter {warm_start['adapter']}")
    print(format_evaluation("success before RL (held-out)", summary["before"]))
    print(format_evaluation("success after RL (held-out) ", summary["after"]))
    curve = summary["curve"]
    if curve:
        print(signal_line(curve))
    why = "stopped by SIGTERM" if cut else None
    print(f"learning curve: {summary['plot']}" if summary["plot"] else f"learning curve: {why or 'no RL step logged'}")
    print(f"report (curves, evaluations, every dumped step with its credit): {summary['report']}"
          if summary["report"] else f"report: not written ({why or 'see the warning above'})")
    print(f"time: {summary['seconds']['wall']:.0f} s wall, {summary['seconds']['cpu']:.0f} s CPU (since the program started)")
    print(f"adapter and eval results: {summary['output_dir']}")
