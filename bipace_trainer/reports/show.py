"""Render a rollout dump in the terminal, episode by episode.

    python -m bipace_trainer.reports.show outputs/run/rollouts/step-000010.jsonl
    python -m bipace_trainer.reports.show outputs/run/rollouts/step-000010.jsonl --episode 3
    python -m bipace_trainer.reports.show outputs/run/rollouts/step-000010.jsonl --summary

Each episode starts with a one-line summary (episode id, task and its goal, won or not, turns,
invalid replies, env reward), then every turn: the observation the env showed, the
reply, the parsed action (marked when invalid), the reward, the return R_t, and the
advantage, green when positive and red when negative, with the cell (cluster id) and
PACE branch that produced it, under HGPO each context level's advantage (`*`: used), and
under GAGPO the GAE terms of the advantage (V̄, next V̄, δ, their discounted sum, the
centred penalty, and the group's mean and std that normalise it); last, what the env
returned after the last action (`end`), when it returned something.
Files come from `--rollout_dump_steps` (`bipace_trainer.rollout.trajectories`).

The file is read line by line (a dump of any size takes one episode's memory). A line
that is not an episode record (not a JSON object, or a field of the wrong type) is
skipped and counted on stderr. Text from the env or the model is shown with its control
characters escaped (`\\x1b`, `\\u202e`), so a dump cannot move the cursor, retitle the terminal or
reverse the text after it; the report escapes the same characters (`printable`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator, TextIO

__all__ = [
    "load_episodes", "iter_episodes", "record_problem", "printable", "task_goal", "summary_line", "render_episode", "main",
]

RESET, BOLD, DIM, RED, GREEN, YELLOW = "\033[0m", "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m"
TEXT_WIDTH = 100
# C0 controls but newline and tab, DEL, C1 controls, the line and paragraph separators, and the
# bidirectional controls that reorder what follows them ("Trojan source": U+202E shows the rest of
# a line reversed): what a terminal or the report (`report.escape_text`) must not show raw.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# A task line that states the goal: TextCraft's "Goal: craft stick." comes after its crafting commands.
_GOAL_LINE = re.compile(r"(goal\b|your task is\b)", re.IGNORECASE)
_NUMBER_FIELDS = ("reward", "turns_taken", "invalid_steps")
_TURN_NUMBER_FIELDS = ("turn", "reward", "return", "advantage")


def printable(text: Any) -> str:
    """`text` with every control character shown as an escape (`\\x1b`, `\\u202e`); newlines and tabs
    kept, and a lone surrogate (which no terminal encoding takes) shown as "?"."""
    text = str(text).encode("utf-8", "replace").decode("utf-8")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, *codes: str) -> str:
        return "".join(codes) + text + RESET if self.color and codes else text

    def signed(self, value: float | None, fmt: str = "+.3f") -> str:
        if value is None:
            return "–"
        text = format(value, fmt)
        return self(text, GREEN) if value > 0 else self(text, RED) if value < 0 else text


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def record_problem(record: Any) -> str | None:
    """Why `record` (one parsed line) is not an episode record show can render, or None if it is."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for name in _NUMBER_FIELDS:
        if record.get(name) is not None and not _is_number(record[name]):
            return f"{name} is {type(record[name]).__name__}, not a number"
    turns = record.get("turns", [])
    if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
        return "turns is not a list of objects"
    for turn in turns:
        for name in _TURN_NUMBER_FIELDS:
            if turn.get(name) is not None and not _is_number(turn[name]):
                return f"a turn's {name} is {type(turn[name]).__name__}, not a number"
    return None


def iter_episodes(path: str | Path, skipped: list[tuple[int, str]] | None = None) -> Iterator[dict[str, Any]]:
    """The episode records of a dump, one line at a time; each line that is not one is
    appended to `skipped` as (line number, why) instead."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                problem = f"not JSON ({err})"
            else:
                problem = record_problem(record)
            if problem is None:
                yield record
            elif skipped is not None:
                skipped.append((number, problem))


def load_episodes(path: str | Path, skipped: list[tuple[int, str]] | None = None) -> list[dict[str, Any]]:
    """The episode records of a dump as a list (`iter_episodes`)."""
    return list(iter_episodes(path, skipped))


def task_goal(episode: dict[str, Any]) -> str:
    """What an episode's task asks for, on one line (printable): the task's line that states the
    goal ("Goal: craft stick.", "Your task is to: ..."), else the env's `goal` attribute when it is
    text, else the task itself. A long task (TextCraft lists its crafting commands first) cut at
    its start would never show its goal."""
    lines = [" ".join(line.split()) for line in printable(episode.get("task") or "").splitlines()]
    lines = [line for line in lines if line]
    stated = [line for line in lines if _GOAL_LINE.match(line)]
    if stated:
        return stated[-1]
    goal = (episode.get("attributes") or {}).get("goal") if isinstance(episode.get("attributes"), dict) else None
    if isinstance(goal, str) and goal.strip():
        return f"goal: {' '.join(printable(goal).split())}"
    return " ".join(lines)


def _task(episode: dict[str, Any], width: int = 60) -> str:
    task = task_goal(episode)
    label = f"task {printable(episode.get('task_id'))}"
    return f"{label} {task[: width - 1] + '…' if len(task) > width else task}".rstrip()


def summary_line(episode: dict[str, Any], color: bool = False) -> str:
    """`episode 3 | task 17 craft 1 stick | won | 4 turns | 1 invalid | reward 1.00`."""
    style = _Style(color)
    if episode.get("failed"):
        outcome = style("env failure", YELLOW)
    elif episode.get("won"):
        outcome = style("won", GREEN, BOLD)
    else:
        outcome = style("truncated" if episode.get("truncated") else "lost", RED)
    parts = [
        f"episode {printable(episode.get('episode'))}",
        _task(episode),
        outcome,
        f"{printable(episode.get('turns_taken', len(episode.get('turns', []))))} turns",
        f"{printable(episode.get('invalid_steps', 0))} invalid",
        f"reward {episode.get('reward') or 0.0:.2f}",
    ]
    return " | ".join(parts)


def _block(label: str, text: Any, style: _Style) -> list[str]:
    lines = []
    for paragraph in printable(text).strip().splitlines() or [""]:
        lines += textwrap.wrap(paragraph, TEXT_WIDTH) or [""]
    head = style(f"{label:>12} ", DIM)
    pad = " " * 13
    return [head + lines[0]] + [pad + line for line in lines[1:]]


def render_episode(episode: dict[str, Any], color: bool = False) -> str:
    """The summary line, then each turn: observation, reply, action and the numbers."""
    style = _Style(color)
    out = [style(summary_line(episode, color), BOLD)]
    for turn in episode.get("turns", []):
        out.append(style(f"  turn {printable(turn.get('turn'))}", BOLD))
        out += _block("observation", turn.get("observation", ""), style)
        out += _block("reply", turn.get("reply", ""), style)
        action = printable(turn.get("action"))
        if not turn.get("valid", True):
            action += "  " + style("(invalid reply)", YELLOW)
        out += _block("action", action, style)
        numbers = [
            f"reward {turn.get('reward') or 0.0:.2f}",
            f"return {turn['return']:.3f}" if turn.get("return") is not None else "return –",
            f"advantage {style.signed(turn.get('advantage'))}",
        ]
        if turn.get("cluster") is not None:
            numbers.append(f"cell {printable(turn['cluster'])}")
        if turn.get("branch") is not None:
            numbers.append(f"branch {printable(turn['branch'])}")
        out.append(" " * 13 + "  ".join(numbers))
        if isinstance(turn.get("levels"), list):
            out.append(" " * 13 + _levels_line(turn["levels"], style))
        if isinstance(turn.get("gae"), dict):
            out.append(" " * 13 + _gae_line(turn["gae"], style))
    if episode.get("final_observation") is not None:  # the state the last action reached
        out += _block("end", episode["final_observation"], style)
    return "\n".join(out)


def _show(args, stream: TextIO, color: bool, skipped: list[tuple[int, str]]) -> int:
    shown = won = 0
    for episode in iter_episodes(args.file, skipped):
        if args.episode is not None and episode.get("episode") != args.episode:
            continue
        shown += 1
        won += bool(episode.get("won"))
        print(summary_line(episode, color) if args.summary else render_episode(episode, color) + "\n", file=stream)
    if skipped:
        number, why = skipped[0]
        print(f"skipped {len(skipped)} line{'s' * (len(skipped) != 1)} that {'are' if len(skipped) != 1 else 'is'} "
              f"not an episode record (first: line {number}, {why})", file=sys.stderr)
    if args.episode is not None and not shown:
        print(f"error: no episode {args.episode} in {args.file}; --summary lists them.", file=sys.stderr)
        return 2
    if not shown:
        what = "no episode record" if skipped else "no episodes (the file is empty)"
        print(f"error: {args.file} holds {what}; is this a rollout dump (<output_dir>/rollouts/*.jsonl)?", file=sys.stderr)
        return 2 if skipped else 1
    if args.episode is None and shown > 1:
        print(f"{shown} episodes, {won} won ({won / shown:.0%})", file=stream)
    return 0


def _levels_line(levels: list[dict[str, Any]], style: _Style) -> str:
    """`levels  k0 +0.412* (n 8)  k1 +0.250* (n 3)  k2 0.000 (n 1)`: * marks the levels
    HGPO's weighted mean used (n: the level's cell size)."""
    parts = [
        f"k{printable(level.get('k'))} {style.signed(level['advantage'] if _is_number(level.get('advantage')) else None)}"
        f"{'*' if level.get('used') else ''}"
        f" (n {printable(level.get('size'))})"
        for level in levels if isinstance(level, dict)
    ]
    return "levels  " + "  ".join(parts)


def _gae_line(gae: dict[str, Any], style: _Style) -> str:
    """`gae  V̄ 0.450  next 0.900  δ +0.405  Σ +0.380  penalty +0.000  group mean +0.100 std 0.300`:
    GAGPO's terms (`baselines.GaeTerms`), A^s = (Σ − penalty − mean) / (std + 1e-6); a step alone
    in its cell gets A^s = 0 and says so instead of the group's mean and std. A field of the
    wrong type shows as –."""

    def value(name: str) -> float | None:
        return gae[name] if _is_number(gae.get(name)) else None

    def plain(name: str) -> str:
        return "–" if value(name) is None else f"{value(name):.3f}"

    parts = [
        f"V̄ {plain('value')}", f"next {plain('next_value')}", f"δ {style.signed(value('delta'))}",
        f"Σ {style.signed(value('discounted_sum'))}", f"penalty {style.signed(value('penalty'))}",
    ]  # fmt: skip
    if gae.get("shared") is False:  # its group's μ and σ did not touch it
        parts.append("(alone in its cell: A^s 0)")
    else:
        parts.append(f"group mean {style.signed(value('group_mean'))} std {plain('group_std')}")
    return "gae  " + "  ".join(parts)


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bipace_trainer.reports.show", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a rollout dump: <output_dir>/rollouts/step-000010.jsonl")
    parser.add_argument("--episode", type=int, help="render only this episode id")
    parser.add_argument("--summary", action="store_true", help="one line per episode, no turns")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = parser.parse_args(argv)
    stream = stream or sys.stdout
    color = args.color == "always" or (args.color == "auto" and stream.isatty())
    try:
        return _show(args, stream, color, skipped=[])
    except OSError as err:
        if isinstance(err, BrokenPipeError):  # `show ... | head`: the reader has all it wanted
            _silence(stream)
            return 0
        print(f"error: {err}", file=sys.stderr)
        return 2


def _silence(stream: TextIO) -> None:
    """Point `stream` at /dev/null, so Python's flush at exit raises no second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a test's StringIO)
        pass


if __name__ == "__main__":
    sys.exit(main())
