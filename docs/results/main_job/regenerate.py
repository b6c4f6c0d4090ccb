"""Writes what the docs say of the main job (`python train.py`) from one recorded run, so that the README's
summary, the quickstart's and the quickstart's account of that run cannot disagree with each other, with
the run, or with the code that prints the summary (tests/test_docs.py fails when a block is stale).

    python train.py --summary_file /tmp/summary.json         # the README's command, plus where its summary goes
    python docs/results/main_job/regenerate.py record outputs/smollm2-textcraft-bipace_q /tmp/summary.json \\
        --load "13-15" --command "python train.py"             # keep that run here: its files and how it ran
    python docs/results/main_job/regenerate.py                 # rewrite the blocks from the kept run
    python docs/results/main_job/regenerate.py --check         # exit 1 if a block is stale

The kept run, in this folder: `summary.json` (what train.py's `--summary_file` writes: the summary's data,
paths shortened to the repository's), `eval_results.json` (its evaluations), `learning_curve.png` and
`run.json` (date, machine, load, command, commit). Each block sits between `<!-- generated: ... -->` and
`<!-- end generated -->`; the summary inside is printed by `cli.run_end.print_summary` itself.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
README, QUICKSTART = ROOT / "README.md", ROOT / "docs" / "quickstart.md"
MARK = "<!-- generated: {name}; python docs/results/main_job/regenerate.py -->"
END = "<!-- end generated -->"


def kept_run() -> dict:
    """The kept run's summary, evaluations and provenance."""
    return {name: json.loads((HERE / f"{name}.json").read_text()) for name in ("summary", "eval_results", "run")}


def summary_text(summary: dict) -> str:
    """The summary as train.py prints it (`run_end.print_summary`), from its first line."""
    from bipace_trainer.cli.run_end import print_summary

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(summary, summary.get("warm_start"), cut=bool(summary.get("stopped")))
    return out.getvalue().lstrip("\n")


def held_out_sentence(summary: dict) -> str:
    before, after = summary["before"], summary["after"]
    moved = after["successes"] - before["successes"]
    overlap = before["ci95"][1] >= after["ci95"][0] and after["ci95"][1] >= before["ci95"][0]
    change = (f"{before['successes']} → {after['successes']} of {after['episodes']} is {abs(moved)} "
              f"episode{'s' * (abs(moved) != 1)}") if moved else f"{after['successes']} of {after['episodes']} before and after"
    return change + (", inside either interval: not a measured change" if overlap else "")


def readme_block(kept: dict) -> str:
    summary = kept["summary"]
    return (f"```\n{summary_text(summary)}```\nIt shows a policy that acts and RL steps with signal; "
            f"{held_out_sentence(summary)} ([Quickstart](docs/quickstart.md)).")


def provenance(kept: dict) -> str:
    run = kept["run"]
    return (f"Recorded {run['date']} on {run['machine']} at a load average of {run['load']}, by `{run['command']}` "
            f"(commit {run['commit']}; the run's files: `docs/results/main_job/`).")


def quickstart_block(kept: dict) -> str:
    return f"```\n{summary_text(kept['summary'])}```\n\n{provenance(kept)}"


def step_sentence(row: dict, group: int) -> str:
    """'step 2's first goal was won by none of its 4 rollouts, ... which won 3 of 4 (advantage std 1.23)'."""
    won = round(row["batch_success"] * group)
    std = f"advantage std {row['advantage_std']:.3f}" if "advantage_std" in row else "advantage std not logged"
    resamples = round(row.get("resamples", 0.0))
    if row.get("skipped"):
        outcome = "every rollout lost" if row.get("played_success", row["batch_success"]) == 0 else "no goal split its rollouts"
        return f"step {row['step']} played {resamples + 1} goals and {outcome}: no signal, so its update was skipped"
    if not resamples:
        return f"step {row['step']} won {won} of {group} ({std})"
    earlier = round(row.get("played_success", row["batch_success"]) * group * (resamples + 1)) - won
    first = "none" if earlier == 0 else "all" if earlier == group * resamples else f"{earlier} of {group * resamples}"
    again = "again on another goal" if resamples == 1 else f"on {resamples} more goals"
    return f"step {row['step']}'s goal was won by {first} of its rollouts, so it was played {again}, which won {won} of {group} ({std})"


def story_block(kept: dict, group: int = 4) -> str:
    """The account of the kept run: its held-out episodes, its RL steps and its time."""
    summary, evaluations = kept["summary"], kept["eval_results"]
    before, after = summary["before"], summary["after"]
    steps = [step_sentence(row, group) for row in summary["curve"]]
    all_won = [row["step"] for row in summary["curve"] if row["batch_success"] == 1.0 and not row.get("skipped")]
    seconds = [f"{e['seconds']:.0f} s" for e in evaluations if "seconds" in e]
    lines = [
        f"- The warm-started policy acts and wins on goals it never saw: valid actions {before['valid_action_rate']:.2f}, "
        f"{before['successes']} of the {before['episodes']} held-out goals crafted before RL.",
        f"- The RL steps: {'; '.join(steps)}; "
        f"{sum(not row.get('skipped') for row in summary['curve'])} of {len(steps)} updates taken."
        + (f" Step {' and '.join(map(str, all_won))} won every episode and still trained: `{summary['preset']}`"
           " discounts the return (γ < 1), so a shorter win scores more than a longer one, and those small"
           " differences are the only advantages left." if all_won else ""),
        f"- Held-out success: {before['successes']} of {before['episodes']} before RL, {after['successes']} of "
        f"{after['episodes']} after; {held_out_sentence(summary)}. `bipace-eval {summary['output_dir']}` plays the "
        "final evaluation again (the same goals, seed and sampling: the same figure); `--seeds 123 456 789` plays "
        "three more seeds, which a measured change would need.",
        f"- Time: {summary['seconds']['wall']:.0f} s wall, {summary['seconds']['cpu']:.0f} s CPU, the two evaluations "
        f"{' and '.join(seconds)} of it. {provenance(kept)}",
    ]
    return "\n".join(lines)


BLOCKS = {  # (page, block name) -> how it is written
    (README, "main-job summary"): readme_block,
    (QUICKSTART, "main-job summary"): quickstart_block,
    (QUICKSTART, "main-job story"): story_block,
}


def rewritten(page: Path, kept: dict) -> str:
    """`page` with each of its blocks written from `kept`."""
    text = page.read_text()
    for (where, name), write in BLOCKS.items():
        if where != page:
            continue
        mark = MARK.format(name=name)
        pattern = re.compile(re.escape(mark) + r"\n.*?" + re.escape(END), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{page.relative_to(ROOT)}: no block `{mark}` ... `{END}` to write")
        text = pattern.sub(lambda _: f"{mark}\n{write(kept)}\n{END}", text)
    return text


def stale_pages() -> list[Path]:
    kept = kept_run()
    return [page for page in (README, QUICKSTART) if page.read_text() != rewritten(page, kept)]


def shortened(value, prefix: str):
    """`value` (JSON) with every string's absolute repository path made relative (the docs' paths)."""
    if isinstance(value, dict):
        return {key: shortened(item, prefix) for key, item in value.items()}
    if isinstance(value, list):
        return [shortened(item, prefix) for item in value]
    return value.replace(prefix, "") if isinstance(value, str) else value


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{os.cpu_count()} cores of an {model} ({vector})"


def record(output_dir: Path, summary_file: Path, load: str, command: str, commit: str | None = None) -> None:
    """Keep a finished main-job run here: its summary, evaluations and curve, and how it ran."""
    summary = shortened(json.loads(summary_file.read_text()), str(ROOT) + "/")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.copy(output_dir / "eval_results.json", HERE / "eval_results.json")
    shutil.copy(output_dir / "learning_curve.png", HERE / "learning_curve.png")
    commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d", time.gmtime(summary_file.stat().st_mtime))
    run = {"date": date, "machine": machine(), "load": load, "command": command, "commit": commit}
    (HERE / "run.json").write_text(json.dumps(run, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale; write nothing")
    commands = parser.add_subparsers(dest="action")
    keep = commands.add_parser("record", help="keep a finished main-job run here")
    keep.add_argument("output_dir", type=Path)
    keep.add_argument("summary_file", type=Path)
    keep.add_argument("--load", required=True, help="the load average while it ran, e.g. 13-15")
    keep.add_argument("--command", default="python train.py", help="what ran it")
    keep.add_argument("--commit", help="the commit whose code ran (default: HEAD)")
    args = parser.parse_args(argv)
    if args.action == "record":
        record(args.output_dir, args.summary_file, args.load, args.command, args.commit)
    if args.check:
        stale = stale_pages()
        print("\n".join(f"{page.relative_to(ROOT)} is stale: run python docs/results/main_job/regenerate.py"
                        for page in stale) or "current")  # fmt: skip
        return 1 if stale else 0
    kept = kept_run()
    for page in (README, QUICKSTART):
        page.write_text(rewritten(page, kept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
