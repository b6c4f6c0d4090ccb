"""The env registry: names, lazy engines, dotted paths and the errors users see."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import envs
from envs import base
from envs.tiny import TinyEnv


def test_make_env_by_name_passes_kwargs():
    env = envs.make_env("tiny", size=5)
    assert isinstance(env, TinyEnv) and env.size == 5 and TinyEnv.name == "tiny"


@pytest.mark.parametrize("path", ["envs.tiny:TinyEnv", "envs.tiny.TinyEnv"])
def test_dotted_path_resolves(path):
    assert envs.resolve_env_class(path) is TinyEnv


def test_unknown_name_lists_registered_envs_and_the_fix():
    with pytest.raises(ValueError) as err:
        envs.make_env("no-such-env")
    message = str(err.value)
    assert "env='no-such-env' is not a registered env" in message
    assert "textcraft" in message and "tiny" in message
    assert "register_env" in message and "package.module:Class" in message


def test_bad_dotted_path_names_module_and_attribute():
    with pytest.raises(ValueError, match="could not import 'Nope' from 'envs.tiny'"):
        envs.resolve_env_class("envs.tiny:Nope")


def test_real_engines_are_registered_lazily():
    assert {"textcraft", "scienceworld", "alfworld", "tiny"} <= set(envs.registered_envs())
    assert base._LAZY["textcraft"] == "envs.textcraft"
    assert base._LAZY["scienceworld"] == "envs.scienceworld"
    assert base._LAZY["alfworld"] == "envs.alfworld"


def test_import_envs_does_not_import_engines():
    code = (
        "import sys, envs; "
        "heavy = [m for m in ('textcraft', 'scienceworld', 'alfworld', 'textworld', 'py4j', 'gymnasium', "
        "'envs.textcraft', 'envs.scienceworld', 'envs.alfworld') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_repo_root())
    assert out.stdout.strip() == ""


def test_lazy_name_imports_its_module_on_first_use():
    cls = envs.resolve_env_class("textcraft")  # our module imports the engine package only when an env is built
    assert cls.__module__ == "envs.textcraft" and cls.name == "textcraft"


def test_register_decorator_and_custom_name(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    @envs.register_env("my-line")
    class MyLine(TinyEnv):
        name = ""

    assert MyLine.name == "my-line"
    assert isinstance(envs.make_env("my-line", size=3), MyLine)
    assert "my-line" in envs.registered_envs()


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(envs.__file__))


@pytest.mark.parametrize(
    "source,error",
    [
        ("raise RuntimeError('the engine server is down')", "RuntimeError: the engine server is down"),
        ("def broken(:\n    pass\n", "SyntaxError"),
        ("x = {}['missing']", "KeyError: 'missing'"),
    ],
)
def test_an_env_module_that_fails_on_import_is_one_valueerror_naming_module_error_and_line(
    source, error, tmp_path, monkeypatch
):
    """Only ImportError was caught: a RuntimeError or a SyntaxError in the env's module escaped as its traceback."""
    (tmp_path / "broken_env_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_env_mod", raising=False)
    with pytest.raises(ValueError) as err:
        envs.resolve_env_class("broken_env_mod:MyEnv")
    message = str(err.value)
    assert "env='broken_env_mod:MyEnv'" in message and "'broken_env_mod'" in message, message
    assert error in message and "broken_env_mod.py:1" in message and "\n" not in message, message


def test_a_lazily_registered_engine_that_fails_on_import_is_one_valueerror(tmp_path, monkeypatch):
    (tmp_path / "lazy_broken_mod.py").write_text("raise RuntimeError('no display')")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(base._LAZY, "lazy-broken", "lazy_broken_mod")
    with pytest.raises(ValueError, match=r"env='lazy-broken': importing module 'lazy_broken_mod' raised RuntimeError"):
        envs.resolve_env_class("lazy-broken")
