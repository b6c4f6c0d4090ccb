"""studies.learning.paired on the committed TextCraft studies: pooling, the paired interval, the pooled figure."""
from __future__ import annotations

import json
import math
from pathlib import Path

from scipy import stats

from studies.learning import paired

RESULTS = Path(__file__).resolve().parents[2] / "studies" / "learning" / "results"
BASELINES = RESULTS / "textcraft_hgpo" / "learning_study_cpu-textcraft.json"
GRAPHGPO = RESULTS / "graphgpo_textcraft" / "learning_study_cpu-textcraft.json"


def raw_runs(path: Path) -> list[dict]:
    return json.loads(path.read_text())["envs"]["textcraft"]["runs"]


def test_runs_of_both_files_are_pooled_and_a_later_file_never_replaces_a_run():
    runs = paired.load_runs([BASELINES, GRAPHGPO, BASELINES])
    presets = {preset for preset, _ in runs}
    assert {"grpo", "gigpo", "hgpo", "graphgpo"} <= presets
    first = {(r["preset"], r["seed"]): r for r in raw_runs(BASELINES)}
    assert all(runs[key]["curve"] == run["curve"] for key, run in first.items())
    assert len(runs) == len(first) + len(raw_runs(GRAPHGPO))


def test_the_paired_interval_is_the_student_t_interval_of_the_per_seed_differences():
    # written out here from the raw curves, apart from paired.measures/interval
    mine = {r["seed"]: r for r in raw_runs(GRAPHGPO)}
    base = {r["seed"]: r for r in raw_runs(BASELINES) if r["preset"] == "grpo"}
    seeds = sorted(set(mine) & set(base))
    assert len(seeds) >= 5

    def last5(run):
        rows = [row["train_success"] for row in run["curve"]][-5:]
        return sum(rows) / len(rows)

    diffs = [last5(mine[s]) - last5(base[s]) for s in seeds]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    half = stats.t.ppf(0.975, len(diffs) - 1) * sd / math.sqrt(len(diffs))
    got = paired.interval([paired.measures(mine[s], "valid", None)["train_last5"]
                           - paired.measures(base[s], "valid", None)["train_last5"] for s in seeds])
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, (mean, mean - half, mean + half)))
    row = next(line for line in paired.table(paired.load_runs([GRAPHGPO, BASELINES]), ["graphgpo"], ["grpo"], "valid", None)
               .splitlines() if line.startswith("| `graphgpo` − `grpo`"))
    assert f"| {len(seeds)} | {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" in row


def test_the_pooled_figure_draws_every_preset_of_both_files(tmp_path, monkeypatch):
    drawn = {}
    import studies.learning.report as report

    real = report.plot_env

    def spy(env, summary, runs, path):
        drawn[env] = sorted(summary["presets"])
        real(env, summary, runs, path)

    monkeypatch.setattr(report, "plot_env", spy)
    paired.plot_pooled([BASELINES, GRAPHGPO], tmp_path)
    assert (tmp_path / "learning_textcraft.png").stat().st_size > 10_000
    assert drawn["textcraft"] == sorted({r["preset"] for r in raw_runs(BASELINES) + raw_runs(GRAPHGPO)})


def test_a_run_up_to_a_step_keeps_its_curve_and_evaluations_to_that_step():
    run = raw_runs(BASELINES)[0]
    short = paired.up_to(run, 10)
    assert [row["step"] for row in short["curve"]] == list(range(1, 11))
    assert [(e["split"], e["step"]) for e in short["evals"]] == [("valid", 10)]
    assert paired.up_to(run, None) is run and len(run["curve"]) == 30
