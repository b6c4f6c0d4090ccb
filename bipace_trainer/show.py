"""Render a rollout dump in the terminal, episode by episode.

    python -m bipace_trainer.show outputs/run/rollouts/step-000010.jsonl
    python -m bipace_trainer.show outputs/run/rollouts/step-000010.jsonl --episode 3
    python -m bipace_trainer.show outputs/run/rollouts/step-000010.jsonl --summary

Each episode starts with a one-line summary (episode id, task, won or not, turns,
invalid replies, env reward), then every turn: the observation the env showed, the
reply, the parsed action (marked when invalid), the reward, the return R_t, and the
advantage, green when positive and red when negative, with the cell (cluster id) and
PACE branch that produced it, and under HGPO each context level's advantage (`*`: used). Files come from `--rollout_dump_steps`
(`bipace_trainer.trajectories`).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

__all__ = ["load_episodes", "summary_line", "render_episode", "main"]

RESET, BOLD, DIM, RED, GREEN, YELLOW = "\033[0m", "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m"
TEXT_WIDTH = 100


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


def load_episodes(path: str | Path) -> list[dict[str, Any]]:
    """The episode records of a dump (one JSON object per line)."""
    episodes = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                episodes.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not a JSON line ({err}); is this a rollout dump?") from None
    return episodes


def _task(episode: dict[str, Any], width: int = 60) -> str:
    task = " ".join(str(episode.get("task") or "").split())
    label = f"task {episode.get('task_id')}"
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
        f"episode {episode.get('episode')}",
        _task(episode),
        outcome,
        f"{episode.get('turns_taken', len(episode.get('turns', [])))} turns",
        f"{episode.get('invalid_steps', 0)} invalid",
        f"reward {episode.get('reward', 0.0):.2f}",
    ]
    return " | ".join(parts)


def _block(label: str, text: str, style: _Style) -> list[str]:
    lines = []
    for paragraph in str(text).strip().splitlines() or [""]:
        lines += textwrap.wrap(paragraph, TEXT_WIDTH) or [""]
    head = style(f"{label:>12} ", DIM)
    pad = " " * 13
    return [head + lines[0]] + [pad + line for line in lines[1:]]


def render_episode(episode: dict[str, Any], color: bool = False) -> str:
    """The summary line, then each turn: observation, reply, action and the numbers."""
    style = _Style(color)
    out = [style(summary_line(episode, color), BOLD)]
    for turn in episode.get("turns", []):
        out.append(style(f"  turn {turn['turn']}", BOLD))
        out += _block("observation", turn.get("observation", ""), style)
        out += _block("reply", turn.get("reply", ""), style)
        action = str(turn.get("action"))
        if not turn.get("valid", True):
            action += "  " + style("(invalid reply)", YELLOW)
        out += _block("action", action, style)
        numbers = [
            f"reward {turn.get('reward', 0.0):.2f}",
            f"return {turn['return']:.3f}" if turn.get("return") is not None else "return –",
            f"advantage {style.signed(turn.get('advantage'))}",
        ]
        if turn.get("cluster") is not None:
            numbers.append(f"cell {turn['cluster']}")
        if turn.get("branch") is not None:
            numbers.append(f"branch {turn['branch']}")
        out.append(" " * 13 + "  ".join(numbers))
        if turn.get("levels"):
            out.append(" " * 13 + _levels_line(turn["levels"], style))
    return "\n".join(out)


def _levels_line(levels: list[dict[str, Any]], style: _Style) -> str:
    """`levels  k0 +0.412* (n 8)  k1 +0.250* (n 3)  k2 0.000 (n 1)`: * marks the levels
    HGPO's weighted mean used (n: the level's cell size)."""
    parts = [
        f"k{level.get('k')} {style.signed(level.get('advantage'))}{'*' if level.get('used') else ''} (n {level.get('size')})"
        for level in levels
    ]
    return "levels  " + "  ".join(parts)


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bipace_trainer.show", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a rollout dump: <output_dir>/rollouts/step-000010.jsonl")
    parser.add_argument("--episode", type=int, help="render only this episode id")
    parser.add_argument("--summary", action="store_true", help="one line per episode, no turns")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = parser.parse_args(argv)
    stream = stream or sys.stdout
    color = args.color == "always" or (args.color == "auto" and stream.isatty())
    try:
        episodes = load_episodes(args.file)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.episode is not None:
        episodes = [e for e in episodes if e.get("episode") == args.episode]
        if not episodes:
            print(f"error: no episode {args.episode} in {args.file}; --summary lists them.", file=sys.stderr)
            return 2
    for episode in episodes:
        print(summary_line(episode, color) if args.summary else render_episode(episode, color) + "\n", file=stream)
    if args.episode is None and len(episodes) > 1:
        won = sum(bool(e.get("won")) for e in episodes)
        print(f"{len(episodes)} episodes, {won} won ({won / len(episodes):.0%})", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
