"""The documentation stays true to the code: the site builds with `mkdocs build --strict` (a broken link,
a page left out of the nav or a docstring that no longer renders fails it), the CLI page is what the
programs' `--help` prints now, and every command line in the README, the docs and the studies' READMEs
names only flags its program accepts (each program's `--help` run once; the commands are not run)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "studies").rglob("README.md"))]
PAGES = list(dict.fromkeys(p for p in PAGES if "docs/studies/" not in str(p)))  # docs/studies links to studies/


def _load_make_cli():
    spec = importlib.util.spec_from_file_location("make_cli", ROOT / "docs" / "reference" / "make_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE_CLI = _load_make_cli()
HELP_TEXTS = MAKE_CLI.help_texts  # the real one: the CLI-page test swaps in the session's cache


_HELP: dict[tuple[str, ...], str] = {}


def run_help(argv: tuple[str, ...]) -> str:
    """A program's `--help`, once per test session (the CLI page's generator and the flag check share it)."""
    if argv not in _HELP:
        prefetch([argv])
    return _HELP[argv]


def flags_of(argv: tuple[str, ...]) -> frozenset[str]:
    return frozenset(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", run_help(argv)))


def prefetch(argvs) -> None:
    """Each program's `--help` costs seconds of imports: one process prints all those not yet seen, and
    the CLI page's programs with them, so the two tests that read helps share one process."""
    wanted = {tuple(argv) for argv in argvs} | {tuple(argv) for _, _, argv in MAKE_CLI.PROGRAMS}
    missing = sorted(wanted - _HELP.keys())
    if missing:
        _HELP.update(HELP_TEXTS([list(argv) for argv in missing]))


def program(words: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """(the argv that prints the program's help, the words after the program) for a command we own."""
    for i, word in enumerate(words):
        if word == "train.py":
            return ("train.py",), words[i + 1:]
        if word in ("bipace-eval", "bipace-report"):
            module = {"bipace-eval": "bipace_trainer.cli.evaluate", "bipace-report": "bipace_trainer.reports.report"}[word]
            return ("-m", module), words[i + 1:]
        if word == "-m" and i + 1 < len(words) and re.match(r"(bench|studies|bipace_trainer|envs)\.", words[i + 1]):
            return ("-m", words[i + 1]), words[i + 2:]
    return None


def command_lines() -> list[tuple[str, str]]:
    """(page, one command) for every line of every ```bash block, continuations joined, comments cut."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    for part in re.split(r"&&|;|\|", line):
                        found.append((str(page.relative_to(ROOT)), part.strip()))
    return found


def commands() -> list[tuple[str, tuple[str, ...], list[str], str]]:
    out = []
    for page, line in command_lines():
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        found = program(words)
        if found:
            out.append((page, found[0], found[1], line))
    return out


def test_the_docs_name_commands_to_check():
    # the scan must see the README's main command and the studies' and benches' commands, or it checks nothing
    names = {argv for _, argv, _, _ in commands()}
    assert ("train.py",) in names and ("-m", "studies.learning.study") in names and len(names) >= 6, names


def test_every_documented_command_line_names_only_flags_its_program_has():
    prefetch(argv for _, argv, _, _ in commands())
    wrong = []
    for page, argv, rest, line in commands():
        for word in rest:
            flag = word.split("=")[0]
            if flag.startswith("--") and flag not in flags_of(argv):
                wrong.append(f"{page}: {flag} is not a flag of `{' '.join(argv)}`: {line}")
    assert not wrong, "\n".join(wrong)


def test_the_cli_reference_is_current(monkeypatch):
    prefetch(tuple(argv) for _, _, argv in MAKE_CLI.PROGRAMS)
    monkeypatch.setattr(MAKE_CLI, "help_texts", lambda argvs: {tuple(argv): run_help(tuple(argv)) for argv in argvs})
    assert MAKE_CLI.PAGE.read_text() == MAKE_CLI.page(), "docs/reference/cli.md is stale: run python docs/reference/make_cli.py"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed: pip install -e '.[docs]' (dev includes it)")
def test_the_site_builds_strict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "data_flow.png" in home and "bipace-trainer" in home
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "BiPACEConfig" in api and "evaluate_policy" in api  # the docstrings rendered


def test_ci_builds_the_site_in_the_tests_venv():
    ci = (ROOT / ".ci" / "run").read_text()
    tests_install = ci.index("readme_command '&& pytest')\"")
    assert ci.index("mkdocs build --strict") > tests_install, "CI builds the docs after the tests' install, in its venv"


def test_the_own_env_tutorial_example_plays(tmp_path):
    from envs import make_env

    page = (ROOT / "docs" / "tutorials" / "own-env.md").read_text()
    code = re.search(r"## Write one\n.*?```python\n(.*?)\n```", page, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "own-env.md", "exec"), namespace)
    env_class = namespace["GuessEnv"]
    assert [t.task_id for t in env_class.tasks("valid")] == [5]
    env = make_env("guess")
    assert isinstance(env, env_class)
    first = env.reset(task_id=3)
    assert not first.done and first.anchor == first.observation
    wrong = env.step("1")
    assert "higher" in wrong.observation and not wrong.done
    won = env.step(env.expert_action())
    assert won.done and won.won and won.reward == 1.0
    from bipace_trainer import BiPACEConfig  # the page says beacon refuses it: it gives no milestones

    with pytest.raises(ValueError, match="preset='beacon' reads milestones"):
        BiPACEConfig(output_dir=str(tmp_path), env_name="guess", preset="beacon", report_to="none", tasks_per_iteration=1,
                     num_generations=2, per_device_train_batch_size=2)  # fmt: skip
