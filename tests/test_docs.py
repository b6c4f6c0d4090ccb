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


# ------------------------------------------------------------------ figures that a commit could stale

# A measured figure: a time, a size, a rate or a ratio ("557 s", "1.29 GiB", "236 tokens/s", "2.9×").
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|s|min|minutes|seconds|hours|h|GB|MB|GiB|MiB|kB|KB|"
                      r"tokens/s|steps/s|it/s)(?![\w/])|(?<![\w.])\d+(?:\.\d+)?×(?!\s?\d)")  # fmt: skip
# What places it: a date, a machine, a command that measures it.
PLACED = {"date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
          "machine": re.compile(r"\bcores?\b|GPU|H100|H200|EPYC|AVX|machine", re.I),
          "command": re.compile(r"`[^`\n]*(?:python|pytest|bench[./]|studies\.|train\.py|bipace-)[^`\n]*`|```bash")}  # fmt: skip
# A count of the project itself, stale at the next commit that adds a test or a file.
PROJECT_COUNT = re.compile(r"(?<![\w.])\d[\d,]*\s+(?:(?:fast|slow|end-to-end)\s+)?(?:tests|test files|lines of code|source files)\b(?!/)")
GENERATED = re.compile(r"<!-- generated: .*? -->.*?<!-- end generated -->", re.S)
# Pages of measurements: each is dated as a whole (its date, machine and commands), its tables hold the figures.
RESULT_PAGES = [ROOT / "docs" / "RESULTS.md", ROOT / "docs" / "performance.md", *sorted((ROOT / "docs" / "results").glob("*.md"))]
PROSE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "tutorials").glob("*.md")),
               *sorted((ROOT / "docs" / "concepts").glob("*.md"))]  # fmt: skip
PROSE_PAGES = [page for page in PROSE_PAGES if page not in RESULT_PAGES]


def prose(text: str, keep_tables: bool = True) -> str:
    """`text` without generated blocks and code blocks (bash blocks are kept: they are commands), and
    without tables unless `keep_tables`."""
    blocks = re.compile(r"```(\w*)\n.*?```", re.S)  # whole blocks, in order: a closing fence never opens one
    text = blocks.sub(lambda block: block.group(0) if block.group(1) == "bash" else "", GENERATED.sub("", text))
    return "\n".join(line for line in text.splitlines() if keep_tables or not line.lstrip().startswith("|"))


def unplaced(text: str) -> list[str]:
    """What a text holding a measured figure does not name of its date, machine and command. A figure
    written as code (`256 MB`, a setting's value; a size computed from a shape) is not a measurement."""
    measured = MEASURED.search(re.sub(r"`[^`\n]*`", "", text))
    return [name for name, pattern in PLACED.items() if not pattern.search(text)] if measured else []


def test_every_measured_figure_in_a_prose_page_names_its_date_machine_and_command_in_its_section():
    wrong = []
    for page in PROSE_PAGES:
        for section in re.split(r"\n(?=#{1,4} )", prose(page.read_text())):
            missing = unplaced(section)
            if missing:
                wrong.append(f"{page.relative_to(ROOT)} [{section.lstrip().splitlines()[0][:70]}]: "
                             f"{MEASURED.findall(section)[:4]} without a {', '.join(missing)}")  # fmt: skip
    assert not wrong, "measured figures nobody can place (name when, where and how, or drop them):\n" + "\n".join(wrong)


def test_every_results_page_names_its_dates_machines_and_commands():
    wrong = [f"{page.relative_to(ROOT)}: no {', '.join(unplaced(page.read_text()))}"
             for page in RESULT_PAGES if unplaced(page.read_text())]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_no_page_counts_the_projects_tests_or_files_in_prose():
    found = [f"{page.relative_to(ROOT)}: {match.group(0)!r}" for page in [*PROSE_PAGES, *RESULT_PAGES]
             for match in PROJECT_COUNT.finditer(prose(page.read_text()))]  # fmt: skip
    assert not found, "a count the next commit makes wrong (drop it, or generate it):\n" + "\n".join(found)


def test_the_figure_checks_find_what_they_look_for():
    assert unplaced("It took 557 s wall.") == ["date", "machine", "command"]
    assert unplaced("On 2026-12-01, 2 cores: `python train.py` took 557 s.") == []
    assert unplaced("learning rate 5e-4, 3 steps of 4 rollouts") == []  # no measured figure
    assert unplaced("a store bounded by `256 MB`") == []  # a setting, written as code
    assert unplaced(prose("<!-- generated: x -->\ntime: 557 s\n<!-- end generated -->\n")) == []
    assert PROJECT_COUNT.search("the 1,304 fast tests") and not PROJECT_COUNT.search("15 files of a few MB")
    assert prose("```bash\npytest\n```\n(35 tests)\n```python\nx = 1\n```\n") == "```bash\npytest\n```\n(35 tests)\n"


def test_the_readme_says_what_the_browser_tests_need_as_their_skip_reason_does():
    readme = (ROOT / "README.md").read_text().split("## The two commands")[1].split("```bash")[1]
    skip = (ROOT / "tests" / "reports" / "test_report_browser.py").read_text().split("needs_chromium = ")[1].split("\n)")[0]
    for text in (readme, skip):
        assert "Debian's chromium" in text and re.search(r"apt-get install (-y )?chromium", text), text


# ------------------------------------------------------------------ the main job's recorded run


def _load_main_job_pages():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "results" / "main_job" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_jobs_blocks_are_what_the_recorded_run_and_the_summary_code_print():
    pages = _load_main_job_pages()
    assert not pages.stale_pages(), "run python docs/results/main_job/regenerate.py"
    summaries = [re.search(r"```\n(=== summary ===\n.*?)```", GENERATED.search(page.read_text()).group(0), re.S).group(1)
                 for page in (pages.README, pages.QUICKSTART)]  # fmt: skip
    assert summaries[0] == summaries[1] == pages.summary_text(pages.kept_run()["summary"])
    assert "time: " in summaries[0] and "success after RL (held-out) : " in summaries[0]


def test_the_main_jobs_blocks_follow_the_summary_code(monkeypatch):
    from bipace_trainer.cli import run_end

    pages = _load_main_job_pages()
    original = run_end.print_summary
    monkeypatch.setattr(run_end, "print_summary", lambda *args, **kwargs: (original(*args, **kwargs), print("one more line")))
    assert pages.stale_pages() == [pages.README, pages.QUICKSTART]  # a change to the printed summary stales both pages
