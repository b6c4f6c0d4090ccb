"""`bipace-eval` without a model: the protocol and its overrides, what a model spec resolves to,
the statistics (against slow references written here), record matching and resume bookkeeping.
The end-to-end runs on the tiny model are in tests/trainer/test_evaluate_e2e.py."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.cli import evaluate
from bipace_trainer.reports.run_summary import wilson_interval


def test_each_env_gets_the_papers_protocol_and_flags_override_it():
    alfworld = evaluate.parse_args(["m", "--env", "alfworld"])
    assert (alfworld.split, alfworld.max_turns, alfworld.temperature, alfworld.seeds) == (
        ["valid_seen", "valid_unseen"], 50, 0.4, [123, 456, 789])
    webshop = evaluate.parse_args(["m", "--env", "webshop"])
    assert (webshop.split, webshop.max_turns) == (["test"], 15)
    textcraft = evaluate.parse_args(["m"])
    assert (textcraft.env, textcraft.split, textcraft.max_turns, textcraft.history_length) == ("textcraft", ["test_ood"], 30, 2)
    custom = evaluate.parse_args(["a", "b", "--env", "tiny", "--split", "valid", "--seeds", "1", "2", "--temperature", "0",
                                  "--max_turns", "4", "--env_kwargs", '{"size": 5}'])  # fmt: skip
    assert (custom.models, custom.split, custom.seeds, custom.temperature, custom.max_turns, custom.env_kwargs) == (
        ["a", "b"], ["valid"], [1, 2], 0.0, 4, {"size": 5})
    assert evaluate.parse_args(["m", "--env", "tiny"]).split == ["valid"]  # no published protocol: the env's own split


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "b", "c"], "models: give one model, or two"),
        (["a", "--seeds", "1", "1"], "--seeds: must not repeat"),
        (["a", "--chunk_size", "-1"], "--chunk_size: must be >= 0"),
        (["a", "--env_kwargs", "[1]"], "--env_kwargs: must be a JSON object"),
        (["a", "--vllm_mode", "server"], "--vllm_mode: vLLM settings without --use_vllm; add --use_vllm or drop them"),
        (["a", "--vllm_max_model_length", "512", "--vllm_gpu_memory_utilization", "0.5"],
         "--vllm_gpu_memory_utilization, --vllm_max_model_length: vLLM settings without --use_vllm"),
    ],
)
def test_bad_flags_exit_with_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--vllm_gpu_memory_utilization", "1.5"], "--vllm_gpu_memory_utilization: must be in (0, 1]"),
        (["--vllm_max_model_length", "0"], "--vllm_max_model_length: must be >= 1"),
        (["--vllm_server_base_url", "http://h:8000"], "--vllm_server_base_url: is for --vllm_mode server"),
    ],
)
def test_bad_vllm_flags_name_the_flag(argv, message, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(["a", "--use_vllm", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    ok = evaluate.parse_args(["a", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://h:8000"])
    assert (ok.vllm_mode, ok.vllm_gpu_memory_utilization, ok.vllm_max_model_length) == ("server", 0.3, None)
    assert evaluate.generation_backend(ok) == "vllm server (http://h:8000)"
    assert evaluate.generation_backend(evaluate.parse_args(["a"])) == "transformers"


def test_use_vllm_without_vllm_says_how_to_get_it(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        evaluate.parse_args(["a", "--use_vllm"])
    assert "--use_vllm: vLLM is not installed here; pip install 'trl[vllm]'" in capsys.readouterr().err


def test_model_specs_resolve_to_what_to_load(tmp_path):
    assert evaluate.resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == evaluate.ResolvedModel("Qwen/Qwen2.5-1.5B-Instruct")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert evaluate.resolve_model(str(full)) == evaluate.ResolvedModel(str(full))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(full)}))
    assert evaluate.resolve_model(str(adapter)) == evaluate.ResolvedModel(str(full), str(adapter))
    assert evaluate.resolve_model(str(adapter), base_model="other").model == "other"
    # the shipped warm start records the converted embedded model of the machine that built it
    elsewhere = tmp_path / "adapter2"
    elsewhere.mkdir()
    (elsewhere / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/nowhere/.cache/bipace_trainer/models/SmolLM2-135M-Instruct"}))
    assert evaluate.resolve_model(str(elsewhere)).model == "embedded"
    # a run's output dir without a final model: its newest checkpoint
    run = tmp_path / "run"
    for step in (5, 20, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "config.json").write_text("{}")
    resolved = evaluate.resolve_model(str(run))
    assert resolved.model == str(run / "checkpoint-20") and "checkpoint-20" in resolved.note
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model .*config.json"):
        evaluate.resolve_model(str(tmp_path / "empty"))


def test_labels_are_file_safe_and_unique():
    assert evaluate.model_label("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen2.5-1.5B-Instruct"
    assert evaluate.model_label("outputs/run/", ["run"]) == "run-2"
    assert evaluate.model_label("a b:c") == "a_b_c"


def _episode(task, seed, repeat, won, kind="x", score=None):
    episode = {"task_id": task, "seed": seed, "repeat": repeat, "won": won, "attributes": {"kind": kind}, "turns": 4,
               "invalid_steps": 1, "failed": False}  # fmt: skip
    return episode | ({"score": score} if score is not None else {})


def test_summary_per_type_with_wilson_intervals_and_seed_spread():
    episodes = [
        _episode(1, 123, 0, True, "a", 1.0), _episode(2, 123, 0, False, "b", 0.5),
        _episode(1, 456, 0, True, "a", 1.0), _episode(2, 456, 0, True, "b", 0.25),
        _episode(1, 789, 0, False, "a", 0.0), _episode(2, 789, 0, False, "b", 0.0),
    ]  # fmt: skip
    summary = evaluate.summarise_model(episodes, "kind", [123, 456, 789])
    overall = summary["overall"]
    assert (overall["episodes"], overall["successes"], overall["success_rate"]) == (6, 3, 0.5)
    assert overall["ci95"] == pytest.approx(list(wilson_interval(3, 6)))
    assert overall["per_seed"] == {"123": 0.5, "456": 1.0, "789": 0.0}
    assert overall["seed_mean"] == pytest.approx(0.5) and overall["seed_sd"] == pytest.approx(0.5)  # sample sd
    assert overall["score"] == pytest.approx(2.75 / 6)
    a = summary["per_type"]["kind=a"]
    assert (a["successes"], a["episodes"], a["per_seed"]) == (2, 3, {"123": 1.0, "456": 1.0, "789": 0.0})
    assert summary["valid_action_rate"] == pytest.approx(0.75) and summary["env_failures"] == 0
    table = evaluate.markdown_report({
        "protocol": {"env": "tiny", "temperature": 0.4, "seeds": [123, 456, 789], "max_turns": 4, "history_length": 1,
                     "episodes_per_task": 1},
        "models": [{"label": "m", "model": "path", "splits": {"valid": summary}}], "paired": [],
    })  # fmt: skip
    assert "| all | 0.500 (3/6, 0.188–0.812) | 0.500 ± 0.500 | 0.458 |" in table
    assert "| kind=a | 0.667 (2/3," in table


def reference_paired(first, second):
    """Slow and plain: for each task, the mean of won_1 − won_2 over the episodes both played."""
    tasks = sorted({e["task_id"] for e in first})
    diffs = []
    for task in tasks:
        values = []
        for a in first:
            for b in second:
                if a["task_id"] == task and (a["task_id"], a["seed"], a["repeat"]) == (b["task_id"], b["seed"], b["repeat"]):
                    values.append(int(a["won"]) - int(b["won"]))
        if values:
            diffs.append(sum(values) / len(values))
    if not diffs:
        return None, None
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, None
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return mean, (mean - 1.96 * sd / math.sqrt(len(diffs)), mean + 1.96 * sd / math.sqrt(len(diffs)))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 3), st.integers(1, 2), st.booleans())
def test_paired_difference_matches_a_plain_reference(seed, tasks, seeds, repeats, drop_some):
    rng = random.Random(seed)
    keys = [(t, s, r) for t in range(tasks) for s in range(seeds) for r in range(repeats)]
    first = [_episode(t, s, r, rng.random() < 0.5) for t, s, r in keys]
    second = [_episode(t, s, r, rng.random() < 0.5) for t, s, r in keys if not (drop_some and rng.random() < 0.3)]
    rng.shuffle(second)
    result = evaluate.paired_difference(first, second)
    mean, interval = reference_paired(first, second)
    if mean is None:
        assert result["difference"] is None and result["pairs"] == 0
        return
    assert result["difference"] == pytest.approx(mean)
    assert result["pairs"] == len(second)
    if interval is None:
        assert result["ci95"] is None
    else:
        assert result["ci95"] == pytest.approx(list(interval), abs=1e-3)  # 1.96 vs the exact quantile


def test_a_model_against_itself_differs_by_zero():
    episodes = [_episode(t, s, 0, (t + s) % 3 == 0) for t in range(5) for s in (1, 2)]
    assert evaluate.paired_difference(episodes, episodes) == {"pairs": 10, "tasks": 5, "difference": 0.0, "ci95": [0.0, 0.0]}


def test_records_of_interleaved_ranks_match_their_units():
    specs = [SimpleNamespace(task_id=t) for t in (4, 7, 4, 9, 7)]
    chunk = [(spec, 0) for spec in specs]
    # two ranks: rank 0 played units 0, 2, 4 (tasks 4, 4, 7), rank 1 units 1, 3 (tasks 7, 9)
    records = [{"rank": 1, "episode": 3, "task_id": 7, "n": "r1a"}, {"rank": 1, "episode": 4, "task_id": 9, "n": "r1b"},
               {"rank": 0, "episode": 0, "task_id": 4, "n": "r0a"}, {"rank": 0, "episode": 1, "task_id": 4, "n": "r0b"},
               {"rank": 0, "episode": 2, "task_id": 7, "n": "r0c"}]  # fmt: skip
    matched = evaluate.match_records(records, chunk)
    assert [r["task_id"] for r in matched] == [4, 7, 4, 9, 7]
    with pytest.raises(RuntimeError, match="no episode of task 9"):
        evaluate.match_records(records[2:], chunk)


def test_resume_reads_finished_chunks_and_ignores_a_cut_line(tmp_path):
    path = tmp_path / "episodes.jsonl"
    evaluate._append_line(path, {"split": "valid", "seed": 1, "chunk": 0, "episodes": [{"won": True}]})
    evaluate._append_line(path, {"split": "valid", "seed": 2, "chunk": 0, "episodes": [{"won": False}]})
    with open(path, "a") as f:
        f.write('{"split": "valid", "seed": 3, "chunk": 0, "episo')  # killed mid-write
    assert evaluate._read_done(path) == {("valid", 1, 0): [{"won": True}], ("valid", 2, 0): [{"won": False}]}


def test_chunk_seeds_are_fixed_and_distinct():
    seeds = {evaluate.chunk_seed(seed, chunk) for seed in (123, 456, 789) for chunk in range(50)}
    assert len(seeds) == 150 and evaluate.chunk_seed(123, 0) == 123


def _a_run(folder, settings=None, config=None, checkpoint=None):
    """A run's output dir as train.py leaves it: eval_results.json (its evaluations with their settings),
    and optionally a checkpoint whose bipace_state.json holds the run's config."""
    folder.mkdir(parents=True, exist_ok=True)
    history = [{"tag": tag, "split": "valid", "success_rate": 0.5, "num_tasks": 8, **({"settings": settings} if settings else {})}
               for tag in ("before", "final")]  # fmt: skip
    (folder / "eval_results.json").write_text(json.dumps(history))
    if checkpoint:
        (folder / checkpoint).mkdir()
        (folder / checkpoint / "bipace_state.json").write_text(json.dumps({"eval_history": [], "config": config}))
    return folder


# what the main job's evaluations record (`run.evaluation.evaluation_settings`)
MAIN_JOB = {"env": "textcraft", "env_kwargs": {"max_expert_steps": 3}, "max_turns": 6, "history_length": 1,
            "max_completion_length": 40, "temperature": 0.4, "tasks": 8, "episodes_per_task": 1}  # fmt: skip


def test_a_runs_output_dir_is_evaluated_with_the_runs_own_settings(tmp_path):
    run = _a_run(tmp_path / "run", MAIN_JOB)
    got = evaluate.parse_args([str(run)])
    assert (got.env, got.split, got.max_turns, got.history_length, got.max_completion_length, got.env_kwargs,
            got.temperature, got.tasks, got.episodes_per_task) == (
        "textcraft", ["valid"], 6, 1, 40, {"max_expert_steps": 3}, 0.4, 8, 1)  # before: test_ood, 30 turns, history 2
    assert got.protocol_source == f"the run's own evaluation settings ({run / 'eval_results.json'})"
    flags = evaluate.parse_args([str(run), "--split", "test_ood", "--history_length", "2", "--tasks", "0"])
    assert (flags.split, flags.history_length, flags.tasks, flags.max_turns) == (["test_ood"], 2, 0, 6)  # flags win
    other_env = evaluate.parse_args([str(run), "--env", "webshop"])  # the run's settings are textcraft's
    assert (other_env.split, other_env.max_turns, other_env.history_length) == (["test"], 15, 2)
    assert evaluate.parse_args(["some/hub-id"]).max_turns == 30  # nothing saved: the protocol


def test_a_run_that_recorded_its_seed_is_replayed_on_it_and_more_seeds_only_when_asked(tmp_path):
    run = _a_run(tmp_path / "run", MAIN_JOB | {"seed": 7, "rollout_batch_size": 3, "generation": {"top_k": 5}})
    got = evaluate.parse_args([str(run)])
    assert (got.seeds, got.chunk_size, got.rollout_batch_size, got.generation) == ([7], 0, 3, {"top_k": 5})
    assert got.replays["tag"] == "final"  # the run's final evaluation, played again on its seed in one chunk
    assert evaluate.seeds_line(got).startswith("seed 7, the one the run's final evaluation sampled with")
    more = evaluate.parse_args([str(run), "--seeds", "123", "456", "789"])
    assert more.replays is None and more.seeds == [123, 456, 789] and more.chunk_size == 0
    assert evaluate.seeds_line(more).startswith("seeds 123 456 789, asked for (the run's final evaluation sampled seed 7")
    for flags in (["--temperature", "1.0"], ["--tasks", "4"], ["--chunk_size", "2"], ["--rollout_batch_size", "1"]):
        assert evaluate.parse_args([str(run), *flags]).replays is None, flags  # another evaluation than the run's
    old = evaluate.parse_args([str(_a_run(tmp_path / "old", MAIN_JOB))])  # a run from before seeds were recorded
    assert (old.seeds, old.chunk_size, old.replays) == ([123, 456, 789], 64, None)
    assert "recorded no evaluation seed" in evaluate.seeds_line(old)
    assert evaluate.parse_args(["some/hub-id"]).replays is None


def test_the_replay_prints_the_summary_line_and_its_own_in_one_format(tmp_path):
    final = {"tag": "final", "success_rate": 0.5, "num_tasks": 8, "valid_action_rate": 1.0}
    lines = evaluate.replay_lines(final, {"episodes": 8, "success_rate": 0.5}).splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["0.500 (4 of 8 episodes, 95% CI 0.215-0.785)"] * 2


def test_a_checkpoint_without_evaluations_gives_its_runs_config(tmp_path):
    config = {"env_name": "tiny", "env_kwargs": {"size": 4}, "eval_split": "valid", "max_turns": 4, "history_length": 1,
              "max_completion_length": 16, "eval_temperature": 0.0, "eval_tasks": 2, "eval_rollouts_per_task": 3}
    run = _a_run(tmp_path / "run", checkpoint="checkpoint-5", config=config)
    for spec in (run, run / "checkpoint-5"):
        got = evaluate.parse_args([str(spec)])
        assert (got.env, got.env_kwargs, got.split, got.max_turns, got.history_length, got.temperature, got.tasks,
                got.episodes_per_task) == ("tiny", {"size": 4}, ["valid"], 4, 1, 0.0, 2, 3), spec
