"""train.py as a newcomer meets it: `--help` shows the project's options first, and a bad
setting is refused with one line (field, value, fix) and argparse's exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import preflight, train  # noqa: E402
from bipace_trainer.advantages import PRESETS  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")


def run_train_py(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
def test_help_shows_the_projects_options_first_with_the_presets_and_the_embedded_model():
    proc = run_train_py("--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    headings = [
        "train.py (this script):",
        "bipace-trainer: step-level advantage estimator:",
        "bipace-trainer: multi-turn rollout and evaluation:",
        "bipace-trainer: what a run records:",
        "model (TRL's ModelConfig):",
        "training (TRL's GRPOConfig and transformers' TrainingArguments):",
    ]
    positions = [text.index(heading) for heading in headings]
    assert positions == sorted(positions), "the project's groups come first, TRL's and transformers' last"
    # 300 until issue 51 added the graph return's four fields (10 lines) and two presets; 320 until issue 50
    # (max_turn_length) and issue 52 (shared_prefix) added theirs
    assert len(text[: positions[-1]].splitlines()) < 335, "the project's and the model's options fit a few screens"
    for flag, group in (("--preset", 1), ("--env_name", 2), ("--rollout_dump_steps", 3), ("--model_name_or_path", 4),
                        ("--learning_rate", 5), ("--per_device_train_batch_size", 5)):
        at = text.index(f"\n  {flag} ")
        assert positions[group] < at and (group + 1 == len(positions) or at < positions[group + 1]), flag
    preset_help = text[text.index("\n  --preset "): text.index("\n  --step_partition")]
    assert all(name in " ".join(preset_help.split()) for name in PRESETS), preset_help
    model_help = " ".join(text[text.index("\n  --model_name_or_path"): text.index("\n  --model_revision")].split())
    assert "None (the default) or 'embedded': SmolLM2-135M-Instruct" in model_help, model_help
    assert len(text.splitlines()[0]) < 100, "a one-line usage, not every flag"


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
@pytest.mark.parametrize("argv,line", [
    (["--cluster_eps", "-1"], "train.py: error: cluster_eps=-1.0 must lie in [0, 2]"),
    # refused by transformers' own checks, after TRL's config has warned: still one line
    pytest.param(["--bf16", "true"], "train.py: error: bf16=True (the recipes train in bf16) needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 needs no fix on a GPU")),
])
def test_a_bad_value_is_one_line_and_exit_2_without_a_traceback(argv, line):
    proc = run_train_py(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(line), lines
    assert "Traceback" not in proc.stderr and "overrides" not in proc.stderr


@pytest.mark.parametrize(
    "argv,field,fix",
    [
        (["--num_generations", "1"], "num_generations=1", ">= 2"),
        (["--preset", "bipace"], "preset='bipace'", "choose one of"),
        (["--env", "no-such-env"], "env_name", "register_env"),
        (["--env_kwargs", "{size: 4}", "--env", "tiny"], "env_kwargs", "JSON"),
        (["--preset", "grpo", "--step_baseline", "mean"], "baseline='mean'", "partition='hash' or 'hidden'"),
        (["--max_turns", "0"], "max_turns=0", ">= 1"),
        pytest.param(["--bf16", "true"], "bf16=True", "--bf16 false",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 needs no fix on a GPU")),
    ],
)
def test_every_config_error_exits_2_with_one_line_naming_field_and_fix(argv, field, fix, capsys):
    with pytest.raises(SystemExit) as stop:
        train.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert ": error: " in err and "Traceback" not in err, err
    assert field in err and fix in err, err


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
def test_a_setting_checked_against_the_model_exits_2_before_loading_weights(tmp_path):
    """cluster_layer is checked from the model's config (no weights here at all): one line, exit 2."""
    from tests.trainer.tiny_setup import make_model, make_tokenizer

    make_model(make_tokenizer(), layers=2).config.save_pretrained(tmp_path)
    proc = run_train_py("--model_name_or_path", str(tmp_path), "--env", "tiny", "--cluster_layer", "9")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("train.py: error: cluster_layer=9 is out of range"), lines
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the decision is for training on a CPU")
def test_on_a_cpu_train_py_decides_float32_itself_and_says_so_whatever_the_config_defaults_to():
    """TRL's own default under use_cpu is bf16 autocast (BiPACEConfig may take TRL's defaults): train.py decides."""
    from trl import GRPOConfig

    assert GRPOConfig(output_dir="unused", use_cpu=True).bf16 is True  # what the CLI overrides
    script_args, training_args, _ = train.parse_args(["--env", "tiny", "--use_cpu", "true"])
    assert training_args.bf16 is False and script_args.precision.startswith("precision: float32 (training on the CPU")
    script_args, training_args, _ = train.parse_args(["--env", "tiny", "--use_cpu", "true", "--bf16", "true"])
    assert training_args.bf16 is True and script_args.precision is None  # asked for: the user's choice stands


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine check refuses bf16 only without a GPU")
def test_a_printed_config_keeps_bf16_on_a_machine_that_would_refuse_to_train_in_it():
    argv = ["--env", "tiny", "--bf16", "true"]
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        train.make_parser(main_job=False).parse_args_into_dataclasses(argv)
    _, printed, _ = train.make_parser(main_job=False, printing=True).parse_args_into_dataclasses(argv)
    assert isinstance(printed, train.BiPACEConfig) and (printed.bf16, printed.fp16) == (True, False)


def test_a_batch_shape_refusal_names_the_one_flag_that_fixes_it_first():
    from bipace_trainer.config import batch_shape_fix

    assert batch_shape_fix(tasks=1, generations=4, per_device=4, world=2) == "pass --tasks_per_iteration 2."
    assert batch_shape_fix(tasks=3, generations=2, per_device=4, world=1) == (
        "pass --per_device_train_batch_size 3 (or --tasks_per_iteration 4).")


@pytest.fixture
def no_model(monkeypatch):
    """train.main as far as it goes before the model loads: loading it fails the test."""
    def load(*args):
        raise AssertionError("the model would load: the mistake was not refused before")

    monkeypatch.setattr(train, "build_trainer", load)


@pytest.mark.parametrize("argv,needles", [
    (["--learning_rate", "-0.001"], ("learning_rate=-0.001 must be >= 0",)),  # before: torch's traceback after the load
    (["--temperature", "0"], ("temperature=0.0 must be > 0", "greedy", "--eval_temperature 0")),  # before: 92 lines
    (["--epsilon", "-0.2"], ("epsilon=-0.2 must be > 0", "clip range")),  # before: accepted, every token clipped
    (["--beta", "-1"], ("beta=-1.0 must be >= 0", "KL")),  # before: accepted
    (["--output_dir", "{tmp}/a-file"], ("is a file, not a folder",)),  # before: tracebacks
    (["--output_dir", "{tmp}/a-file/run"], ("lies under the file",)),
    (["--resume_from_checkpoint", "{tmp}/out/checkpoint-3"], ("holds no complete checkpoint (no trainer_state.json",)),
])
def test_a_mistake_that_used_to_load_the_model_first_is_one_line_before_it(argv, needles, tmp_path, no_model):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    args = train.parse_args(["--env", "tiny", "--use_cpu", "true", "--output_dir", str(tmp_path / "out"), *argv])
    with pytest.raises(preflight.ConfigError) as refused:
        train.main(*args)
    assert "\n" not in str(refused.value) and all(needle in str(refused.value) for needle in needles), str(refused.value)


@pytest.mark.parametrize("line,needles", [
    ("learning_rate: [1.0e-6, 2.0e-6]", ("learning_rate: [1e-06, 2e-06]", "a list, for a single number")),
    ("max_steps: 2.5", ("max_steps: 2.5", "a float, for a whole number")),
    ("preset: {name: gigpo}", ("preset: {'name': 'gigpo'}", "a mapping, for a name")),
    ("max_turns: true", ("max_turns: True", "a boolean, for a whole number")),
])
def test_a_recipe_value_of_the_wrong_type_is_one_line_and_exit_2(line, needles, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"env_name: tiny\nuse_cpu: true\n{line}\n")
    with pytest.raises(SystemExit) as stop:
        train.parse_args(["--config", str(recipe)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(needle in err for needle in (*needles, str(recipe))), err
    recipe.write_text("env_name: tiny\nuse_cpu: true\nlearning_rate: 1.0e-6\nmax_steps: 3\nenv_kwargs: {size: 4}\n"
                      "lora_target_modules: [q_proj, v_proj]\nreport_to: [none]\n")  # every type as its field takes it
    train.parse_args(["--config", str(recipe)])
