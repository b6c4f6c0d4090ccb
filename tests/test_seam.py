"""The seam between the trainer and the rest, checked on the source (AST): only `update/adapter.py` touches
GRPOTrainer's private names (`trainer.py` only overrides TRL's one seam), no other module touches the
trainer's, and the rollout is handed a policy and values, never the trainer."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bipace_trainer"


def _names_the_trainer(node: ast.expr) -> bool:
    """`trainer` or `<anything>.trainer` (`self.trainer`, `self.owner.trainer`)."""
    return (isinstance(node, ast.Name) and node.id == "trainer") or (isinstance(node, ast.Attribute) and node.attr == "trainer")


def private_trainer_accesses(source: str) -> list[str]:
    """Every `<trainer>._name` (read, write or call; dunders aside) in `source`, as "line: expression"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if _names_the_trainer(node.value):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def trainer_handles(source: str) -> list[str]:
    """Every parameter named `trainer` and every `.trainer` attribute in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg == "trainer":
            found.append(f"{node.lineno}: parameter trainer")
        elif isinstance(node, ast.Attribute) and node.attr == "trainer":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "GRPOTrainer" for alias in node.names):
            found.append(f"{node.lineno}: imports GRPOTrainer")
    return found


def test_the_scans_find_what_they_look_for():
    sample = "trainer._step = 1\nx = self.trainer._tokenize_prompts(p)\ny = trainer.__class__\nz = other._private\n"
    assert private_trainer_accesses(sample) == ["1: trainer._step", "2: self.trainer._tokenize_prompts"]
    assert trainer_handles("def f(trainer):\n    return self.trainer.args\n") == ["1: parameter trainer", "2: self.trainer"]


def test_no_module_but_the_trainer_and_its_adapter_touches_a_private_name_of_the_trainer():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in ("trainer.py", "update/adapter.py") and (hits := private_trainer_accesses(path.read_text()))
    }
    assert found == {}, "give these modules a value or a bound method from trainer.py instead: " + repr(found)


# The one private method of GRPOTrainer that trainer.py overrides: TRL's seam for a custom rollout.
TRL_SEAM = {"_generate_and_score_completions"}


def trl_private_names() -> set[str]:
    """Every private name GRPOTrainer and its bases define: their methods and class attributes, and
    each `self._name` their modules' source reads or writes (instance attributes set anywhere)."""
    from trl import GRPOTrainer

    names = set()
    for cls in GRPOTrainer.__mro__[:-1]:  # object aside
        names |= {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
        for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(cls)))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def trl_private_uses(source: str, trl_names: set[str]) -> list[str]:
    """Each `self._name` or `super()._name` of TRL's, and each TRL private method overridden
    (TRL's seam aside), in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in trl_names:
            if (isinstance(node.value, ast.Name) and node.value.id == "self") or (
                isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super"
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef) and node.name in trl_names - TRL_SEAM:
            found.append(f"{node.lineno}: def {node.name}")
    return found


def test_the_trl_scan_finds_what_it_looks_for():
    names = trl_private_names()
    assert {"_metrics", "_buffered_inputs", "_step", "_tokenize_prompts", "_save_checkpoint"} <= names
    sample = "class T:\n    def _save_checkpoint(self):\n        self._metrics[m] = super()._step + self._own\n"
    assert trl_private_uses(sample, names) == ["2: def _save_checkpoint", "3: self._metrics", "3: super()._step"]


def test_trainer_py_touches_no_private_name_of_trl_only_the_adapter_does():
    """trainer.py reads as collect → estimate → TRL's loss; what it takes of TRL's internals comes
    through `GRPOAdapter`'s public methods, so a TRL release that renames one shows in update/adapter.py."""
    assert trl_private_uses((PACKAGE / "trainer.py").read_text(), trl_private_names()) == []
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) < 400


def test_only_the_trainer_and_its_adapter_subclass_trls_trainer():
    """A subclass elsewhere in the package would be a way back to TRL's private state."""
    bases = {"GRPOTrainer", "GRPOAdapter", "BiPACETrainer", "Trainer"}
    found = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and {ast.unparse(base).split(".")[-1] for base in node.bases} & bases
    ]
    assert found == ["trainer.py", "update/adapter.py"], found


def test_the_rollout_is_handed_a_policy_and_values_never_the_trainer():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted((PACKAGE / "rollout").rglob("*.py"))
        if (hits := trainer_handles(path.read_text()))
    }
    assert found == {}, found


# ---------------------------------------------------------------------- function length

MAX_CODE_LINES = 60


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """The rule: the lines from `def` to the function's last line (decorators not counted), minus blank
    lines, comment-only lines and the docstring's lines. A nested function counts in its parent too."""
    docstring = set()
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        docstring = set(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for number in range(function.lineno, function.end_lineno + 1)
        if number not in docstring and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")
    )


def long_functions(source: str) -> list[str]:
    lines = source.splitlines()
    return [
        f"{node.name} (line {node.lineno}): {count} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (count := code_lines(node, lines)) > MAX_CODE_LINES
    ]


def test_the_length_rule_counts_code_not_docstrings_comments_or_blank_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CODE_LINES - 1))
    padded = f'def f():\n    """Doc\n\n    more doc."""\n    # why\n\n{body}\n'
    assert long_functions(padded) == []  # def + 59 statements = 60 lines of code
    assert long_functions(padded + "    y = 1\n") == ["f (line 1): 61 lines"]


def test_no_function_in_the_package_is_longer_than_60_lines_of_code():
    found = {
        str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py")) if (hits := long_functions(path.read_text()))
    }
    assert found == {}, found


# ---------------------------------------------------------------------- one owner per concept


def test_hidden_capture_is_chosen_once_by_one_rule():
    from bipace_trainer.rollout.hidden import HiddenPlan

    table = {  # (needs_hidden, hidden_capture, use_vllm) -> source
        (False, "hook", False): "none", (False, "forward", True): "none",
        (True, "hook", False): "prefill", (True, "hook", True): "old_logprobs",
        (True, "forward", False): "forward", (True, "forward", True): "forward",
    }  # fmt: skip
    for (needs, capture, vllm), source in table.items():
        plan = HiddenPlan.choose(needs, capture, vllm, layer=-3)
        assert (plan.source, plan.layer) == (source, -3)
        assert plan.in_generation == (source in ("prefill", "forward"))


def test_states_captured_apart_from_the_rollout_enter_the_estimators_input_explicitly():
    import torch

    from bipace_trainer.rollout.loop import Episode, Rollout, StepRecord

    steps = [StepRecord(0, 0, t, [1], [2], "", "", True, None, f"s{t}", 0.0) for t in range(2)]
    rollout = Rollout(steps, [Episode(0, 0, 0, {}, length=2)], {})
    assert rollout.step_batch().hidden is None  # nothing captured in the generation
    states = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(rollout.step_batch(states).hidden, states)
    assert all(s.hidden is None for s in rollout.steps)  # the steps are left as played


def test_cluster_layer_has_one_rule():
    import pytest

    from bipace_trainer.rollout.hidden import resolve_cluster_layer

    assert [resolve_cluster_layer(4, layer) for layer in (-5, -4, -1, 0, 4)] == [-5, -4, -1, 0, 4]
    with pytest.warns(UserWarning, match="cluster_layer=-8 is out of range .* using cluster_layer=-4"):
        assert resolve_cluster_layer(4, -8) == -4
    with pytest.raises(ValueError, match=r"cluster_layer=5 is out of range .* use -5..4"):
        resolve_cluster_layer(4, 5)


# ---------------------------------------------------------------------- subclasses use documented hooks

OUTSIDE = ("bench", "studies", "tests")
HOOKS = ("generate_and_score", "collect", "on_scored", "on_rollout", "evaluate_policy", "compute_loss")


def trainer_private_methods() -> set[str]:
    """The private methods of our trainer: its own and its adapter's, and every private name of TRL's."""
    names = trl_private_names()
    for path in (PACKAGE / "trainer.py", PACKAGE / "update" / "adapter.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")}
    return {name for name in names if not name.startswith("__")}


def private_overrides(source: str, private: set[str], ours: set[str]) -> list[str]:
    """Each method a subclass of one of `ours` (our trainer classes) in `source` defines, and each
    `setattr(<one of ours>, "name", ...)` (monkeypatch's too), whose name is one of `private`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and {ast.unparse(b).split(".")[-1] for b in node.bases} & ours:
            found += [f"{f.lineno}: def {f.name}" for f in node.body if isinstance(f, ast.FunctionDef) and f.name in private]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "setattr" and len(node.args) > 1:
            target, name = ast.unparse(node.args[0]).split(".")[-1], node.args[1]
            if target in ours and isinstance(name, ast.Constant) and name.value in private:
                found.append(f"{node.lineno}: setattr {name.value}")
    return found


def our_trainer_classes(sources: list[str]) -> set[str]:
    """BiPACETrainer, its adapter, and every class of `sources` that derives from one of them (by name)."""
    ours, classes = {"BiPACETrainer", "GRPOAdapter"}, []
    for source in sources:
        classes += [(n.name, {ast.unparse(b).split(".")[-1] for b in n.bases})
                    for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    while new := {name for name, bases in classes if bases & ours and name not in ours}:
        ours |= new
    return ours


def test_the_override_scan_finds_what_it_looks_for():
    sample = "class T(BiPACETrainer):\n    def _scored_rollout(self):\n        pass\n    def collect(self):\n        pass\n" \
             "monkeypatch.setattr(T, '_eval_batch', f)\nclass Cache:\n    def _save(self):\n        pass\n" \
             "monkeypatch.setattr(GRPOTrainer, '_eval_batch', spy)\n"
    ours = our_trainer_classes([sample])
    assert ours == {"BiPACETrainer", "GRPOAdapter", "T"}
    assert private_overrides(sample, {"_scored_rollout", "_eval_batch", "_save"}, ours) == [
        "2: def _scored_rollout", "6: setattr _eval_batch"]


def test_benches_studies_and_tests_override_no_private_method_of_the_trainer():
    """A bench or a test that overrides a private method is telling us a hook is missing: they use the
    documented ones (`HOOKS`, docs/architecture.md#hooks)."""
    private, root = trainer_private_methods(), PACKAGE.parent
    paths = [path for folder in OUTSIDE for path in sorted((root / folder).rglob("*.py"))]
    ours = our_trainer_classes([path.read_text() for path in paths])
    found = {
        str(path.relative_to(root)): hits for path in paths if (hits := private_overrides(path.read_text(), private, ours))
    }
    assert found == {}, found
    from bipace_trainer import BiPACETrainer

    assert all(callable(getattr(BiPACETrainer, hook)) for hook in HOOKS)


def test_the_hidden_plan_is_chosen_once_with_no_setter():
    from bipace_trainer import BiPACETrainer

    assert BiPACETrainer.needs_hidden.fset is None  # chosen from the config (capture_hidden_states, the partition)
