"""What the agent did, in a form a person can read: one row per step, one record per episode.

    rows = step_rows(rollout, estimate, decode=tokenizer.decode)  # one dict per env step
    fill_completion_logs(trainer._logs, rows)     # TRL's completions table (rich / wandb / trackio / parquet)
    write_jsonl(path, episode_records(rollout, rows, step=10, split="train"))

A step row holds the task, the turn, the observation the env showed, the tail of the
prompt, the reply, the parsed action and whether it was valid, the env reward, the
return-to-go R_t the estimator used, the advantage, the state-partition cell (cluster
id) and the PACE branch (`pace`, `loo` or `singleton`); under the `hierarchy` baseline
(HGPO) also `levels`, one entry per context level the step has: level k, its cell and
the cell's size, the level's advantage a_k and whether it entered the weighted mean; under
the `gae` baseline (GAGPO) also `gae`, the terms of the step's advantage (`GAE_FIELDS`,
`baselines.GaeTerms`): V̄(s_t), V̄(s_{t+1}), δ_t, the discounted sum Σ (γλ)^k δ_{t+k}, the
centred penalty, and the task group's μ and σ that normalise it.
Evaluation rollouts are not trained on: their rows have R_t but no advantage, cell or branch.

An episode record (one JSONL line, `python -m bipace_trainer.reports.show` renders it) holds
the episode's outcome, its turns in order, and `final_observation`: what the env returned after
the last action (None when an env fault ended the episode, or it took no step). Cells and task
groups are numbered per rank; `rank` says which.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Callable, Iterable

from ..advantages import BatchLayout, StepEstimate, step_returns
from ..advantages.baselines import BRANCH_LOO, BRANCH_PACE, BRANCH_SINGLETON, GaeTerms
from .prompting import safe_text
from .loop import Rollout

__all__ = [
    "PROMPT_TAIL_TOKENS",
    "GAE_FIELDS",
    "step_rows",
    "episode_records",
    "fill_completion_logs",
    "write_jsonl",
    "dump_path",
    "dump_step",
    "plain_record",
    "clean_partial_dumps",
]

logger = logging.getLogger(__name__)

PROMPT_TAIL_TOKENS = 192  # the end of the prompt, what the reply answers (the observation is a field of its own)
BRANCH_NAMES = {BRANCH_PACE: "pace", BRANCH_LOO: "loo", BRANCH_SINGLETON: "singleton"}
TURN_FIELDS = (
    "turn", "observation", "prompt_tail", "reply", "action", "valid",
    "reward", "return", "advantage", "cluster", "branch", "levels", "gae", "done",
)  # fmt: skip
# A step's `gae` entry: `baselines.GaeTerms`, field by field.
GAE_FIELDS = tuple(field.name for field in dataclasses.fields(GaeTerms))


def _levels(levels) -> list[list[dict[str, Any]] | None]:
    """Per step, its context levels (`baselines.LevelDetail`) as plain dicts, absent ones left out."""
    rows = []
    for cell, size, advantage, used in zip(
        levels.cell.tolist(), levels.size.tolist(), levels.advantage.tolist(), levels.used.tolist()
    ):
        rows.append(
            [
                {"k": k, "cell": c, "size": n, "advantage": a, "used": u}
                for k, (c, n, a, u) in enumerate(zip(cell, size, advantage, used))
                if c >= 0
            ]
        )
    return rows


def _gae(terms) -> list[dict[str, Any]]:
    """Per step, its GAE terms (`baselines.GaeTerms`) as a plain dict keyed by `GAE_FIELDS`."""
    columns = [getattr(terms, name).tolist() for name in GAE_FIELDS]
    return [dict(zip(GAE_FIELDS, values)) for values in zip(*columns)]


def _returns(rollout: Rollout, gamma: float, invalid_penalty: float) -> list[float]:
    """R_t of every step, by the estimator's own return computation (docs/concepts/math.md#step-returns)."""
    batch = rollout.step_batch()
    batch.hidden = None
    if not len(batch):
        return []
    return step_returns(batch.reward, batch.valid, BatchLayout.from_batch(batch), gamma, invalid_penalty).tolist()


def step_rows(
    rollout: Rollout,
    estimate: StepEstimate | None = None,
    *,
    decode: Callable[[list[int]], str] | None = None,
    gamma: float = 0.95,
    invalid_penalty: float = 0.1,
    rank: int = 0,
) -> list[dict[str, Any]]:
    """One dict per step of `rollout`, in the rollout's (training batch) order.

    Args:
        rollout: the rollout the steps come from.
        estimate: the estimator's output for these steps (training rollouts); None for
            evaluation, whose rows get R_t (from `gamma`, `invalid_penalty`) and no advantage.
        decode: token ids → text, for the prompt tail (the last `PROMPT_TAIL_TOKENS` tokens).
    """
    steps = rollout.steps
    episodes = {e.traj: e for e in rollout.episodes}
    if estimate is not None:
        returns = estimate.step_return.tolist()
        advantages = estimate.advantage.tolist()
        cells = estimate.cell.tolist() if estimate.cell is not None else [None] * len(steps)
        branches = [BRANCH_NAMES[b] for b in estimate.branch.tolist()] if estimate.branch is not None else [None] * len(steps)
        levels = _levels(estimate.levels) if getattr(estimate, "levels", None) is not None else [None] * len(steps)
        gae = _gae(estimate.gae) if getattr(estimate, "gae", None) is not None else [None] * len(steps)
    else:
        returns = _returns(rollout, gamma, invalid_penalty)
        advantages = cells = branches = levels = gae = [None] * len(steps)
    rows = []
    for i, step in enumerate(steps):
        episode = episodes[step.traj]
        rows.append(
            {
                "episode": step.traj,
                "group": step.group,
                "rank": rank,
                "task_id": episode.task_id,
                "task": episode.task,
                "turn": step.t,
                "observation": step.observation,
                "prompt_tail": decode(step.prompt_ids[-PROMPT_TAIL_TOKENS:]) if decode else "",
                "reply": step.reply,
                "action": step.action,
                "valid": step.valid,
                "reward": step.reward,
                "return": returns[i],
                "advantage": advantages[i],
                "cluster": cells[i],
                "branch": branches[i],
                "levels": levels[i],
                "gae": gae[i],
                "done": step.t == episode.length - 1 and not episode.truncated,  # this step ended its episode
            }
        )
    return rows


def episode_records(
    rollout: Rollout, rows: list[dict[str, Any]], *, rank: int = 0, **context: Any
) -> list[dict[str, Any]]:
    """One record per episode: `context` (e.g. step, split), the outcome, and its turns in order."""
    turns: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        turns[row["episode"]].append({key: row[key] for key in TURN_FIELDS})
    records = []
    for e in rollout.episodes:
        records.append(
            {
                **context,
                "episode": e.traj,
                "group": e.group,
                "rank": rank,
                "task_id": e.task_id,
                "task": e.task,
                "attributes": e.attributes,
                "won": e.won,
                "turns_taken": e.length,
                "invalid_steps": e.invalid_steps,
                "reward": e.reward,
                "truncated": e.truncated,
                "failed": e.failed,
                "failure": e.failure,
                "turns": sorted(turns.get(e.traj, []), key=lambda turn: turn["turn"]),
                "final_observation": e.final_observation,
            }
        )
    return records


def fill_completion_logs(logs: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Put `rows` (all ranks') into TRL's `GRPOTrainer._logs`, replacing the previous batch.

    TRL prints this table with rich, sends it to wandb / trackio and writes
    `<output_dir>/completions/completions_<step>.parquet`: TRL's columns, prompt = the prompt
    tail, completion = the reply, one reward column and the advantage, readable in an
    80-column terminal; the rest of a step (task, turn, action, return, cell, branch...) is in
    the rollout dumps (`rollout_dump_steps`). TRL sizes its buffers to one generation batch of
    *episodes*; ours holds a batch of steps, so the buffers are replaced rather than appended to.
    """
    logs["prompt"] = deque(row["prompt_tail"] for row in rows)
    logs["completion"] = deque(row["reply"] for row in rows)
    logs["rewards"] = defaultdict(deque, {"reward": deque(row["reward"] for row in rows)})
    logs["advantages"] = deque(row["advantage"] for row in rows)
    logs["extra"] = defaultdict(deque)
    logs["images"] = deque()


def plain_record(value: Any) -> Any:
    """`value` with every string in it (keys too) as `prompting.safe_text` makes it: env text
    may hold lone surrogates, which no UTF-8 file takes, and control-token markup. The dump
    shows the text as the model saw it."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {plain_record(key) if isinstance(key, str) else key: plain_record(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_record(item) for item in value]
    return value


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON object per line (`plain_record`), atomically: a reader (or a crash) never
    sees half a file; a killed write leaves a `.<name>.<pid>.partial` that `clean_partial_dumps` removes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(plain_record(record), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def clean_partial_dumps(output_dir: str | os.PathLike) -> list[Path]:
    """Remove the `.partial` files a killed dump write left under `<output_dir>/rollouts` (a run
    calls it when it starts, before it writes any); returns what it removed."""
    removed = []
    for partial in sorted((Path(output_dir) / "rollouts").glob(".*.partial")):
        partial.unlink(missing_ok=True)
        removed.append(partial)
    return removed


def dump_path(output_dir: str | os.PathLike, step: int, split: str = "train", tag: str = "") -> Path:
    """`<output_dir>/rollouts/step-000010.jsonl`, or `eval-<tag>-step-000010.jsonl` for evaluations."""
    prefix = "" if split == "train" else f"{split}-{tag}-" if tag else f"{split}-"
    return Path(output_dir) / "rollouts" / f"{prefix}step-{step:06d}.jsonl"


def dump_step(first_step: int, num_steps: int, every: int) -> int | None:
    """The multiple of `every` among the optimizer steps a generation trains
    (first_step .. first_step + num_steps - 1), or None: the step its dump is named after."""
    if every <= 0:
        return None
    step = -(-first_step // every) * every
    return step if step < first_step + max(num_steps, 1) else None
