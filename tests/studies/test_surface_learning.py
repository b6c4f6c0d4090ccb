"""studies/surface_learning/study.py: intervals and paired gaps to GiGPO on hand-made runs."""

from __future__ import annotations

import json
import math

import pytest

from studies.surface_learning.study import interval, main, steps_shared, summarise, table


def _run(preset, seed, train, heldout, nonzero=1.0, seconds=10.0):
    curve = [{"train_success": v, "hash_singleton_rate": 1.0, "hidden_singleton_rate": 0.1, "nonzero_advantage": nonzero,
              "episode_length": 5.0, "num_steps": 80, "advantage_std": 1.0 if nonzero else 0.0} for v in train]
    evals = [{"split": "valid", "step": 5 * (i + 1), "success_rate": v} for i, v in enumerate(heldout)]
    return {"preset": preset, "seed": seed, "curve": curve, "evals": evals, "seconds": seconds}


def test_interval_is_the_student_t_half_width():
    i = interval([0.1, 0.3, 0.5])
    # mean 0.3, sd 0.2, t(0.975, 2) = 4.302652729...
    assert i["mean"] == pytest.approx(0.3) and i["half_width"] == pytest.approx(4.302652729 * 0.2 / math.sqrt(3))
    assert math.isnan(interval([0.4])["half_width"]) and interval([])["n"] == 0


def test_paired_gap_to_gigpo_per_seed():
    runs = [
        _run("gigpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1, 0.2]),
        _run("gigpo", 1, [0.3, 0.3, 0.3, 0.3], [0.2, 0.2]),
        _run("bipace_q", 0, [0.2, 0.4, 0.7, 0.6], [0.1, 0.4]),  # second half: +0.2, +0.1
        _run("bipace_q", 1, [0.3, 0.3, 0.2, 0.3], [0.2, 0.1]),  # second half: -0.1, 0
    ]
    summary = summarise(runs, "valid")
    assert summary["bipace_q"]["minus_gigpo_per_seed"] == pytest.approx([0.15, -0.05])
    assert summary["gigpo"]["minus_gigpo_per_seed"] == pytest.approx([0.0, 0.0])
    assert summary["bipace_q"]["heldout_final"]["mean"] == pytest.approx(0.25)
    assert summary["bipace_q"]["train_last"]["mean"] == pytest.approx((0.6 + 0.3) / 2)
    text = table(summary, warm=0.1)
    assert "`bipace_q`" in text and "(+0.15, -0.05)" in text and "95% t-interval" in text


def test_leading_steps_shared_with_grpo_and_advantage_share():
    runs = [
        _run("grpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1]),
        _run("gigpo", 0, [0.2, 0.4, 0.6, 0.5], [0.1], seconds=30.0),  # the same batches for two steps
        _run("hgpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1], nonzero=0.0),  # same success, no advantage spread
    ]
    grpo, gigpo, hgpo = runs
    assert steps_shared(gigpo, grpo) == 2 and steps_shared(grpo, grpo) == 4
    assert steps_shared(hgpo, grpo) == 0  # advantage_std differs on step 1
    summary = summarise(runs, "valid")
    assert summary["gigpo"]["steps_shared_with_grpo"] == [2]
    assert summary["hgpo"]["nonzero_advantage"] == 0.0 and summary["grpo"]["nonzero_advantage"] == 1.0
    text = table(summary, warm=0.1)
    assert "| 0.00 | 0 |" in text and "30 (30–30)" in text and "3 runs, 0.0 run-hours" in text


def test_a_study_still_running_is_reported_from_its_run_files(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for run in (_run("gigpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1, 0.2]), _run("bipace_q", 0, [0.2, 0.4, 0.7, 0.6], [0.1, 0.4]),
                _run("gigpo", 1, [0.3, 0.3, 0.3, 0.3], [0.2, 0.2])):
        (runs_dir / f"{run['preset']}-seed{run['seed']}.json").write_text(json.dumps(run))
    (runs_dir / "gigpo-seed2").mkdir()  # a run still training: its output folder, no JSON yet
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps({"env": "textcraft", "evals": [{"split": "valid", "success_rate": 0.0625}]}))

    reports = main(["--runs", str(runs_dir), "--warm", str(warm)])
    assert reports["textcraft"]["gigpo"]["seeds"] == [0, 1] and reports["textcraft"]["bipace_q"]["seeds"] == [0]
    assert reports["textcraft"]["bipace_q"]["minus_gigpo_per_seed"] == pytest.approx([0.15])
    assert "warm start 0.062" in capsys.readouterr().out and (runs_dir / "vs_gigpo.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["--runs", str(runs_dir)])  # without the warm start's JSON


def _write(folder, runs, warm_success, env="textcraft"):
    folder.mkdir()
    for run in runs:
        (folder / f"{run['preset']}-seed{run['seed']}.json").write_text(json.dumps(run))
    warm = folder / "warm.json"
    warm.write_text(json.dumps({"env": env, "evals": [{"split": "valid", "success_rate": warm_success}]}))
    return ["--runs", str(folder), "--warm", str(warm)]


def test_seeds_of_two_warm_starts_are_paired_within_their_seed_and_pooled(tmp_path, capsys):
    a = _write(tmp_path / "a", [_run("gigpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1, 0.2]),
                                _run("bipace_q", 0, [0.2, 0.4, 0.7, 0.6], [0.1, 0.4])], 0.0625)
    b = _write(tmp_path / "b", [_run("gigpo", 1, [0.3, 0.3, 0.3, 0.3], [0.2, 0.2]),
                                _run("bipace_q", 1, [0.3, 0.3, 0.2, 0.3], [0.2, 0.1])], 0.125)
    plot_path = tmp_path / "both.png"
    reports = main([*a, *b, "--plot", str(plot_path)])
    assert reports["textcraft"]["bipace_q"]["seeds"] == [0, 1]
    assert reports["textcraft"]["bipace_q"]["minus_gigpo_per_seed"] == pytest.approx([0.15, -0.05])
    printed = capsys.readouterr().out
    assert "warm start 1" in printed and "seeds [0]" in printed and "seeds [1]" in printed
    assert "every seed" in printed and "warm starts 0.062 / 0.125" in printed and plot_path.stat().st_size > 0

    again = _write(tmp_path / "c", [_run("gigpo", 1, [0.3, 0.3, 0.3, 0.3], [0.2, 0.2])], 0.125)
    with pytest.raises(SystemExit):
        main([*b, *again])  # gigpo seed 1 in two folders: which warm start is it paired on?
    assert "gigpo seed 1 is in both" in capsys.readouterr().err
    other = _write(tmp_path / "d", [_run("gigpo", 2, [0.3], [0.2])], 0.5, env="alfworld")
    with pytest.raises(SystemExit):
        main([*a, *other])
    with pytest.raises(SystemExit):
        main([*a, "--runs", str(tmp_path / "b")])  # a second --runs without its --warm


def test_runs_from_a_finished_study_json_read_as_its_folder_does(tmp_path, capsys):
    runs = [_run("gigpo", 0, [0.2, 0.4, 0.5, 0.5], [0.1, 0.2]), _run("bipace_q", 0, [0.2, 0.4, 0.7, 0.6], [0.1, 0.4])]
    folder = _write(tmp_path / "a", runs, 0.0625)
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"envs": {"textcraft": {"runs": runs}}}))
    from_folder = main([*folder, "--plot", str(tmp_path / "1.png")])
    printed_folder = capsys.readouterr().out
    warm = folder[3]  # ["--runs", folder, "--warm", warm.json]
    from_study = main(["--runs", str(study), "--warm", warm, "--plot", str(tmp_path / "2.png")])
    # the same report; the table's rows follow the runs' order (a folder's file names, the study's presets)
    assert from_study == from_folder and sorted(capsys.readouterr().out.splitlines()) == sorted(printed_folder.splitlines())

    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"envs": {}}))
    with pytest.raises(SystemExit):
        main(["--runs", str(empty), "--warm", warm])
    assert "neither a folder of runs nor a learning_study JSON" in capsys.readouterr().err
