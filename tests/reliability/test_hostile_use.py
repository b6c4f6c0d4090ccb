"""Round three of the hostile pass (issue 29): the newest surfaces (resampling, the output
folder, resume, dumps, the viewer, the model card, --print_config, warm-start adapters,
trackers, a full disk) under a new user's mistakes. Fast tests; the end-to-end runs are
in test_hostile_runs.py and test_interruption.py."""

from __future__ import annotations

import errno
import io
import json
import logging
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import preflight, train  # noqa: E402
from bipace_trainer import BiPACEConfig
from bipace_trainer.run import run_dir
from bipace_trainer.reports import show
from bipace_trainer.rollout import trajectories
from bipace_trainer.run.checkpointing import _out_of_space  # noqa: E402
from bipace_trainer.run.run_dir import STATE_FILE  # noqa: E402
from bipace_trainer.reports.model_card import CARD_MARKER, keep_foreign_readme, table_cell  # noqa: E402
from bipace_trainer.run.resampling import resample_until_signal  # noqa: E402
from bipace_trainer.run.warm_start import (  # noqa: E402
    WARM_START_INFO,
    base_fingerprint,
    check_warm_start,
    load_warm_start,
)

TINY = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--use_cpu", "true", "--use_peft", "false",
        "--warm_start_from", ""]  # fmt: skip


# ---------------------------------------------------------------- 1. resampling: bounded, logged, stoppable


class _Batch:
    def __init__(self, signal: bool):
        self.signal = signal


def test_resampling_logs_each_attempt_before_it_plays(caplog):
    logged_at_play = []

    def replay(attempt):
        logged_at_play.append(sum("attempt" in r.getMessage() for r in caplog.records))
        return _Batch(False)

    with caplog.at_level(logging.WARNING, logger="bipace_trainer.run.resampling"):
        outcome = resample_until_signal(_Batch(False), replay, max_attempts=3, max_seconds=0,
                                        stop_requested=lambda: False, step=5)  # fmt: skip
    assert outcome.attempts == 3 and outcome.reason == "attempts" and len(outcome.played) == 4
    assert logged_at_play == [1, 2, 3]  # attempt k was on the log before it played
    assert "step 5: no signal (every advantage 0); resampling on fresh tasks, attempt 1 of at most 3" in caplog.text
    assert "ended after 3 attempts without signal" in caplog.text


def test_resampling_stops_on_request_and_on_its_time_bound():
    stops = iter([False, False, True])
    outcome = resample_until_signal(_Batch(False), lambda a: _Batch(False), max_attempts=10**6, max_seconds=0,
                                    stop_requested=lambda: next(stops), step=1, log=False)  # fmt: skip
    assert (outcome.attempts, outcome.reason) == (2, "stop")
    now = iter(range(0, 10**6, 10))  # each clock reading 10 s later
    outcome = resample_until_signal(_Batch(False), lambda a: _Batch(False), max_attempts=10**6, max_seconds=35,
                                    stop_requested=lambda: False, step=1, log=False, clock=lambda: next(now))  # fmt: skip
    assert outcome.reason == "time" and 1 <= outcome.attempts <= 4
    found = resample_until_signal(_Batch(False), lambda a: _Batch(a == 2), max_attempts=10**6, max_seconds=0,
                                  stop_requested=lambda: False, step=1, log=False)  # fmt: skip
    assert (found.attempts, found.reason, found.scored.signal) == (2, "signal", True)


def test_the_stop_message_says_what_is_on_disk(tmp_path):
    assert run_dir.stop_message(tmp_path) == f"no checkpoint was saved in {tmp_path}: a restart begins from step 0."
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert f"the last complete checkpoint is {tmp_path / 'checkpoint-2'}" in run_dir.stop_message(tmp_path)


# ---------------------------------------------------------------- 2, 3. one run per output_dir; resume compares settings


def _old_run(folder: Path, steps=(1, 2, 3), run="old", config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / run_dir.RUN_FILE).write_text(json.dumps({"run_id": run, "tensorboard_dir": "runs/old"}))
    for step in steps:
        checkpoint = folder / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text("{}")
        (checkpoint / STATE_FILE).write_text(json.dumps({"run_id": run, "config": config}))


def test_a_new_run_in_an_old_runs_output_dir_is_refused_before_any_weights_load(tmp_path):
    _old_run(tmp_path / "out")
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out")])
    with pytest.raises(preflight.ConfigError, match=r"holds another run's files \(checkpoint-1/, checkpoint-2/, "
                       r"checkpoint-3/\).*--resume_from_checkpoint true.*--overwrite_output_dir true"):  # fmt: skip
        train.prepare_output_dir(*args)
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", "true"])
    train.prepare_output_dir(*args)
    assert run_dir.checkpoints(tmp_path / "out") == [] and run_dir.run_id(tmp_path / "out") != "old"


def test_resuming_a_checkpoint_into_a_folder_of_another_runs_checkpoints_is_refused(tmp_path):
    _old_run(tmp_path / "out", run="old")
    _old_run(tmp_path / "elsewhere", steps=(5,), run="other")
    foreign = tmp_path / "elsewhere" / "checkpoint-5"
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(foreign)])
    with pytest.raises(preflight.ConfigError, match=rf"{foreign} was saved by another run than the checkpoints in --output_dir "
                       rf".*checkpoint-1, checkpoint-2, checkpoint-3.*would mix two runs.*--output_dir NEW_OR_EMPTY_FOLDER "
                       rf"--resume_from_checkpoint {foreign} resumes it exactly"):  # fmt: skip
        train.prepare_output_dir(*args)
    assert run_dir.run_id(tmp_path / "out") == "old"  # nothing recorded
    # a folder that already mixes two runs: resuming its newest checkpoint says which to move
    (tmp_path / "out" / "checkpoint-5").mkdir()
    (tmp_path / "out" / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (tmp_path / "out" / "checkpoint-5" / STATE_FILE).write_text(json.dumps({"run_id": "other"}))
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", "true"])
    with pytest.raises(preflight.ConfigError, match=r"holds checkpoints of two runs \(checkpoint-5 and checkpoint-1, "
                       r"checkpoint-2, checkpoint-3 were saved by different runs\): move checkpoint-5"):  # fmt: skip
        train.prepare_output_dir(*args)


@pytest.mark.parametrize("layout", ["checkpoints copied into a new folder", "a failed try's record", "a fresh output_dir"])
def test_a_checkpoint_carries_its_run_and_resumes_wherever_it_is(layout, tmp_path):
    _old_run(tmp_path / "old", steps=(1, 2), run="r1")
    for name in ("checkpoint-1", "checkpoint-2"):  # bipace_state.json as a checkpoint now writes it
        state = tmp_path / "old" / name / STATE_FILE
        state.write_text(json.dumps({"run_id": "r1", "tensorboard_dir": "runs/Dec05_r1", "config": None}))
    out, resume = tmp_path / "new", "true"
    if layout == "a fresh output_dir":
        resume = str(tmp_path / "old" / "checkpoint-2")
    else:
        out.mkdir()
        for name in ("checkpoint-1", "checkpoint-2"):
            shutil.copytree(tmp_path / "old" / name, out / name)
    if layout == "a failed try's record":  # what a refused try wrote before: a new id, no checkpoint of its own
        (out / run_dir.RUN_FILE).write_text(json.dumps({"run_id": "new", "tensorboard_dir": "runs/new"}))
    args = train.parse_args([*TINY, "--output_dir", str(out), "--resume_from_checkpoint", resume])
    train.prepare_output_dir(*args)
    assert args[1].resume_from_checkpoint.endswith("checkpoint-2")
    record = json.loads((out / run_dir.RUN_FILE).read_text())
    assert record == {"run_id": "r1", "tensorboard_dir": "runs/Dec05_r1", "title": "embedded SmolLM2-135M-Instruct on tiny, bipace_q"}
    assert run_dir.tensorboard_dir(out) == out / "runs/Dec05_r1"  # the resumed run writes on in its run's folder


def test_a_resume_refuses_what_changes_the_run_and_warns_for_overrides(tmp_path, capsys):
    flags = [*TINY, "--output_dir", str(tmp_path / "out"), "--model_name_or_path", "tiny-model"]
    saved = run_dir.run_config(train.parse_args(flags)[1], "tiny-model")
    _old_run(tmp_path / "out", run="r", config=saved)
    resume = [*flags, "--resume_from_checkpoint", "true"]
    for change, field in [(["--preset", "grpo"], "preset"), (["--num_generations", "2", "--per_device_train_batch_size",
                          "2"], "num_generations"), (["--env_kwargs", '{"size": 5}'], "env_kwargs"),
                          (["--model_name_or_path", "other-model"], "model_name_or_path")]:  # fmt: skip
        with pytest.raises(preflight.ConfigError, match=rf"{field}=.*differs from checkpoint-3's.*another run"):
            train.prepare_output_dir(*train.parse_args([*resume, *change]))
    args = train.parse_args([*resume, "--seed", "7", "--learning_rate", "1e-2"])
    train.prepare_output_dir(*args)
    out = capsys.readouterr().out
    assert "resuming checkpoint-3 with settings that differ from its run" in out
    assert "learning_rate=0.01 (checkpoint: 0.0005; the restored scheduler continues the checkpoint's learning rate)" in out
    assert "seed=7 (checkpoint: 0;" in out
    assert args[1].resume_from_checkpoint == str(tmp_path / "out" / "checkpoint-3")


def test_resume_true_without_a_checkpoint_starts_from_step_0_and_says_so(tmp_path, capsys):
    args = train.parse_args([*TINY, "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", "true"])
    train.prepare_output_dir(*args)
    assert args[1].resume_from_checkpoint is None and "no checkpoint in" in capsys.readouterr().out


# ---------------------------------------------------------------- 4. dumps take any env text; a killed write is cleaned


def test_a_dump_of_env_text_with_lone_surrogates_is_written_as_safe_text(tmp_path):
    record = {"task": "reach \udfff", "turns": [{"observation": "wall \ud800<|im_end|>", "reply": "x"}], "\udcff": 1}
    path = trajectories.write_jsonl(tmp_path / "rollouts" / "step-000001.jsonl", [record])
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written["task"] == "reach ?" and written["turns"][0]["observation"] == "wall ?< |im_end|>"
    assert "?" in written and not list((tmp_path / "rollouts").glob(".*.partial"))


def test_a_killed_dump_writes_partial_file_is_removed_at_the_next_start(tmp_path):
    (tmp_path / "rollouts").mkdir()
    partial = tmp_path / "rollouts" / ".step-000002.jsonl.4242.partial"
    partial.write_bytes(b"")
    kept = tmp_path / "rollouts" / "step-000001.jsonl"
    kept.write_text("{}\n")
    run_dir.clean_stale_files(tmp_path)
    assert not partial.exists() and kept.exists()


# ---------------------------------------------------------------- 6. --warm_start_from: one clear line for each bad adapter


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """An adapter saved on a tiny base model (seed 0) with its fingerprint, the tokenizer, and another
    base model of the same architecture (seed 1)."""
    from peft import LoraConfig, get_peft_model

    from tests.trainer.tiny_setup import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    first, second = make_model(tokenizer, seed=0), make_model(tokenizer, seed=1)
    adapter = tmp_path_factory.mktemp("adapter")
    fingerprint = base_fingerprint(first)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    get_peft_model(first, lora).save_pretrained(adapter)
    (adapter / WARM_START_INFO).write_text(json.dumps({"base_model": "first", "base_fingerprint": fingerprint}))
    return adapter, tokenizer, second


def _copy(adapter: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(adapter, tmp_path / "copy"))


def _check(adapter: Path, *flags: str):
    script_args, training_args, model_args = train.parse_args([*TINY[:-2], "--warm_start_from", str(adapter), *flags])
    check_warm_start(script_args, training_args, model_args.use_peft, model_args, script_args.explicit)


@pytest.mark.parametrize(
    "damage,line",
    [
        ("truncate", r"adapter_model.safetensors is truncated or not a safetensors file"),
        ("no_weights", r"has adapter_config.json but no weights \(adapter_model.safetensors or adapter_model.bin\)"),
        ("corrupt_config", r"adapter_config.json is not readable JSON"),
    ],
)
def test_a_damaged_warm_start_adapter_is_one_line_before_the_model_loads(tiny_pair, tmp_path, damage, line):
    adapter = _copy(tiny_pair[0], tmp_path)
    weights = adapter / "adapter_model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no_weights":
        weights.unlink()
    else:
        (adapter / "adapter_config.json").write_text('{"r": 16, "lora_alpha":')
    with pytest.raises(ValueError, match=line) as error:
        _check(adapter, "--use_peft", "true")
    assert str(error.value).startswith(f"warm_start_from='{adapter}'") and "\n" not in str(error.value)


def test_lora_flags_and_use_peft_false_that_contradict_the_adapter_are_refused(tiny_pair):
    adapter = tiny_pair[0]
    with pytest.raises(ValueError, match=r"lora_r=4 contradicts warm_start_from=.*adapter has r=16.*Drop --lora_r"):
        _check(adapter, "--use_peft", "true", "--lora_r", "4")
    with pytest.raises(ValueError, match=r"lora_target_modules=\['gate_proj'\] contradicts.*target_modules"):
        _check(adapter, "--use_peft", "true", "--lora_target_modules", "gate_proj")
    with pytest.raises(ValueError, match=r"use_peft=False contradicts warm_start_from=.*--warm_start_from ''"):
        _check(adapter, "--use_peft", "false")
    _check(adapter, "--use_peft", "true", "--lora_r", "16", "--lora_target_modules", "v_proj", "q_proj")  # agrees


def test_an_adapter_of_another_base_model_is_refused(tiny_pair, tmp_path):
    adapter, tokenizer, second = tiny_pair
    with pytest.raises(ValueError, match=r"was trained on another base model \(first\).*--warm_start_steps N"):
        load_warm_start(second, adapter)
    from tests.trainer.tiny_setup import make_model

    assert load_warm_start(make_model(tokenizer, seed=0), adapter) is not None  # its own base (rebuilt) loads


# ---------------------------------------------------------------- 7, 8. the viewer: robust, streamed, escaped


def _episode(**fields):
    turn = {"turn": 0, "observation": "at start", "reply": "<action>go</action>", "action": "go", "valid": True,
            "reward": 0.0, "return": 0.0, "advantage": 0.5, "cluster": 1, "branch": "pace"}  # fmt: skip
    return {"episode": 0, "task_id": 3, "task": "reach the goal", "won": True, "turns_taken": 1, "invalid_steps": 0,
            "reward": 1.0, "turns": [turn], **fields}  # fmt: skip


def _show(path, *flags):
    out, err = io.StringIO(), io.StringIO()
    real = sys.stderr
    sys.stderr = err
    try:
        code = show.main([str(path), "--color", "never", *flags], stream=out)
    finally:
        sys.stderr = real
    return code, out.getvalue(), err.getvalue()


def test_show_skips_and_counts_lines_that_are_not_episode_records(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(_episode()), "[1, 2]", '"text"', json.dumps(_episode(turns=5)),
             json.dumps(_episode(reward="high")), json.dumps(_episode(turns=[{"turn": 0, "advantage": "big"}])),
             "{not json", json.dumps(_episode(episode=1, won=False))]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    code, out, err = _show(path)
    assert code == 0 and "2 episodes, 1 won (50%)" in out and "Traceback" not in err
    assert "skipped 6 lines that are not an episode record (first: line 2, a JSON list, not an object)" in err
    code, out, err = _show(path, "--summary")
    assert code == 0 and len(out.splitlines()) == 3


def test_show_says_an_empty_file_holds_no_episodes(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    code, out, err = _show(tmp_path / "empty.jsonl")
    assert code == 1 and out == "" and "holds no episodes (the file is empty)" in err
    (tmp_path / "junk.jsonl").write_text("[1]\n")
    code, out, err = _show(tmp_path / "junk.jsonl")
    assert code == 2 and "holds no episode record" in err


def test_show_escapes_terminal_control_sequences_in_env_text(tmp_path):
    hostile = "\x1b]0;PWNED\x07\x1b[2J\u202eevil\rback\x9b"
    path = trajectories.write_jsonl(tmp_path / "d.jsonl", [_episode(task=hostile, turns=[
        {**_episode()["turns"][0], "observation": hostile, "reply": hostile, "action": hostile}])])  # fmt: skip
    for flags in ([], ["--summary"]):
        code, out, _ = _show(path, *flags)
        assert code == 0 and not any(ch in out for ch in "\x1b\x07\u202e\r\x9b"), repr(out)
        assert "\\x1b]0;PWNED\\x07" in out
    assert "\\u202eevil\\x0dback\\x9b" in _show(path)[1]


def test_show_streams_a_large_dump(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for k in range(400):
            f.write(json.dumps(_episode(episode=k, task="t" * 40_000)) + "\n")  # 16 MB
    tracemalloc.start()
    try:
        code, out, _ = _show(path, "--summary")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0 and "400 episodes" in out
    assert peak < 4_000_000, peak  # one line at a time; reading the file whole holds 16 MB and more


def test_show_piped_into_head_ends_quietly(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(_episode(episode=k)) + "\n" for k in range(3000)))
    done = subprocess.run(f"{sys.executable} -m bipace_trainer.reports.show {path} --summary | head -1", shell=True,
                          capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.stdout.startswith("episode 0 | task 3 reach the goal | won") and done.stderr == "", done.stderr


def test_model_card_table_cells_escape_markup_and_a_users_readme_is_kept(tmp_path):
    assert table_cell("a|b\nc <script>x</script>") == "a\\|b c &lt;script&gt;x&lt;/script&gt;"
    (tmp_path / "README.md").write_text("my notes")
    assert keep_foreign_readme(tmp_path) == tmp_path / "README.previous.md"
    assert (tmp_path / "README.previous.md").read_text() == "my notes" and not (tmp_path / "README.md").exists()
    (tmp_path / "README.md").write_text(f"---\n---\n{CARD_MARKER}\n# card")  # the run's own card is replaced
    assert keep_foreign_readme(tmp_path) is None and (tmp_path / "README.md").exists()


# ---------------------------------------------------------------- 9. --print_config prints a recipe and touches nothing


def test_print_config_output_runs_as_a_recipe(tmp_path):
    printed = train.resolved_config(*train.parse_args(["--print_config"]))
    recipe = tmp_path / "c.yaml"
    recipe.write_text(printed)
    assert "print_config" not in yaml.safe_load(printed)
    script_args, training_args, model_args = train.parse_args(["--config", str(recipe)])  # no SystemExit
    assert train.resolved_config(script_args, training_args, model_args) == printed
    assert (training_args.generation_batch_size, training_args.steps_per_generation) == (4, 1)


def test_print_config_of_a_bf16_alfworld_recipe_touches_nothing(tmp_path, monkeypatch):
    pytest.importorskip("alfworld")
    recipe = ROOT / "recipes" / "alfworld_qwen2.5-1.5b_bipace_q.yaml"
    assert yaml.safe_load(recipe.read_text()).get("bf16") is True
    monkeypatch.setenv("BIPACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = train.parse_args(["--config", str(recipe), "--print_config"])  # no SystemExit for want of a GPU
    assert "bf16: true" in train.resolved_config(*args)
    assert not (tmp_path / "cache").exists()  # no ALFWorld games generated


# ---------------------------------------------------------------- 10. disk full, trackers, env settings


def test_a_full_disk_while_saving_is_recognised_from_each_writers_error():
    assert _out_of_space(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1152 vs 1040"))
    assert _out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert _out_of_space(OSError(errno.EFBIG, "File too large"))
    assert not _out_of_space(RuntimeError("CUDA error: device-side assert triggered"))


def test_report_to_all_without_a_wandb_key_is_one_line(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    _, training_args, _ = train.parse_args([*TINY, "--report_to", "all"])
    assert "wandb" in training_args.report_to
    with pytest.raises(preflight.ConfigError, match=r"includes wandb, which has no API key here: set WANDB_API_KEY.*"
                       r"WANDB_MODE=offline.*--report_to"):  # fmt: skip
        train.check_trackers(training_args)
    monkeypatch.setenv("WANDB_MODE", "offline")
    train.check_trackers(training_args)


def test_a_webshop_reward_setting_is_checked_before_the_model_loads(tmp_path):
    pytest.importorskip("bm25s")
    pytest.importorskip("rapidfuzz")
    from trl import ModelConfig

    # listing the split's tasks checks it: env I/O, so the pre-flight does it (the config builds), one line
    config = BiPACEConfig(output_dir=str(tmp_path), use_cpu=True, env_name="webshop",
                          env_kwargs={"reward": "bogus", "cache_dir": str(tmp_path / "shop")})  # fmt: skip
    with pytest.raises(preflight.ConfigError, match=r"env_kwargs=.*reward='bogus'; use 'score'"):
        preflight.check_run(config, ModelConfig())
