"""The package layout (issue 42): each subpackage imports only what its docstring allows, and the
flat layout's module paths still work, as the very same modules, for one release."""

from __future__ import annotations

import ast
import importlib
import os
import pickle
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import bipace_trainer
from bipace_trainer._old_paths import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "bipace_trainer"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))

# What each part of the package may import from the package (its own part always). A part is a
# subpackage, or a top-level module by its name. Mirrors the subpackages' docstrings.
ALLOWED = {
    "advantages": set(),
    "rollout": {"advantages"},
    "reports": {"models"},
    "run": {"rollout", "advantages", "reports", "models"},
    "cli": {"advantages", "rollout", "run", "reports", "config", "models", "trainer", "micro_batches", "trl_metrics", "memory",
            "shared_prefix"},
    "config": {"advantages", "rollout"},  # the settings it checks (presets, ROLLOUT_MODES)
    "models": set(),
    "micro_batches": set(),
    "trl_metrics": set(),
    "memory": set(),
    "shared_prefix": set(),
    "trainer": {"advantages", "rollout", "run", "reports", "config", "models", "micro_batches", "trl_metrics", "memory",
                "shared_prefix"},
    "_old_paths": set(),
    "__init__": {"config", "trainer", "_old_paths"},
}
SUBPACKAGES = ("advantages", "rollout", "run", "reports", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


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
            if module == "bipace_trainer":
                found += [(node.lineno, f"bipace_trainer.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, module) for line, module in found if module.split(".")[0] == "bipace_trainer"]


MODULES = sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_belongs_to_a_part_with_rules():
    # a new top-level module needs a place: a subpackage, or a rule here and in tools/relayout.py's STAYS
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


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_and_warns_once(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        aliased = importlib.import_module(old)
    assert aliased is new
    assert getattr(bipace_trainer, old.rpartition(".")[2]) is new  # `bipace_trainer.collector` too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is new  # once: the second import is sys.modules'


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_from_imports_give_the_same_objects(old):
    new = importlib.import_module(MOVED[old])
    names = [n for n, v in vars(new).items() if not n.startswith("_") and getattr(v, "__module__", None) == new.__name__]
    assert names, f"{new.__name__} defines nothing public?"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(f"from {old} import {', '.join(names)}", namespace)
        exec(f"from bipace_trainer import {old.rpartition('.')[2]} as module", namespace)
    assert all(namespace[n] is getattr(new, n) for n in names)
    assert namespace["module"] is new


def test_the_old_rollout_module_names_resolve_through_the_rollout_package():
    from bipace_trainer.rollout import loop

    public = [n for n, v in vars(loop).items() if not n.startswith("_") and getattr(v, "__module__", None) == loop.__name__]
    assert {"Rollout", "TaskRef", "EnvAdapter", "run_rollouts"} <= set(public)
    import bipace_trainer.rollout as package

    for name in public:
        package.__dict__.pop(name, None)  # as on first use
        with pytest.warns(DeprecationWarning, match=f"rollout.loop.{name}"):
            assert getattr(package, name) is getattr(loop, name)
    # a checkpoint or pickle written before the move names the old paths
    assert pickle.loads(b"cbipace_trainer.rollout\nTaskRef\n.") is loop.TaskRef
    from bipace_trainer.rollout.collector import RolloutCollector

    assert pickle.loads(b"cbipace_trainer.collector\nRolloutCollector\n.") is RolloutCollector
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from bipace_trainer.rollout import no_such_name", {})


@pytest.mark.parametrize(
    "old, new",
    [("bipace_trainer.show", "bipace_trainer.reports.show"), ("bipace_trainer.report", "bipace_trainer.reports.report"),
     ("bipace_trainer.evaluate", "bipace_trainer.cli.evaluate")],
)
def test_python_dash_m_runs_the_old_and_the_new_path(old, new):
    for module in (old, new):
        proc = subprocess.run(
            [sys.executable, "-W", "always::DeprecationWarning", "-m", module, "--help"],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage:"), proc.stdout
        assert (f"{old} moved to {new}" in proc.stderr) == (module == old), proc.stderr


def test_console_scripts_point_at_the_new_modules():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert module not in MOVED, f"[project.scripts] {name} = {target!r} names an old path"
        assert callable(getattr(importlib.import_module(module), function)), target


def test_the_relayout_script_has_nothing_left_to_do():
    # New code written against the flat layout (merged from older branches) is caught here;
    # `python tools/relayout.py` rewrites it.
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the script lists files with git")
    proc = subprocess.run([sys.executable, "tools/relayout.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suites_long_files_name_test_files():
    # tests/conftest.py schedules these first; a renamed file would silently lose its place.
    from tests.conftest import LONG_FILES

    for name in LONG_FILES:
        path = ROOT / name
        assert path.is_file() and path.name.startswith("test_"), f"LONG_FILES in tests/conftest.py: {name} is not a test file"
