"""The flat layout's module paths (before issue 42), kept as aliases for one release.

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

MOVED = {
    "bipace_trainer.collector": "bipace_trainer.rollout.collector",
    "bipace_trainer.tool_envs": "bipace_trainer.rollout.tool_envs",
    "bipace_trainer.vllm_backend": "bipace_trainer.rollout.vllm_backend",
    "bipace_trainer.hidden": "bipace_trainer.rollout.hidden",
    "bipace_trainer.prompting": "bipace_trainer.rollout.prompting",
    "bipace_trainer.actions": "bipace_trainer.rollout.actions",
    "bipace_trainer.batching": "bipace_trainer.rollout.batching",
    "bipace_trainer.trajectories": "bipace_trainer.rollout.trajectories",
    "bipace_trainer.checkpointing": "bipace_trainer.run.checkpointing",
    "bipace_trainer.callbacks": "bipace_trainer.run.callbacks",
    "bipace_trainer.run_dir": "bipace_trainer.run.run_dir",
    "bipace_trainer.resampling": "bipace_trainer.run.resampling",
    "bipace_trainer.evaluation": "bipace_trainer.run.evaluation",
    "bipace_trainer.warm_start": "bipace_trainer.run.warm_start",
    "bipace_trainer.demonstrations": "bipace_trainer.run.demonstrations",
    "bipace_trainer.report": "bipace_trainer.reports.report",
    "bipace_trainer.show": "bipace_trainer.reports.show",
    "bipace_trainer.run_summary": "bipace_trainer.reports.run_summary",
    "bipace_trainer.model_card": "bipace_trainer.reports.model_card",
    "bipace_trainer.evaluate": "bipace_trainer.cli.evaluate",
}


def _warn(old: str, new: str) -> None:
    # stacklevel 3 is the importing line: warnings skips the import machinery's own frames, so
    # Python's default filter shows this when the import is in a script's __main__.
    warnings.warn(f"{old} moved to {new}; the old path is kept for one release.", DeprecationWarning, stacklevel=3)


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
        source = f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<{fullname}: alias of {self.new}>", "exec")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Resolve the old paths before any other finder: an editable install of an older checkout, or a
    file left at an old path, would otherwise give a second copy of a module."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
