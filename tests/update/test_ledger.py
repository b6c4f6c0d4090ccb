"""The ledger (`bipace_trainer.trl_compat`): every private name of TRL, vLLM or transformers the package
reads, calls, overrides or replicates has an entry with the versions it was checked against; each one
resolves in the installed libraries; a missing one stops the trainer before any model loads, in one line
naming it and its entry; and no private reach into those libraries sits outside `update/` and the ledger
(checked on the source, AST, over bipace_trainer/ and envs/)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bipace_trainer import trl_compat
from tests.test_seam import trl_private_names

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bipace_trainer"
SCANNED = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "envs").rglob("*.py")])
LIBRARIES = ("trl", "vllm", "transformers")
SANCTIONED = ("update/", "trl_compat.py")  # relative to bipace_trainer/
# Private names of other libraries the code reaches: not TRL's, vLLM's or transformers', so not the ledger's.
OTHER_LIBRARIES = {
    "_actions": "argparse (the help of TRL's parser)", "_optionals": "argparse", "_positionals": "argparse",
    "_group_actions": "argparse", "_exit": "os", "_parse_and_convert": "alfworld's text generator",
    "_logic": "textworld's game logic", "_game_data": "alfworld's PDDL env", "_pddl_state": "alfworld's PDDL env",
    "_entity_infos": "alfworld's PDDL env",
}
TRAINER_BASES = {"GRPOTrainer", "GRPOAdapter", "BiPACETrainer", "Trainer"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_names() -> set[str]:
    """Every name the package and envs/ define: functions, classes, variables, arguments, attributes set."""
    names = set()
    for path in SCANNED:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _in_trainer_subclass(tree: ast.Module) -> set[int]:
    """The line numbers inside classes that derive from TRL's trainer (where `self._x` may be TRL's)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and {ast.unparse(b).split(".")[-1] for b in node.bases} & TRAINER_BASES:
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


def private_reaches(source: str, own: set[str], trl_names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each private name of another library `source` reaches: imported from TRL, vLLM or
    transformers; an attribute (read, written, getattr'd) the package never defines; in a subclass of TRL's
    trainer, a TRL private name read, called or overridden."""
    tree = ast.parse(source)
    subclass_lines, found = _in_trainer_subclass(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            found += [(node.lineno, part) for part in node.module.split(".") if _private(part)]
            found += [(node.lineno, alias.name) for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in own or (node.lineno in subclass_lines and node.attr in trl_names):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                if name.value not in own or node.lineno in subclass_lines and name.value in trl_names:
                    found.append((node.lineno, name.value))
        elif isinstance(node, ast.FunctionDef) and node.lineno in subclass_lines and node.name in trl_names:
            found.append((node.lineno, node.name))
    return sorted(set(found))


@pytest.fixture(scope="module")
def reaches() -> dict[str, list[tuple[int, str]]]:
    own, trl_names = own_names(), trl_private_names()
    found = {}
    for path in SCANNED:
        hits = [(line, name) for line, name in private_reaches(path.read_text(), own, trl_names) if name not in OTHER_LIBRARIES]
        if hits:
            found[str(path.relative_to(PACKAGE) if PACKAGE in path.parents else path.relative_to(ROOT))] = hits
    return found


def test_the_scan_finds_each_kind_of_private_reach():
    sample = (
        "from trl.trainer.utils import _use_triton\n"
        "import os\n"
        "x = client._post(url)\n"
        "y = getattr(llm, '_preprocess_cmpl_one', None)\n"
        "z = self._own\n"
        "class T(GRPOTrainer):\n"
        "    def _save_checkpoint(self):\n"
        "        return self._metrics, self._own\n"
    )
    own = {"_own", "_save_checkpoint", "_metrics"}  # written somewhere in the package: only TRL's rule finds them
    assert private_reaches(sample, own, {"_save_checkpoint", "_metrics"}) == [
        (1, "_use_triton"), (3, "_post"), (4, "_preprocess_cmpl_one"), (7, "_save_checkpoint"), (8, "_metrics"),
    ]


def test_no_private_reach_into_trl_vllm_or_transformers_outside_update_and_the_ledger(reaches):
    outside = {path: hits for path, hits in reaches.items() if not path.startswith(SANCTIONED)}
    assert outside == {}, (
        "move these into bipace_trainer/update/ or behind a function of trl_compat.py, with a ledger entry "
        "(a name of another library than TRL, vLLM or transformers goes in OTHER_LIBRARIES): " + repr(outside)
    )


def _listed(path: str) -> set[str]:
    """The attribute names the ledger lists for `path` (trl_compat.py: every entry's)."""
    entries = trl_compat.LEDGER.values()
    if path != "trl_compat.py":
        entries = [e for e in entries if path in getattr(e, "where", ())]
    return {name.split(".")[-1] for entry in entries for name in entry.touches}


def test_every_private_reach_has_a_ledger_entry_naming_its_file(reaches):
    unlisted = {
        path: [f"{line}: {name}" for line, name in hits if name not in _listed(path)] for path, hits in reaches.items()
    }
    unlisted = {path: hits for path, hits in unlisted.items() if hits}
    assert unlisted == {}, "add a Borrowed entry to trl_compat.BORROWED (what, where, versions, why): " + repr(unlisted)


@pytest.mark.parametrize("entry", sorted(trl_compat.LEDGER), ids=str)
def test_every_entry_says_what_why_and_the_versions_and_is_used_where_it_says(entry):
    borrowed = trl_compat.LEDGER[entry]
    assert borrowed.reason and borrowed.touches and borrowed.tested[0] < borrowed.tested[1], entry
    assert all(name.split(".")[0] in LIBRARIES or name[0].isupper() for name in borrowed.touches), borrowed.touches
    for path in getattr(borrowed, "where", ()) or ("trl_compat.py",):
        text = (PACKAGE / path).read_text()
        for name in borrowed.touches:
            assert name.split(".")[-1] in text, f"ledger entry {entry!r}: {path} does not use {name}"
    if isinstance(borrowed, trl_compat.Borrowed):
        assert borrowed.how in ("reads", "calls", "overrides", "replicates") and borrowed.where, entry


def test_every_ledger_name_resolves_in_the_installed_trl_and_transformers():
    assert trl_compat.missing_names(("trl", "transformers")) == []


class _Holder:
    def __init__(self):
        self._set_in_init = 1


def test_an_instance_attribute_resolves_by_the_class_source():
    here = f"{__name__}._Holder"
    assert trl_compat.resolves(f"{here}._set_in_init")
    assert not trl_compat.resolves(f"{here}._never_set")
    assert not trl_compat.resolves("trl.trainer.grpo_trainer.GRPOTrainer._no_such_method")


def test_a_missing_name_stops_the_trainer_before_the_model_loads_in_one_line(monkeypatch, tmp_path):
    from trl.trainer.grpo_trainer import GRPOTrainer

    from bipace_trainer import BiPACETrainer
    from tests.trainer.tiny_setup import tiny_args

    monkeypatch.delattr(GRPOTrainer, "_calculate_rewards")  # a TRL release that renamed it
    trl_compat._instance_attributes.cache_clear()
    # a model path that does not exist: had the trainer loaded it first, this would be transformers' OSError
    with pytest.raises(trl_compat.LedgerError) as missing:
        BiPACETrainer(str(tmp_path / "no-such-model"), args=tiny_args(tmp_path / "out"))
    message = str(missing.value)
    assert "\n" not in message
    assert "GRPOTrainer._calculate_rewards" in message and "ledger entry 'calculate_rewards'" in message
    assert "trl>=1.16,<1.17" in message


def test_a_missing_name_is_a_config_error_of_the_pre_flight(monkeypatch, tmp_path):
    from trl import ModelConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from bipace_trainer.cli import preflight
    from tests.trainer.tiny_setup import tiny_args

    monkeypatch.delattr(GRPOTrainer, "_get_tool_suffix_ids")
    trl_compat._instance_attributes.cache_clear()
    with pytest.raises(preflight.ConfigError, match=r"has no .*GRPOTrainer\._get_tool_suffix_ids \(ledger entry 'tool_env_setup'"):
        preflight.check_run(tiny_args(tmp_path), ModelConfig())
