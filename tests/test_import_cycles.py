"""No module of `bipace_trainer/` or `envs/` imports itself back through others (issue 49).

A cycle hidden by a function-level import works until someone moves that import to the top
of the file, or calls the function while the other module is half-initialised; it also means
the two modules are one piece of code split in two files. The scan reads every module's
syntax tree, so imports inside functions and methods count, as do `importlib.import_module`
calls with a literal name; imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bipace_trainer", "envs")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def imported_names(name: str, is_package: bool, source: str, known: set[str]) -> set[str]:
    """The modules among `known` that `source` (the module `name`) imports, wherever the import
    sits. `from pkg import x` is an edge to the module `pkg.x` when there is one (importing a
    submodule from inside its package does not re-run the package's `__init__`), else to `pkg`."""
    tree = ast.parse(source)
    skipped = _typing_only(tree)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
        ):  # fmt: skip
            found.add(node.args[0].value)
    return (found & known) - {name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module → the modules of `PACKAGES` it imports, function-level imports included."""
    paths = {module_name(p, root): p for top in PACKAGES for p in sorted((root / top).rglob("*.py"))}
    return {name: imported_names(name, path.name == "__init__.py", path.read_text(), set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_package_and_envs_modules():
    graph = import_graph()
    assert "envs.base" in graph and "bipace_trainer.run.checkpointing" in graph  # the scan sees the modules
    assert not cycles(graph), "import cycles (move what the modules share into one of them, or a third): " + "; ".join(
        " <-> ".join(c) for c in cycles(graph)
    )


def test_the_scan_sees_imports_inside_functions_and_skips_type_checking_ones():
    source = '''
from typing import TYPE_CHECKING
from . import sibling
if TYPE_CHECKING:
    from .typed import Thing
def later():
    from ..other import helper
    import importlib
    return importlib.import_module("pkg.dynamic")
'''
    known = {"pkg.sub.sibling", "pkg.sub.typed", "pkg.other", "pkg.dynamic", "pkg.sub.mod"}
    assert imported_names("pkg.sub.mod", False, source, known) == {"pkg.sub.sibling", "pkg.other", "pkg.dynamic"}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "envs").mkdir()
    (tmp_path / "bipace_trainer").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    (tmp_path / "bipace_trainer" / "__init__.py").write_text("")
    (tmp_path / "envs" / "a.py").write_text("from .b import B\n")
    (tmp_path / "envs" / "b.py").write_text("B = 1\ndef build():\n    from .a import A\n")
    (tmp_path / "envs" / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["envs.c"] == {"envs.a"}  # `from . import a`: the submodule, not envs/__init__
    assert cycles(graph) == [["envs.a", "envs.b"]]
