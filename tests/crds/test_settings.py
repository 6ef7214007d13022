"""The variable table (crds/settings.py): every `ROLLOUTD_*` name in product code is in it, no module reads the
environment at import time, and the parts that re-derived another part's directories now follow the shared rules
(the sandbox's image cache honours `ROLLOUTD_HOME`; the sandbox hides the data directory by the controller's rule)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from rolloutd.crds import paths, settings

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("crds", "sandbox", "agents", "controller")
NAME = re.compile(r"\bROLLOUTD_[A-Z0-9_]*[A-Z0-9]\b")


def _product_files():
    for part in PRODUCT:
        yield from sorted((REPO / part).rglob("*.py"))


def test_every_variable_named_in_the_product_is_in_the_table():
    named = {m for path in _product_files() for m in NAME.findall(path.read_text())}
    assert named - set(settings.BY_NAME) == set(), "ROLLOUTD_ variables missing from crds/settings.py VARIABLES"
    assert set(settings.BY_NAME) - named == set(), "table rows no product code names"


def test_every_row_is_complete():
    for v in settings.VARIABLES:
        assert v.type and v.default and v.processes and v.doc, v.name
        assert set(v.processes) <= {settings.CONTROLLER, settings.NODE, settings.SANDBOX, settings.CLIENT}, v.name


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="ROLLOUTD_NOPE"):
        settings.env("ROLLOUTD_NOPE")
    assert settings.env("ROLLOUTD_HOME", {"ROLLOUTD_HOME": ""}) is None  # empty counts as unset


def _is_environ(n: ast.AST) -> bool:
    return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) and n.value.id == "os"


def _reads_environment(node: ast.AST) -> bool:
    """A read of the environment: `os.environ.get(...)`, `os.environ[...]`, `os.getenv(...)`, `settings.env(...)`
    (setting a third party's variable before importing it, as agents/tokenizer.py does, is no read)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id == "env":
                return True
            if isinstance(f, ast.Attribute) and ((f.attr == "get" and _is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os")):
                return True
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _is_environ(n.value):
            return True
    return False


def _import_time(body: list[ast.stmt]):
    """The statements of a module (or class body) that run when it is imported."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from (d for d in stmt.decorator_list + stmt.args.defaults + stmt.args.kw_defaults if d)
        elif isinstance(stmt, ast.ClassDef):
            yield from _import_time(stmt.body)
        else:
            yield stmt


def test_no_module_reads_the_environment_at_import_time():
    found = []
    for path in _product_files():
        for stmt in _import_time(ast.parse(path.read_text()).body):
            if _reads_environment(stmt):
                found.append(f"{path.relative_to(REPO)}:{stmt.lineno}")
    assert found == []


def test_the_image_cache_honours_rolloutd_home(tmp_path, monkeypatch):
    from rolloutd.sandbox.rootfs import image_cache_dir

    monkeypatch.delenv("ROLLOUTD_IMAGE_DIR", raising=False)
    monkeypatch.setenv("ROLLOUTD_HOME", str(tmp_path / "home"))
    assert image_cache_dir() == tmp_path / "home" / "images"
    monkeypatch.setenv("ROLLOUTD_IMAGE_DIR", str(tmp_path / "cluster"))
    assert image_cache_dir() == tmp_path / "cluster"


@pytest.mark.parametrize("data_dir", [None, "moved"])
def test_the_sandbox_hides_the_data_dir_by_the_controllers_rule(tmp_path, monkeypatch, data_dir):
    from rolloutd.crds.paths import default_data_dir
    from rolloutd.sandbox.hostview import data_dirs

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if data_dir:
        monkeypatch.setenv("ROLLOUTD_DATA_DIR", str(tmp_path / data_dir))
    else:
        monkeypatch.delenv("ROLLOUTD_DATA_DIR", raising=False)
    assert default_data_dir is paths.default_data_dir  # one rule, not two
    hidden = data_dirs()
    assert str(default_data_dir()) in hidden and str(paths.xdg_data_dir()) in hidden


def test_the_watch_history_is_read_when_the_store_opens(tmp_path, monkeypatch):
    """Not at import: a controller started in this process after the variable changed sees the new value."""
    store = importlib.import_module("rolloutd.controller.store")
    monkeypatch.setenv("ROLLOUTD_WATCH_HISTORY", "123")
    assert store.Store(tmp_path / "a.db")._keep == 123
    monkeypatch.delenv("ROLLOUTD_WATCH_HISTORY")
    assert store.Store(tmp_path / "b.db")._keep == store.CHANGE_LOG_KEEP
