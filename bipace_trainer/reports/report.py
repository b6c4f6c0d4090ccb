"""One self-contained HTML page per run: learning curves, evaluations, and every dumped step with its credit.

    bipace-report outputs/my-run                      # writes outputs/my-run/report.html
    python -m bipace_trainer.reports.report outputs/my-run -o /tmp/page.html --env textcraft

What the page reads from the run's output directory (nothing else, no network):
- `trainer_state.json` (the directory's, else its newest `checkpoint-*/`): TRL's `log_history`,
  from which `run_summary.learning_curve` takes training-batch success, success over every
  rollout played, valid-action rate and loss, plus the estimator's diagnostics
  (`estimator/*`, `advantage/*`, docs/concepts/math.md#diagnostics);
- `eval_results.json` (`trainer.eval_history`): the held-out evaluations, drawn on the curve
  with their 95% Wilson interval and listed in a table per task type;
- `bipace_eval*.json`, there or in `bipace_eval/` (what `bipace-eval` writes): its tables;
- `bipace_run.json` (train.py's record of the run): the page's title (model, env, preset);
- `rollouts/*.jsonl` (`--rollout_dump_steps`, format in `trajectories`): every episode, each
  turn with its observation, reply, parsed action, reward, return R_t and advantage, coloured
  by the advantage's sign and size. Clicking a step lists the other steps of its cell (the
  state partition's cell, the steps its baseline compared it with); the PACE branch, GAGPO's
  GAE terms (V̄, next V̄, δ, their discounted sum, the centred penalty, the group's mean and
  std), HGPO's context levels (per level k: its cell, the cell's size, a_k, whether it entered
  the weighted mean) and any other per-turn field a dump carries are shown, and after the last turn what
  the env returned after the last action (`end`). Filters select episodes by dump (the step), outcome
  and task type.

The curves are plotly figures whose JavaScript is inlined once (`plotly.offline.get_plotlyjs`),
so the page opens offline. Every env or model text is HTML-escaped with its control characters
made visible: an observation may hold markup, and a model's reply anything.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from .run_summary import eval_marker, evaluation_summary, intervals_overlap, learning_curve
from .show import load_episodes, printable, task_goal

__all__ = [
    "REPORT_FILE",
    "escape_text",
    "load_log_history",
    "load_eval_history",
    "load_dumps",
    "curve_figures",
    "build_report",
    "write_report",
    "main",
]

REPORT_FILE = "report.html"
DUMP_DIR = "rollouts"
RUN_RECORD = "bipace_run.json"  # train.py's record of the run (`run.run_dir.RUN_FILE`): its title
# Log keys drawn as the estimator's diagnostics (docs/concepts/math.md#diagnostics), one small panel each.
DIAGNOSTIC_PREFIXES = ("estimator/", "advantage/")
# The task attributes an env reports success by (`TextEnv.report_key` of the shipped envs), in the
# order the filter prefers them when the page is not told the env.
KNOWN_TYPE_KEYS = ("task_type", "category", "task_name", "depth", "distance")
# Per-turn fields the page lays out itself (a column, or a block of the credit column: branch, GAE
# terms, HGPO levels); any other field a dump carries is listed as it is.
TURN_COLUMNS = ("turn", "observation", "prompt_tail", "reply", "action", "valid", "reward", "return", "advantage",
                "cluster", "branch", "gae", "levels", "done")  # fmt: skip
# A step's GAE terms (`trajectories.GAE_FIELDS`) in the order and format the credit column shows them.
GAE_LABELS = (("value", "V̄", ".3f"), ("next_value", "next V̄", ".3f"), ("delta", "δ", "+.3f"),
              ("discounted_sum", "Σ(γλ)ᵏδ", "+.3f"), ("penalty", "penalty", "+.3f"),
              ("group_mean", "group mean", "+.3f"), ("group_std", "group std", ".3f"))  # fmt: skip
# Beyond this many episodes per dump the page shows the first ones and says so (a recipe's dump
# holds 128 episodes of up to 50 turns; a page of 15 such dumps would not open).
DEFAULT_MAX_EPISODES = 256
# The diagnostics grid's top margin (px): room for plotly's toolbar (~28 px, shown on hover at the
# top right) above the first row's panel titles, which it covered in a margin of 30.
GRID_TOP_MARGIN = 64


# ---------------------------------------------------------------------------------------------- reading


def escape_text(value: Any) -> str:
    """`value` as HTML text: markup escaped, and control characters (bidirectional overrides such
    as U+202E, which would show the text after them reversed, included) made visible as `show`
    makes them (`show.printable`: `\\x1b`, `\\u202e`); lone surrogates replaced."""
    return "" if value is None else html.escape(printable(value), quote=True)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not readable JSON ({err}); remove it or rerun the step that writes it.") from None


def load_log_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """TRL's `log_history` of the run: `<output_dir>/trainer_state.json`, else the newest checkpoint's; [] if none."""
    output_dir = Path(output_dir)
    candidates = [output_dir / "trainer_state.json"]
    checkpoints = sorted(output_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: _checkpoint_step(p.parent))
    candidates += reversed(checkpoints)
    for path in candidates:
        if path.is_file():
            return list(_read_json(path).get("log_history", []))
    return []


def recorded_title(output_dir: str | Path) -> str | None:
    """The title train.py gave the run (`bipace_run.json`'s "title": model, env, preset), or None."""
    try:
        record = json.loads((Path(output_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    title = record.get("title") if isinstance(record, dict) else None
    return title if isinstance(title, str) else None


def _checkpoint_step(folder: Path) -> int:
    tail = folder.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def load_eval_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """`<output_dir>/eval_results.json` (the trainer's `eval_history`), or []."""
    path = Path(output_dir) / "eval_results.json"
    return list(_read_json(path)) if path.is_file() else []


def load_dumps(output_dir: str | Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """(file name, episodes) of every rollout dump, training dumps in step order, then evaluations."""
    folder = Path(output_dir) / DUMP_DIR
    paths = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    paths.sort(key=lambda p: (p.name.startswith("eval-"), _dump_step(p.name), p.name))
    return [(path.name, load_episodes(path)) for path in paths]


def _dump_step(name: str) -> int:
    match = re.search(r"step-(\d+)", name)
    return int(match.group(1)) if match else -1


def load_bench_evaluations(output_dir: str | Path) -> list[dict[str, Any]]:
    """What `bipace-eval` wrote for the run (`bipace_eval*.json` in `output_dir`, or in its `bipace_eval/`
    folder, where `bipace-eval RUN_DIR` writes by default), if anything."""
    output_dir = Path(output_dir)
    paths = sorted(output_dir.glob("bipace_eval*.json")) + sorted(output_dir.glob("bipace_eval/bipace_eval*.json"))
    return [_read_json(path) | {"file": str(path.relative_to(output_dir))} for path in paths]


# ---------------------------------------------------------------------------------------------- curves


def diagnostic_series(log_history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """{log key: [(step, value)]} of the estimator's diagnostics (`DIAGNOSTIC_PREFIXES`) per logged RL step."""
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in log_history:
        if "episode/success_rate" not in entry:
            continue
        for key, value in entry.items():
            if key.startswith(DIAGNOSTIC_PREFIXES) and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, []).append((int(entry["step"]), float(value)))
    return dict(sorted(series.items()))


def _held_out_traces(eval_history: Sequence[dict[str, Any]]) -> list[Any]:
    """One scatter of held-out success with its 95% interval per evaluation occasion, in run order."""
    import plotly.graph_objects as go

    traces = []
    for tag in dict.fromkeys(e.get("tag", "") for e in eval_history):
        summaries = [(e, evaluation_summary(e)) for e in eval_history if e.get("tag", "") == tag]
        summaries = [(e, s) for e, s in summaries if s is not None]
        if not summaries:
            continue
        traces.append(
            go.Scatter(
                x=[e.get("step", 0) for e, _ in summaries],
                y=[s["success_rate"] for _, s in summaries],
                mode="markers",
                marker={"symbol": eval_marker(tag, 1), "size": 10},  # "before" and "final" read apart
                name=f"held-out success ({tag}, 95% CI)",
                error_y={
                    "type": "data", "symmetric": False,
                    "array": [s["ci95"][1] - s["success_rate"] for _, s in summaries],
                    "arrayminus": [s["success_rate"] - s["ci95"][0] for _, s in summaries],
                },
                text=[f"{s['successes']} of {s['episodes']} episodes ({e.get('split', '')})" for e, s in summaries],
            )
        )
    return traces


def curve_figures(log_history: Sequence[dict[str, Any]], eval_history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{title: plotly Figure}: the rates (training-batch success, success over every rollout played,
    valid-action rate, held-out success with its 95% interval), the loss, and the diagnostics."""
    import plotly.graph_objects as go

    curve = learning_curve(log_history)
    figures: dict[str, Any] = {}
    rates = go.Figure()
    lines = (("batch_success", "training-batch success"), ("played_success", "success of every rollout played"),
             ("valid_rate", "valid-action rate"))  # fmt: skip
    for column, label in lines:
        points = [(row["step"], row[column]) for row in curve if column in row]
        if points:
            x, y = zip(*points)
            rates.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=label))
    for trace in _held_out_traces(eval_history):
        rates.add_trace(trace)
    if rates.data:
        rates.update_layout(yaxis={"range": [-0.05, 1.05], "title": "rate"})
        overlap = intervals_overlap(eval_history)
        if overlap:  # two held-out points that look apart may differ by chance alone
            rates.add_annotation(text=overlap, xref="paper", yref="paper", x=1, y=0, xanchor="right", yanchor="bottom",
                                 showarrow=False, font={"size": 11}, bgcolor="rgba(255,255,255,0.8)")
        figures["Success and valid actions"] = rates
    losses = [(row["step"], row["loss"]) for row in curve if "loss" in row]
    if losses:
        loss = go.Figure(go.Scatter(x=[s for s, _ in losses], y=[v for _, v in losses], mode="lines+markers", name="loss"))
        loss.update_layout(yaxis={"title": "loss"}, showlegend=False)
        figures["Loss"] = loss
    series = diagnostic_series(log_history)
    if series:
        figures["Estimator diagnostics"] = _diagnostics_grid(series)
    short = bool(curve) and curve[-1]["step"] <= 20  # a short run: whole steps only on the axes
    for name, figure in figures.items():
        # the grid's first row of panel titles sits in the top margin, below the toolbar (not under it)
        top = GRID_TOP_MARGIN if name == "Estimator diagnostics" else 30
        figure.update_layout(template="plotly_white", margin={"l": 50, "r": 20, "t": top, "b": 40})
        if short:
            figure.update_xaxes(dtick=1)
        if name != "Estimator diagnostics":  # its panels are small: their titles say what they show
            figure.update_xaxes(title_text="RL optimizer step")
    return figures


def _diagnostics_grid(series: dict[str, list[tuple[int, float]]]):
    """One small panel per diagnostic, each on its own y axis. A constant series (a calibrated ε
    of 0.00066) would sit on plotly's default ±1 axis and read as 0: its axis is drawn around its
    value instead, and its title says the value."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    columns = 3
    rows = -(-len(series) // columns)
    titles = [f"{key} = {points[0][1]:.3g} (constant)" if _constant(points) else key for key, points in series.items()]
    grid = make_subplots(rows=rows, cols=columns, subplot_titles=titles, vertical_spacing=0.5 / rows)
    for i, (key, points) in enumerate(series.items()):
        where = {"row": i // columns + 1, "col": i % columns + 1}
        grid.add_trace(go.Scatter(x=[s for s, _ in points], y=[v for _, v in points], mode="lines+markers", name=key), **where)
        if _constant(points):
            value = points[0][1]
            half = abs(value) / 2 or 1.0
            grid.update_yaxes(range=[value - half, value + half], **where)
    grid.update_layout(height=max(260, 190 * rows) + GRID_TOP_MARGIN - 30, showlegend=False)
    grid.update_annotations(font_size=11)
    return grid


def _constant(points: Sequence[tuple[int, float]]) -> bool:
    return len({value for _, value in points}) == 1


# ---------------------------------------------------------------------------------------------- tables


def _number(value: Any, fmt: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else escape_text(value)


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]], css: str = "data") -> str:
    """An HTML table; `rows` hold HTML already escaped."""
    head = "".join(f"<th>{escape_text(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def evaluation_table(eval_history: Sequence[dict[str, Any]]) -> str:
    """One row per evaluation: occasion, split, step, episodes, success with its 95% interval,
    valid-action rate, WebShop's score, mean length, env failures, then success per task type."""
    types = sorted({key for e in eval_history for key in e.get("per_type", {})})
    headers = ["occasion", "split", "step", "episodes", "success (95% CI)", "valid actions", "score", "length",
               "env failures", *types]  # fmt: skip
    rows = []
    for e in eval_history:
        summary = evaluation_summary(e)
        success = "–"
        if summary:
            low, high = summary["ci95"]
            success = f"{summary['success_rate']:.3f} ({summary['successes']}/{summary['episodes']}, {low:.2f}–{high:.2f})"
        rows.append([
            escape_text(e.get("tag")), escape_text(e.get("split")), _number(e.get("step"), "d"),
            _number(e.get("num_tasks"), "d"), success, _number(e.get("valid_action_rate"), ".2f"),
            _number(e.get("score")), _number(e.get("episode_length"), ".2f"), _number(e.get("env_failures"), "d"),
            *(_number(e.get("per_type", {}).get(t)) for t in types),
        ])  # fmt: skip
    return _table(headers, rows)


def bench_evaluation_html(result: dict[str, Any]) -> str:
    """A `bipace-eval` result: its Markdown table, as written, in a <pre> (the file is the reference)."""
    title = escape_text(f"{result.get('file', '')}: {', '.join(m.get('label', '') for m in result.get('models', []))}")
    return f"<h3>{title}</h3><pre class=\"md\">{escape_text(result.get('markdown', ''))}</pre>"


# ---------------------------------------------------------------------------------------------- episodes


def type_key(episodes: Iterable[dict[str, Any]], preferred: str | None = None) -> str | None:
    """The task attribute the page filters by: `preferred` (the env's `report_key`) if episodes carry it,
    else the first of `KNOWN_TYPE_KEYS` they carry, else the attribute with the fewest distinct values."""
    values: dict[str, set] = {}
    for episode in episodes:
        for key, value in (episode.get("attributes") or {}).items():
            if isinstance(value, (str, int, float, bool)):
                values.setdefault(key, set()).add(value)
    for key in (preferred, *KNOWN_TYPE_KEYS):
        if key and key in values:
            return key
    few = [(len(v), k) for k, v in values.items() if 1 < len(v) <= 30]
    return min(few)[1] if few else None


def outcome(episode: dict[str, Any]) -> str:
    """won, lost, truncated (the turn budget ran out) or env failure."""
    if episode.get("failed"):
        return "env failure"
    if episode.get("won"):
        return "won"
    return "truncated" if episode.get("truncated") else "lost"


def advantage_style(advantage: Any, scale: float) -> str:
    """Background by sign (green +, red −) and size (opacity ∝ |A|/scale, capped): an inline style."""
    if not isinstance(advantage, (int, float)) or not math.isfinite(advantage) or advantage == 0 or scale <= 0:
        return ""
    strength = min(abs(advantage) / scale, 1.0)
    red, green, blue = (46, 160, 67) if advantage > 0 else (215, 58, 73)
    return f"background-color: rgba({red},{green},{blue},{0.10 + 0.45 * strength:.3f})"


def _advantage_scale(episodes: Sequence[dict[str, Any]]) -> float:
    """The 95th percentile of |A| over a dump's steps: one large advantage does not wash out the others."""
    values = sorted(
        abs(t["advantage"]) for e in episodes for t in e.get("turns", [])
        if isinstance(t.get("advantage"), (int, float)) and math.isfinite(t["advantage"]) and t["advantage"]
    )  # fmt: skip
    return values[min(len(values) - 1, int(0.95 * len(values)))] if values else 0.0


def _pre(value: Any, css: str = "") -> str:
    return f'<pre class="{css}">{escape_text(value)}</pre>'


def gae_html(gae: Any) -> str:
    """GAGPO's terms of a step (`baselines.GaeTerms`) as one block of the credit column (a step alone
    in its cell says so instead of its group's μ and σ); a dump's `gae` that is not an object is
    shown as it is, a field of the wrong type as its escaped text."""
    if not isinstance(gae, dict):
        return f'<div class="credit">gae {escape_text(gae)}</div>'
    alone = gae.get("shared") is False  # its group's μ and σ did not touch it
    labels = GAE_LABELS[:-2] if alone else GAE_LABELS
    terms = ", ".join(f"{label} {_number(gae.get(name), fmt)}" for name, label, fmt in labels)
    title = "A^s = (Σ(γλ)ᵏδ − penalty − group mean) / (group std + 1e-6); δ = r + γ·next V̄ − V̄"
    note = "; alone in its cell: A<sup>s</sup> 0" if alone else ""
    return f'<div class="credit gae" title="{escape_text(title)}">GAE: {terms}{note}</div>'


def _whole(value: Any) -> str:
    """An integer field (level, cell, size) as text: `–` when missing, escaped text when not an integer."""
    if value is None:
        return "–"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else escape_text(value)


def _level_text(level: Any) -> str:
    """`k1: cell 4, n 3, a +0.250, used` (HTML text): one context level of a step under HGPO."""
    if not isinstance(level, dict):
        return escape_text(level)
    used = level.get("used")
    use = "used" if used is True else "not used" if used is False else "–" if used is None else escape_text(used)
    return (f"k{_whole(level.get('k'))}: cell {_whole(level.get('cell'))}, n {_whole(level.get('size'))}, "
            f"a {_number(level.get('advantage'), '+.3f')}, {use}")  # fmt: skip


def levels_html(levels: Any) -> str:
    """HGPO's context levels of a step (`trajectories`' `levels`: per level k its cell, the cell's size n,
    the level's advantage a_k, whether it entered the weighted mean) as one block of the credit column,
    a line per level; a dump's `levels` that is not a list is shown as it is, a wrong-typed field as its
    escaped text. `data-text` is the block on one line, for the peers list."""
    if not isinstance(levels, list):
        return f'<div class="credit">levels {escape_text(levels)}</div>'
    lines = [_level_text(level) for level in levels] or ["none"]
    title = "A = Σ w_k·a_k / Σ w_k over the used levels, w_k = (k + offset)^α; a_k: advantage in the level-k cell of n steps"
    return (f'<div class="credit levels" title="{escape_text(title)}" data-text="HGPO levels: {"; ".join(lines)}">'
            f'HGPO levels:<br>{"<br>".join(lines)}</div>')  # fmt: skip


def turn_row(turn: dict[str, Any], ids: dict[str, str], scale: float) -> str:
    """One turn as a <tr>: its cell key (dump, rank, cell) in `data-cell`, its advantage as colour."""
    cell = turn.get("cluster")
    cell_key = f"{ids['dump']}:{ids['rank']}:{cell}" if cell is not None else ""
    extras = {k: v for k, v in turn.items() if k not in TURN_COLUMNS}
    details = [f'<div class="credit">branch {escape_text(turn["branch"])}</div>'] if turn.get("branch") is not None else []
    details += [gae_html(turn["gae"])] if turn.get("gae") is not None else []
    details += [levels_html(turn["levels"])] if turn.get("levels") is not None else []
    details += [f'<div class="credit">{escape_text(k)} {_number(v) if isinstance(v, float) else escape_text(v)}</div>'
                for k, v in extras.items()]  # fmt: skip
    action = escape_text(turn.get("action"))
    if not turn.get("valid", True):
        action += ' <span class="invalid">invalid reply</span>'
    advantage = turn.get("advantage")
    cells = [
        f'<td class="num">{_number(turn.get("turn"), "d")}</td>',
        f"<td>{_pre(turn.get('observation'), 'obs')}</td>",
        f"<td>{_pre(turn.get('reply'), 'reply')}</td>",
        f'<td class="action">{action}</td>',
        f'<td class="num">{_number(turn.get("reward"), ".2f")}</td>',
        f'<td class="num">{_number(turn.get("return"))}</td>',
        f'<td class="num adv">{_number(advantage, "+.3f")}</td>',
        f'<td class="num">{escape_text(cell) if cell is not None else "–"}</td>',
        f'<td class="small">{"".join(details) or "–"}</td>',
    ]
    attrs = (
        f'class="step{" has-cell" if cell_key else ""}" id="{ids["step"]}" data-cell="{escape_text(cell_key)}" '
        f'data-label="{escape_text(ids["label"])}" style="{advantage_style(advantage, scale)}"'
    )
    return f"<tr {attrs}>{''.join(cells)}</tr>"


def _goal(episode: dict[str, Any], width: int = 80) -> str:
    """The task's goal for an episode's summary line (`show.task_goal`), cut at `width`, as HTML text."""
    goal = task_goal(episode)
    return html.escape(goal[: width - 1] + "…" if len(goal) > width else goal, quote=True)


def episode_html(episode: dict[str, Any], dump_index: int, dump_name: str, key: str | None, scale: float) -> str:
    """One episode as a <details>: a summary line (the task's goal in it), the whole task, then one row per turn."""
    number = episode.get("episode")
    anchor = f"e{dump_index}-{escape_text(episode.get('rank', 0))}-{escape_text(number)}"
    kind = "" if key is None else f"{key}={(episode.get('attributes') or {}).get(key)}"
    result = outcome(episode)
    summary = " · ".join([
        escape_text(dump_name.removesuffix(".jsonl")), f"episode {escape_text(number)}",
        f"task {escape_text(episode.get('task_id'))}", f'<span class="goal">{_goal(episode)}</span>',
        escape_text(kind), f'<span class="outcome {result.replace(" ", "-")}">{result}</span>',
        f"{escape_text(episode.get('turns_taken', len(episode.get('turns', []))))} turns",
        f"{escape_text(episode.get('invalid_steps', 0))} invalid", f"reward {_number(episode.get('reward'), '.2f')}",
    ])  # fmt: skip
    rows = []
    for turn in episode.get("turns", []):
        ids = {
            "dump": str(dump_index), "rank": str(episode.get("rank", 0)), "step": f"{anchor}-t{turn.get('turn')}",
            "label": f"{dump_name.removesuffix('.jsonl')}, episode {number}, turn {turn.get('turn')}",
        }  # fmt: skip
        rows.append(turn_row(turn, ids, scale))
    head = "".join(f"<th>{h}</th>" for h in ("turn", "observation", "reply", "action", "reward", "return R<sub>t</sub>",
                                             "advantage", "cell", "credit"))  # fmt: skip
    failure = f'<p class="failure">env failure: {escape_text(episode.get("failure"))}</p>' if episode.get("failure") else ""
    end = episode.get("final_observation")  # what the env returned after the last action
    end = f'<p class="end">end: {_pre(end, "obs")}</p>' if end is not None else ""
    return (
        f'<details class="episode" id="{anchor}" data-dump="{dump_index}" data-outcome="{escape_text(result)}" '
        f'data-type="{escape_text(kind)}"><summary>{summary}</summary>'
        f'<p class="task">{escape_text(episode.get("task"))}</p>{failure}'
        f'<table class="turns"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>{end}</details>'
    )


def episodes_section(dumps: Sequence[tuple[str, list[dict[str, Any]]]], key: str | None, max_episodes: int) -> str:
    """The filters and every dumped episode (at most `max_episodes` per dump; 0 = all)."""
    if not dumps:
        return ("<p>No rollout dumps in this run: train with <code>--rollout_dump_steps N</code> to record every "
                "N-th step's episodes and every evaluation's.</p>")  # fmt: skip
    parts, notes, kinds, outcomes = [], [], Counter(), Counter()
    for index, (name, episodes) in enumerate(dumps):
        shown = episodes[:max_episodes] if max_episodes else episodes
        if len(shown) < len(episodes):
            notes.append(f"{escape_text(name)}: the first {len(shown)} of {len(episodes)} episodes (--max_episodes)")
        scale = _advantage_scale(shown)
        for episode in shown:
            kinds[f"{key}={(episode.get('attributes') or {}).get(key)}" if key else ""] += 1
            outcomes[outcome(episode)] += 1
            parts.append(episode_html(episode, index, name, key, scale))

    def options(values: Iterable[tuple[str, str]]) -> str:
        return '<option value="">all</option>' + "".join(
            f'<option value="{escape_text(v)}">{escape_text(label)}</option>' for v, label in values
        )

    dump_options = options((str(i), f"{name.removesuffix('.jsonl')} ({len(e)} episodes)") for i, (name, e) in enumerate(dumps))
    outcome_options = options((o, f"{o} ({n})") for o, n in sorted(outcomes.items()))
    type_options = options((k, f"{k} ({n})") for k, n in sorted(kinds.items()) if k)
    filters = (
        '<div class="filters">'
        f'<label>step (dump) <select id="filter-dump">{dump_options}</select></label>'
        f'<label>outcome <select id="filter-outcome">{outcome_options}</select></label>'
        f'<label>task type <select id="filter-type">{type_options}</select></label>'
        '<label><input type="checkbox" id="filter-open"> open all shown</label>'
        f'<span id="shown-count">{len(parts)} of {len(parts)} episodes shown</span></div>'
    )
    note = "".join(f'<p class="note">{n}</p>' for n in notes)
    return filters + note + f'<div id="episodes">{"".join(parts)}</div>'


# ---------------------------------------------------------------------------------------------- page

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table.data { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
table.data td, table.data th { border: 1px solid #ddd; padding: .25em .5em; text-align: right; }
.figure { margin-bottom: 1em; }
.filters { position: sticky; top: 0; background: #fafafa; padding: .5em; border: 1px solid #ddd; z-index: 2;
           display: flex; gap: 1.2em; flex-wrap: wrap; align-items: center; font-size: .9em; }
details.episode { border: 1px solid #ddd; margin: .4em 0; border-radius: 4px; }
details.episode > summary { padding: .35em .6em; cursor: pointer; background: #f6f8fa; font-size: .9em; }
.outcome.won { color: #1a7f37; font-weight: bold; } .outcome.lost, .outcome.truncated { color: #cf222e; }
.outcome.env-failure { color: #9a6700; } .goal { color: #333; }
p.task { margin: .4em .6em; font-size: .85em; color: #555; white-space: pre-wrap; }
table.turns { border-collapse: collapse; width: 100%; font-size: .8em; table-layout: fixed; }
table.turns th { background: #eee; text-align: left; padding: .2em .4em; }
table.turns th:nth-child(1) { width: 3em; } table.turns th:nth-child(2), table.turns th:nth-child(3) { width: 28%; }
table.turns th:nth-child(4) { width: 12%; } table.turns th:nth-child(5) { width: 4.5em; }
table.turns th:nth-child(6), table.turns th:nth-child(7) { width: 6em; } table.turns th:nth-child(8) { width: 3.5em; }
table.turns th:nth-child(9) { width: 9em; }
table.turns td { border-top: 1px solid #e5e5e5; padding: .2em .4em; vertical-align: top; overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } td.small { font-size: .9em; color: #444; }
pre { margin: 0; white-space: pre-wrap; font-size: .95em; max-height: 14em; overflow: auto; }
tr.step.has-cell { cursor: pointer; } tr.step.selected { outline: 2px solid #0969da; }
tr.step.peer { outline: 2px dashed #0969da; } tr.step.flash { outline: 3px solid #bf8700; }
tr.peers td { background: #f0f6ff; border-left: 3px solid #0969da; }
tr.peers a { cursor: pointer; color: #0969da; text-decoration: underline; }
.invalid { color: #9a6700; font-size: .85em; } .note { color: #666; font-size: .85em; }
.legend span { padding: 0 .4em; margin-right: .3em; border-radius: 3px; }
pre.md { background: #f6f8fa; padding: .6em; max-height: none; }
"""

# Plain DOM code, no library: filters, and a click on a step lists its cell's other steps. Text is
# copied with textContent only, never parsed as HTML.
_SCRIPT = """
(function () {
  const steps = Array.from(document.querySelectorAll('tr.step'));
  const byCell = new Map();
  for (const row of steps) {
    const key = row.dataset.cell;
    if (!key) continue;
    if (!byCell.has(key)) byCell.set(key, []);
    byCell.get(key).push(row);
  }
  function cellText(row, index) { return row.children[index].textContent.trim(); }
  // the credit column's blocks (branch, GAE terms, HGPO levels, other fields), one after another
  function creditText(row) {
    const parts = Array.from(row.children[8].querySelectorAll('div.credit'));
    return parts.map(p => (p.dataset.text || p.textContent).trim()).join('; ') || '–';
  }
  function clearSelection() {
    document.querySelectorAll('tr.peers').forEach(r => r.remove());
    document.querySelectorAll('tr.step.selected, tr.step.peer').forEach(r => r.classList.remove('selected', 'peer'));
  }
  function reveal(row) {
    const episode = row.closest('details');
    if (episode) { episode.style.display = ''; episode.open = true; }
    row.scrollIntoView({block: 'center'});
    row.classList.add('flash');
    setTimeout(() => row.classList.remove('flash'), 1500);
  }
  function showPeers(row) {
    const already = row.classList.contains('selected');
    clearSelection();
    if (already) return;
    const peers = (byCell.get(row.dataset.cell) || []).filter(r => r !== row);
    row.classList.add('selected');
    const tr = document.createElement('tr');
    tr.className = 'peers';
    const td = document.createElement('td');
    td.colSpan = row.children.length;
    const head = document.createElement('div');
    const cell = row.dataset.cell.split(':').pop();
    head.textContent = peers.length
      ? 'cell ' + cell + ': ' + (peers.length + 1) + ' steps; the other ' + peers.length + ':'
      : 'cell ' + cell + ': no other step shares it (a singleton).';
    td.appendChild(head);
    const list = document.createElement('ul');
    for (const peer of peers) {
      peer.classList.add('peer');
      const item = document.createElement('li');
      item.className = 'peer-item';
      const link = document.createElement('a');
      link.textContent = peer.dataset.label;
      link.addEventListener('click', (event) => { event.stopPropagation(); reveal(peer); });
      item.appendChild(link);
      item.appendChild(document.createTextNode(
        ': action ' + cellText(peer, 3) + ', R ' + cellText(peer, 5) + ', A ' + cellText(peer, 6) + ', ' + creditText(peer)));
      list.appendChild(item);
    }
    td.appendChild(list);
    tr.appendChild(td);
    row.after(tr);
  }
  for (const row of steps) {
    if (row.dataset.cell) row.addEventListener('click', () => showPeers(row));
  }
  const filters = ['dump', 'outcome', 'type'].map(name => [name, document.getElementById('filter-' + name)]);
  const openAll = document.getElementById('filter-open');
  const count = document.getElementById('shown-count');
  const episodes = Array.from(document.querySelectorAll('details.episode'));
  function apply() {
    let shown = 0;
    for (const episode of episodes) {
      const visible = filters.every(([name, select]) => !select || !select.value || episode.dataset[name] === select.value);
      episode.style.display = visible ? '' : 'none';
      if (visible) { shown += 1; if (openAll && openAll.checked) episode.open = true; }
    }
    if (count) count.textContent = shown + ' of ' + episodes.length + ' episodes shown';
  }
  filters.forEach(([, select]) => select && select.addEventListener('change', apply));
  if (openAll) openAll.addEventListener('change', apply);
})();
"""


def build_report(
    output_dir: str | Path,
    *,
    log_history: Sequence[dict[str, Any]] | None = None,
    eval_history: Sequence[dict[str, Any]] | None = None,
    title: str | None = None,
    report_key: str | None = None,
    max_episodes: int = DEFAULT_MAX_EPISODES,
) -> str:
    """The page's HTML. `log_history` / `eval_history` default to what `output_dir` holds
    (a running trainer passes its own `state.log_history` and `eval_history`); `report_key`
    is the env's task-type attribute (`TextEnv.report_key`), guessed from the dumps if None."""
    import plotly.offline

    output_dir = Path(output_dir)
    log_history = load_log_history(output_dir) if log_history is None else list(log_history)
    eval_history = load_eval_history(output_dir) if eval_history is None else list(eval_history)
    dumps = load_dumps(output_dir)
    key = type_key((e for _, episodes in dumps for e in episodes), report_key)
    figures = curve_figures(log_history, eval_history)
    figure_html = "".join(
        f'<div class="figure"><h3>{escape_text(name)}</h3>'
        + figure.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})
        + "</div>"
        for name, figure in figures.items()
    ) or "<p>No RL step was logged (no trainer_state.json in the run, or a run of 0 steps).</p>"
    evaluations = evaluation_table(eval_history) if eval_history else "<p>No evaluation in eval_results.json.</p>"
    bench = "".join(bench_evaluation_html(r) for r in load_bench_evaluations(output_dir))
    episodes = sum(len(e) for _, e in dumps)
    title = title or recorded_title(output_dir) or f"Run {output_dir.resolve().name}"
    steps = len(learning_curve(log_history))
    legend = (
        '<p class="legend">Each row is one env step (one training sample). Colour: the step\'s advantage, '
        '<span style="background: rgba(46,160,67,.5)">positive</span><span style="background: rgba(215,58,73,.5)">'
        "negative</span>, stronger with |A| (scaled per dump); evaluation steps have none. Click a step to list "
        "the other steps of its cell, the steps its baseline compared it with.</p>"
    )
    body = (
        f"<h1>{escape_text(title)}</h1>"
        f'<p class="note">{escape_text(str(output_dir))}: {steps} logged RL steps, {len(eval_history)} evaluations, '
        f"{len(dumps)} rollout dumps holding {episodes} episodes.</p>"
        f'<h2 id="curves">Learning curves</h2>{figure_html}'
        f'<h2 id="evaluations">Evaluations</h2>{evaluations}{bench}'
        f'<h2 id="trajectories">Trajectories</h2>{legend}'
        + episodes_section(dumps, key, max_episodes)
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape_text(title)}</title><style>{_CSS}</style>"
        f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script></head>'
        f"<body>{body}<script>{_SCRIPT}</script></body></html>"
    )


def write_report(output_dir: str | Path, path: str | Path | None = None, **kwargs: Any) -> Path:
    """Write `build_report(output_dir, **kwargs)` to `path` (default `<output_dir>/report.html`); returns the path."""
    path = Path(path) if path is not None else Path(output_dir) / REPORT_FILE
    page = build_report(output_dir, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(page, encoding="utf-8")
    partial.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bipace-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a run's output directory (train.py's --output_dir)")
    parser.add_argument("-o", "--output", help=f"where to write the page (default <output_dir>/{REPORT_FILE})")
    parser.add_argument("--env", help="the run's env (its report_key names the task types); guessed if left out")
    parser.add_argument("--title", help="the page's title (default: the run's, as train.py recorded it, else the "
                        "directory's name)")
    parser.add_argument("--max_episodes", type=int, default=DEFAULT_MAX_EPISODES,
                        help=f"episodes shown per dump (default {DEFAULT_MAX_EPISODES}; 0: all)")
    args = parser.parse_args(argv)
    if not Path(args.output_dir).is_dir():
        print(f"error: output_dir {args.output_dir!r} is not a directory; pass a run's --output_dir.", file=sys.stderr)
        return 2
    report_key = None
    if args.env:
        from envs.base import resolve_env_class

        report_key = resolve_env_class(args.env).report_key
    try:
        path = write_report(args.output_dir, args.output, title=args.title, report_key=report_key,
                            max_episodes=args.max_episodes)  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
