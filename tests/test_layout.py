"""The package layout (issue 42): each subpackage imports only what its docstring allows, and no
module of `bipace_trainer/` or `envs/` imports itself back through others, not even from inside a
function (issue 49)."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "bipace_trainer"

# What each part of the package may import from the package (its own part always). A part is a
# subpackage, or a top-level module by its name. Mirrors the subpackages' docstrings.
ALLOWED = {
    "advantages": set(),
    "rollout": {"advantages", "trl_compat"},
    "reports": {"models", "trl_compat"},
    "run": {"rollout", "advantages", "reports", "models"},
    # what meets TRL's loss: the trainer's base class, the batch, the shared-prefix forward
    "update": {"rollout", "advantages", "run", "trl_compat"},
    "cli": {"advantages", "rollout", "run", "reports", "config", "models", "trainer", "update", "trl_compat"},
    "config": {"advantages", "rollout", "update"},  # the settings it checks (presets, ROLLOUT_MODES, AGGREGATIONS)
    "models": set(),
    "trl_compat": set(),  # TRL's and vLLM's internals, for every other part
    "trainer": {"advantages", "rollout", "run", "reports", "config", "models", "update", "trl_compat"},
    "__init__": {"config", "trainer", "rollout"},
}
SUBPACKAGES = ("advantages", "rollout", "update", "run", "reports", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def _is_module(name: str) -> bool:
    return (PACKAGE_DIR / f"{name}.py").is_file() or (PACKAGE_DIR / name / "__init__.py").is_file()


def package_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the package in `path`, typing-only ones included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import run_dir` imports a module: judge it by the module's own part
            if module == "bipace_trainer":  # a name that is not a module comes from the package's __init__
                found += [(node.lineno, f"bipace_trainer.{a.name}" if _is_module(a.name) else module) for a in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, module) for line, module in found if module.split(".")[0] == "bipace_trainer"]


MODULES = sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_belongs_to_a_part_with_rules():
    # a new top-level module needs a place: a subpackage, or a rule here
    assert {part(module_name(path)) for path in MODULES} <= set(ALLOWED)


def violations(path: Path, imports: list[tuple[int, str]]) -> list[str]:
    own = part(module_name(path))
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for line, module in imports
        if "." in module and part(module) != own and part(module) not in ALLOWED[own]
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_each_module_imports_only_what_its_part_may(path):
    wrong = violations(path, package_imports(path))
    assert not wrong, f"{part(module_name(path))} may import only {sorted(ALLOWED[part(module_name(path))])}: " + "; ".join(wrong)


def test_the_rules_catch_a_forbidden_import():
    # the checker itself: a rollout module reaching into run/, or reports/ into rollout/, is flagged
    collector, show = PACKAGE_DIR / "rollout" / "collector.py", PACKAGE_DIR / "reports" / "show.py"
    assert violations(collector, [(1, "bipace_trainer.run.checkpointing"), (2, "bipace_trainer.advantages")]) == [
        "bipace_trainer/rollout/collector.py:1 imports bipace_trainer.run.checkpointing"
    ]
    assert len(violations(show, [(3, "bipace_trainer.rollout.loop"), (4, "bipace_trainer.trainer")])) == 2


def test_no_module_but_the_trainer_and_the_command_lines_names_the_trainer_class():
    # annotations included (string ones too): a helper takes the narrow things it uses
    named = []
    for path in MODULES:
        relative = str(path.relative_to(PACKAGE_DIR))
        if relative in ("trainer.py", "__init__.py") or relative.startswith("cli/"):  # __init__: the public API
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
            if isinstance(name, str) and name.strip("'\"") == "BiPACETrainer":
                named.append(f"{relative}:{node.lineno}")
    assert not named, named


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_each_subpackage_says_what_it_owns_and_may_import(name):
    doc = importlib.import_module(f"bipace_trainer.{name}").__doc__ or ""
    assert doc.strip() and ("may import" in doc.lower() or name == "advantages"), name


def test_console_scripts_name_functions_that_exist():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_the_suites_long_files_name_test_files():
    # tests/conftest.py schedules these first; a renamed file would silently lose its place.
    from tests.conftest import LONG_FILES

    for name in LONG_FILES:
        path = ROOT / name
        assert path.is_file() and path.name.startswith("test_"), f"LONG_FILES in tests/conftest.py: {name} is not a test file"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_the_tests_mirror_the_package(name):
    # a subpackage's tests live in tests/<subpackage>/, so the tree shows where each one is tested
    folder = ROOT / "tests" / name
    assert (folder / "__init__.py").is_file() and any(folder.glob("test_*.py")), f"tests/{name}/ holds no tests"
