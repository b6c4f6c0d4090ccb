"""train.py as a newcomer meets it: `--help` shows the project's options first, and a bad
setting is refused with one line (field, value, fix) and argparse's exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import train  # noqa: E402
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
