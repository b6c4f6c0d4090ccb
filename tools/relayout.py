"""Move `bipace_trainer/` from its flat layout into subpackages and rewrite every import (issue 42, item 3).

    python tools/relayout.py            # from the repository root; then `git add -A && git commit`
    python tools/relayout.py --check    # exit 1 if anything is left to do, change nothing

Idempotent: on the new layout it changes nothing, so it can be rerun after work done on the old
layout is merged. To redo the layout on a branch that is still flat (instead of merging it):

    git checkout layout -- tools/relayout.py && git reset -q && python tools/relayout.py
    git add -A && git commit -m "Layout (issue 42): ..."
    git cherry-pick <the layout branch's later commits>   # tests/test_layout.py, the narrowed helpers

What it does, in order:

1. for every tracked or untracked `*.py` outside `.git` (package, tests, bench, envs, train.py) and
   `pyproject.toml`: dotted references to a moved module (`bipace_trainer.collector`, in strings,
   comments, `mock.patch` targets, `[project.scripts]`) and paths (`bipace_trainer/collector.py`)
   get the new name; then each `import` statement that names a moved module, relative or absolute,
   is rewritten where it stands (only the module part of `from X import ...`; a `from . import a, b`
   whose names now live in different packages becomes one line per package);
2. `git mv` of each moved file (`MOVES`), so git's rename detection follows the history;
3. writes each subpackage's `__init__.py` (what it owns, what it may import) and
   `bipace_trainer/_old_paths.py`, the aliases that keep the old import paths working for one
   release, and installs them from `bipace_trainer/__init__.py`.

It leaves README.md and docs/ alone (the old commands keep working through the aliases) and names
any top-level module that is neither moved nor meant to stay at the top.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "bipace_trainer"

# old module under bipace_trainer/ -> its new dotted name under bipace_trainer/
MOVES = {
    "rollout": "rollout.loop",
    "collector": "rollout.collector",
    "tool_envs": "rollout.tool_envs",
    "vllm_backend": "rollout.vllm_backend",
    "hidden": "rollout.hidden",
    "prompting": "rollout.prompting",
    "actions": "rollout.actions",
    "batching": "rollout.batching",
    "trajectories": "rollout.trajectories",
    "checkpointing": "run.checkpointing",
    "callbacks": "run.callbacks",
    "run_dir": "run.run_dir",
    "resampling": "run.resampling",
    "evaluation": "run.evaluation",
    "warm_start": "run.warm_start",
    "demonstrations": "run.demonstrations",
    "report": "reports.report",
    "show": "reports.show",
    "run_summary": "reports.run_summary",
    "model_card": "reports.model_card",
    "evaluate": "cli.evaluate",
}
STAYS = {"__init__", "_old_paths", "config", "trainer", "models", "micro_batches", "trl_metrics", "memory"}  # the trainer and its own helpers

SUBPACKAGE_DOCS = {
    "rollout": '''"""Playing episodes, and what each played step becomes: everything between an env and TRL's batch.

    loop            run_rollouts: lockstep or continuous multi-turn rollouts → Rollout (StepRecord, Episode), TaskRef,
                    EnvAdapter / TextEnvAdapter (SPEC §1)
    collector       RolloutCollector: the trainer's one way to play, training and evaluation alike
    tool_envs       TRL's environment_factory / tools played turn by turn (ToolEnvAdapter)
    vllm_backend    what the multi-turn rollout adds to TRL's vLLM generation
    vllm_stream     the continuous rollout through vLLM's own continuous batching (colocate, server)
    prefix_cache    HF generate that prefills only the prompt tokens whose KV is not known yet
    hidden          the actor's hidden state at one layer (BiGPO's φ(s)), by hook or prefill
    prompting       the step's prompt (GiGPO's format); actions: reply → env action, validity, key
    batching        a rollout's steps made into TRL's training batch (one row per env step)
    overlap         the next generation played on a background thread while the update runs (max_staleness=1)
    trajectories    what the agent did, readable: step rows, the completions table, rollout dumps

May import: `bipace_trainer.advantages` (StepBatch, the estimate it records), `envs`, TRL,
transformers. Never `run/`, `reports/`, `cli/`, `trainer` or `config`: the trainer drives the
rollout, never the other way round (the collector takes TRL's `GRPOTrainer` for generation).

`bipace_trainer.rollout` was the loop's own module before this package; its names (`Rollout`,
`TaskRef`, ...) still resolve here, with a DeprecationWarning, for one release.
"""

import importlib as _importlib
import warnings as _warnings

_SUBMODULES = {
    "loop", "collector", "tool_envs", "vllm_backend", "vllm_stream", "prefix_cache", "hidden", "prompting", "actions",
    "batching", "trajectories", "overlap",
}


def __getattr__(name):
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loop = _importlib.import_module(".loop", __name__)
    if not hasattr(loop, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(
        f"bipace_trainer.rollout.{name} moved to bipace_trainer.rollout.loop.{name}; "
        "the old path is kept for one release.",
        DeprecationWarning,
        stacklevel=2,
    )
    globals()[name] = value = getattr(loop, name)  # warned once per name
    return value
''',
    "run": '''"""A training run's life around the update: where it lives, how it stops, saves, resumes and is evaluated.

    run_dir         whose run an output_dir holds (checked before any weights load), what a stopped run left
    checkpointing   what a checkpoint holds besides TRL's, written atomically; the exact resume
    callbacks       the graceful stop on SIGTERM, the numeric progress bar
    resampling      dynamic sampling (DAPO's), bounded in attempts and time, stoppable
    evaluation      held-out evaluation: which tasks, the summary, when it runs (its callbacks)
    warm_start      the supervised warm start before RL (TRL's SFTTrainer, LoRA);
                    demonstrations: its data, an env expert's (perturbed) play

May import: `rollout/`, `advantages/`, `reports/` (the model card's own README check), `models`.
Never `trainer` or `cli/`: each helper takes the narrow objects it reads or writes (a Protocol
where it needs several), so no module but trainer.py knows `BiPACETrainer`.
"""
''',
    "reports": '''"""Reading what a run wrote: the HTML report, a dump in the terminal, the end-of-run summary, the model card.

    report          one self-contained HTML page per run (bipace-report)
    show            a rollout dump in the terminal, episode by episode (python -m bipace_trainer.reports.show)
    run_summary     success with its Wilson interval, the valid-action rate, the learning curve
    model_card      the model card written next to the weights and pushed to the Hub

May import: `models` (the cache directory) and nothing else of the package: these read files
(trainer_state.json, rollout dumps, eval_history) and plain values, so they work on any run's
output directory without a trainer, a model or an env. Never `rollout/`, `run/`, `trainer`, `cli/`.
"""
''',
    "cli": '''"""Command lines that build a trainer: `bipace-eval` (evaluate). train.py, at the repository root, is the other.

May import everything in the package; nothing in the package imports `cli/`.
"""
''',
}

OLD_PATHS = '''"""The flat layout's module paths (before issue 42), kept as aliases for one release.

`import bipace_trainer.collector` gives `bipace_trainer.rollout.collector` itself, the same module
object (so patching either path patches both), and warns once, naming the new path;
`python -m bipace_trainer.show` runs the new module as `__main__`. `bipace_trainer.rollout`, the
loop's module before, is now the rollout package: its old names resolve through that package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {moved}


def _warn(old: str, new: str) -> None:
    # stacklevel 3 is the importing line: warnings skips the import machinery's own frames, so
    # Python's default filter shows this when the import is in a script's __main__.
    warnings.warn(f"{{old}} moved to {{new}}; the old path is kept for one release.", DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None  # a placeholder, replaced in sys.modules by the real module in exec_module

    def exec_module(self, module) -> None:
        _warn(module.__name__, self.new)
        sys.modules[module.__name__] = importlib.import_module(self.new)  # the import system returns this one

    def is_package(self, fullname: str) -> bool:
        return False

    def get_code(self, fullname: str):
        # `python -m <old path>` (runpy asks the loader for code): run the new module as __main__.
        _warn(fullname, self.new)
        source = f"import runpy\\nrunpy.run_module({{self.new!r}}, run_name='__main__', alter_sys=True)\\n"
        return compile(source, f"<{{fullname}}: alias of {{self.new}}>", "exec")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Resolve the old paths before any other finder: an editable install of an older checkout, or a
    file left at an old path, would otherwise give a second copy of a module."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
'''

INIT_HOOK = (
    "\nfrom ._old_paths import install as _install_old_paths\n\n"
    "_install_old_paths()  # the flat layout's module paths, for one release\n"
)

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {f"{PACKAGE}/{name}/__init__.py" for name in SUBPACKAGE_DOCS} | {f"{PACKAGE}/_old_paths.py"}
SKIP = GENERATED | {"tools/relayout.py", "tests/test_layout.py"}  # these name the old paths on purpose
OLD = {f"{PACKAGE}.{old}": f"{PACKAGE}.{new}" for old, new in MOVES.items()}
PACKAGES = {f"{PACKAGE}.{name}" for name in SUBPACKAGE_DOCS}  # `bipace_trainer.rollout`: a real package now
# modules written inside rollout/ after the move: no old flat path, and never `rollout.loop.<name>`
BORN_IN_ROLLOUT = {"overlap", "vllm_stream", "prefix_cache", "policy"}
ROLLOUT_SUBMODULES = {new.split(".")[1] for new in MOVES.values() if new.startswith("rollout.")} | BORN_IN_ROLLOUT


def reference_patterns() -> list[tuple[re.Pattern, str]]:
    """Dotted names and file paths of moved modules, outside import statements' relative forms."""
    patterns = []
    for old, new in MOVES.items():
        # `bipace_trainer.rollout` is both an old module and the new package: leave its new submodules
        # and its import statements (rewritten by the ast pass, which can tell them apart) alone.
        guard = rf"(?!\.(?:{'|'.join(sorted(ROLLOUT_SUBMODULES))})\b|\s+import\b)" if old == "rollout" else ""
        patterns.append((re.compile(rf"\b{PACKAGE}\.{old}\b{guard}"), f"{PACKAGE}.{new}"))
        patterns.append((re.compile(rf"\b{PACKAGE}/{old}\.py\b"), f"{PACKAGE}/{new.replace('.', '/')}.py"))
    return patterns


def module_names(path: str) -> tuple[str, str]:
    """(module name at `path` now, its name after the move)."""
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, OLD.get(name, name) if len(parts) == 2 else name


def package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def relative(target: str, package: str) -> str:
    """`target` as seen from `package`: `..reports`, `.hidden`, `.`."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def wrap(line: str, limit: int = 130) -> str:
    """A one-line `from X import a, b  # comment` grown past `limit` (pyproject's ruff line-length),
    parenthesized over several lines."""
    body, newline = line.rstrip("\n"), line[len(line.rstrip("\n")) :]
    head, sep, names = body.partition(" import ")
    if len(body) <= limit or not sep or "(" in names:
        return line
    names, _, comment = names.partition("  #")
    indent = " " * (len(head) - len(head.lstrip()))
    rows, row = [], ""
    for name in (n.strip() for n in names.split(",")):
        if row and len(indent) + 4 + len(row) + len(name) + 2 > limit:
            rows.append(row)
            row = ""
        row += f"{name}, "
    rows.append(row)
    opening = f"{head} import (" + (f"  #{comment}" if comment else "")
    return "\n".join([opening, *(f"{indent}    {r.rstrip()}" for r in rows), f"{indent})"]) + newline


def rewrite_imports(text: str, path: str) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    in_package = path.startswith(f"{PACKAGE}/")
    now, after = module_names(path) if in_package else ("", "")
    edits = []  # (first line, last line, replacement lines or None, new module text)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if not in_package:
                continue
            base = package_of(now, path).split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module != PACKAGE and not module.startswith(PACKAGE + "."):
            continue
        groups: dict[str, list[str]] = {}
        renamed = False
        for alias in node.names:
            sub, name = f"{module}.{alias.name}", alias.name
            if sub in OLD:  # `from bipace_trainer import collector`: a moved module
                target, _, name = OLD[sub].rpartition(".")
            elif module in OLD and not (module == f"{PACKAGE}.rollout" and alias.name in ROLLOUT_SUBMODULES):
                target = OLD[module]  # `from bipace_trainer.collector import X`
            else:
                target = module
            bound = alias.asname or (alias.name if name != alias.name else None)  # `rollout` -> `loop as rollout`
            renamed |= name != alias.name
            groups.setdefault(target, []).append(name + (f" as {bound}" if bound else ""))
        new_package = package_of(after, path) if in_package else ""

        def spell(target: str) -> str:
            return relative(target, new_package) if node.level else target

        if len(groups) == 1 and not renamed:
            (target,) = groups
            edits.append((node.lineno, node.col_offset, None, spell(target)))
        elif len(groups) > 1 or renamed:
            indent = " " * node.col_offset
            names = [f"{indent}from {spell(target)} import {', '.join(aliases)}\n" for target, aliases in groups.items()]
            edits.append((node.lineno, node.end_lineno, names, None))
    for first, last_or_col, replacement, spelled in sorted(edits, key=lambda e: -e[0]):
        if replacement is None:
            line, col = lines[first - 1], last_or_col
            head = re.compile(r"from\s+([.\w]+)\s+import\b")
            match = head.match(line, col)
            if match and match.group(1) != spelled:
                lines[first - 1] = wrap(line[: match.start(1)] + spelled + line[match.end(1) :])
        else:
            lines[first - 1 : last_or_col] = replacement
    return "".join(lines)


def rewrite_text(text: str, path: str) -> str:
    patterns, lines = reference_patterns(), []
    for line in text.splitlines(keepends=True):
        new = line
        for pattern, replacement in patterns:
            new = pattern.sub(replacement, new)
        lines.append(wrap(new) if new != line and new.lstrip().startswith("from ") and path.endswith(".py") else new)
    text = "".join(lines)
    return rewrite_imports(text, path) if path.endswith(".py") else text


def candidate_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    wanted = (p for p in set(listed) if p.endswith(".py") or p == "pyproject.toml")
    return sorted(p for p in wanted if p not in SKIP and (ROOT / p).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report what is left to do, change nothing (exit 1 if anything)")
    check = parser.parse_args(argv).check
    todo = []

    for path in candidate_files():
        text = (ROOT / path).read_text()
        new = rewrite_text(text, path)
        if new != text:
            todo.append(f"rewrite {path}")
            if not check:
                (ROOT / path).write_text(new)

    for old, new in MOVES.items():
        source, target = ROOT / PACKAGE / f"{old}.py", ROOT / PACKAGE / f"{new.replace('.', '/')}.py"
        if source.exists() and target.exists():
            raise SystemExit(f"both {source} and {target} exist: merge them by hand, then rerun.")
        if source.exists():
            todo.append(f"git mv {source.relative_to(ROOT)} {target.relative_to(ROOT)}")
            if not check:
                target.parent.mkdir(exist_ok=True)
                subprocess.run(["git", "mv", str(source), str(target)], cwd=ROOT, check=True)

    generated = {f"{PACKAGE}/{name}/__init__.py": doc for name, doc in SUBPACKAGE_DOCS.items()}
    aliases = "".join(f'    "{old}": "{new}",\n' for old, new in OLD.items() if old not in PACKAGES)
    generated[f"{PACKAGE}/_old_paths.py"] = OLD_PATHS.format(moved="{\n" + aliases + "}")
    for path, content in generated.items():
        file = ROOT / path
        if not file.exists() or file.read_text() != content:
            todo.append(f"write {path}")
            if not check:
                file.parent.mkdir(exist_ok=True)
                file.write_text(content)
    init = ROOT / PACKAGE / "__init__.py"
    text = init.read_text()
    if "_install_old_paths()" not in text:
        todo.append(f"install the aliases in {PACKAGE}/__init__.py")
        if not check:
            anchor = re.search(r"^__version__ = .*\n", text, re.M)
            at = anchor.end() if anchor else len(text)
            init.write_text(text[:at] + INIT_HOOK + text[at:])

    leftovers = sorted(p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem not in STAYS)
    for name in leftovers:
        print(f"note: {PACKAGE}/{name}.py is neither moved nor meant for the top level; add it to MOVES or STAYS.")
    print("\n".join(todo) if todo else "nothing to do: the layout is current.")
    return 1 if check and todo else 0


if __name__ == "__main__":
    sys.exit(main())
