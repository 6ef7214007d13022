"""The variable table (crds/kit/settings.py) and the settings object of each process: every `ROLLOUTD_*` name in
product code is in the table, each row is a field of its processes' objects (and each field a row), values are
parsed where the settings are (a bad one is a `SettingsError` naming the variable), nothing below an entry point
reads a variable, and the parts that once re-derived another part's directories follow the shared rules (the
sandbox's image cache honours `ROLLOUTD_HOME`; the sandbox hides the data directory by the controller's rule)."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from rolloutd.controller.client.connection import ClientSettings
from rolloutd.crds import nodeenv
from rolloutd.crds.kit import settings
from rolloutd.crds.errors import ConfigurationError
from rolloutd.crds.kit.settings import ControllerSettings, SandboxSettings, SettingsError

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("crds", "sandbox", "agents", "controller")
NAME = re.compile(r"\bROLLOUTD_[A-Z0-9_]*[A-Z0-9]\b")
OBJECTS = {settings.CONTROLLER: ControllerSettings, settings.SANDBOX: SandboxSettings,
           settings.NODE: nodeenv.NodeEnv, settings.CLIENT: ClientSettings}
# where a process starts: the only product modules that call a settings object's `from_env`
ENTRY_POINTS = {"controller/main.py",                # rolloutd controller / operator / token / node-credential
                "controller/client/connection.py",   # every client and rolloutctl command: `resolve`
                "agents/cli.py",                     # rolloutd node (NodeOptions.from_env)
                "agents/daemon/options.py",          # ... which reads the node's sandbox settings beside its own
                "sandbox/cli.py", "sandbox/image/cli.py",  # rolloutd sandbox exec / rolloutd image build
                # verl's workers build these from its config: where a trainer's process enters rolloutd (ROLLOUTD_JOB)
                "controller/integrations/verl/agent_loop.py", "controller/integrations/verl/checkpoint.py"}


def _product_files():
    for part in PRODUCT:
        yield from sorted((REPO / part).rglob("*.py"))


def test_every_variable_named_in_the_product_is_in_the_table():
    named = {m for path in _product_files() for m in NAME.findall(path.read_text())}
    assert named - set(settings.BY_NAME) == set(), "ROLLOUTD_ variables missing from crds/kit/settings.py VARIABLES"
    assert set(settings.BY_NAME) - named == set(), "table rows no product code names"


def test_every_row_is_complete():
    for v in settings.VARIABLES:
        assert v.type and v.default and v.processes and v.doc, v.name
        assert set(v.processes) <= set(OBJECTS), v.name


@pytest.mark.parametrize("process", sorted(OBJECTS))
def test_each_row_is_a_field_of_its_processes_settings_and_each_field_a_row(process):
    rows = {v.field for v in settings.VARIABLES if process in v.processes and v.field}
    launch = {f.lower() for f in ("slurm_job_id", "slurm_node_id", "node_name")}  # Slurm's, nodeenv.TABLE
    have = {f.name for f in dataclasses.fields(OBJECTS[process])} - (launch if process == settings.NODE else set())
    assert rows - have == set(), f"rows without a field in {OBJECTS[process].__name__}"
    assert have - rows == set(), f"fields of {OBJECTS[process].__name__} without a row"


def test_the_objects_defaults_are_the_tables():
    """The docs' default column (generated from the table) says what an unset variable gives."""
    from rolloutd.crds.node import NODE_CALLS_PER_SECOND
    from rolloutd.sandbox.image.build import DEFAULT_MAX_MB

    for process, cls in OBJECTS.items():
        made = cls()
        for v in settings.VARIABLES:
            if process in v.processes and v.field and v.type in ("int", "number") and v.default[0].isdigit():
                assert getattr(made, v.field) == float(v.default.split()[0]), (cls.__name__, v.name)
    assert ControllerSettings().node_calls_per_second == NODE_CALLS_PER_SECOND
    assert SandboxSettings().image_max_mb == DEFAULT_MAX_MB


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="ROLLOUTD_NOPE"):
        settings.env("ROLLOUTD_NOPE")
    assert settings.env("ROLLOUTD_HOME", {"ROLLOUTD_HOME": ""}) is None  # empty counts as unset
    assert settings.env("ROLLOUTD_HOME", {"ROLLOUTD_HOME": "  "}) is None


def test_values_are_parsed_by_their_rows_type(tmp_path):
    c = ControllerSettings.from_env({
        "ROLLOUTD_BACKEND_ALLOW_NETS": "169.254.0.0/16, fd00::/8", "ROLLOUTD_TOKENIZER_ROOTS": f"/a:{tmp_path}",
        "ROLLOUTD_NODE_CALLS_PER_SECOND": "12.5", "ROLLOUTD_WATCH_HISTORY": "7", "ROLLOUTD_DATA_DIR": str(tmp_path),
        "ROLLOUTD_ADVERTISE_URL": "http://ctl:7350/", "ROLLOUTD_MAX_EPISODES_PER_BACKEND": "3"})
    assert [str(n) for n in c.backend_allow_nets] == ["169.254.0.0/16", "fd00::/8"]
    assert c.tokenizer_roots == (Path("/a"), tmp_path) and c.data_dir == tmp_path
    assert (c.node_calls_per_second, c.watch_history, c.max_episodes_per_backend) == (12.5, 7, 3)
    assert c.advertise_url == "http://ctl:7350"
    assert ControllerSettings.from_env({}) == ControllerSettings()  # nothing set: the defaults
    s = SandboxSettings.from_env({"ROLLOUTD_SANDBOX_UID": "1234", "ROLLOUTD_EGRESS_ALLOW": "10.1.2.3/32",
                                  "ROLLOUTD_IMAGE_MAX_MB": "64", "ROLLOUTD_SANDBOX_DIR": str(tmp_path)})
    assert (s.sandbox_uid, s.image_max_mb, s.sandbox_dir) == (1234, 64, tmp_path)
    assert [str(n) for n in s.egress_allow] == ["10.1.2.3/32"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sandbox_uid = 0  # type: ignore[misc]


@pytest.mark.parametrize("cls,name,value", [
    (ControllerSettings, "ROLLOUTD_WATCH_HISTORY", "lots"),
    (ControllerSettings, "ROLLOUTD_WATCH_HISTORY", "0"),
    (ControllerSettings, "ROLLOUTD_NODE_CALLS_PER_SECOND", "fast"),
    (ControllerSettings, "ROLLOUTD_MAX_EPISODES_PER_BACKEND", "0"),
    (ControllerSettings, "ROLLOUTD_BACKEND_ALLOW_NETS", "169.254.0.0/33"),
    (ControllerSettings, "ROLLOUTD_DRAIN_SECONDS", "soon"),
    (SandboxSettings, "ROLLOUTD_SANDBOX_UID", "nobody"),
    (SandboxSettings, "ROLLOUTD_SANDBOX_UID", "-1"),
    (SandboxSettings, "ROLLOUTD_IMAGE_MAX_MB", "8G"),
    (SandboxSettings, "ROLLOUTD_EGRESS_ALLOW", "mirror.example.com"),
])
def test_a_bad_value_is_a_configuration_error_naming_the_variable(cls, name, value):
    with pytest.raises(SettingsError, match=name) as err:
        cls.from_env({name: value})
    assert isinstance(err.value, ConfigurationError)


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


def _calls(tree: ast.AST, name: str):
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name
                                                              and name != "env"):
                yield n


def _reads_a_rolloutd_variable(tree: ast.AST):
    """`os.environ.get("ROLLOUTD_…")`, `os.environ["ROLLOUTD_…"]`, `os.getenv("ROLLOUTD_…")`."""
    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args and (
                (n.func.attr == "get" and _is_environ(n.func.value)) or n.func.attr == "getenv"):
            key = n.args[0]
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _is_environ(n.value):
            key = n.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("ROLLOUTD_"):
            yield n


def test_below_the_entry_points_nothing_reads_a_variable():
    """`env(` only inside crds/kit/settings.py (the settings' constructors); `from_env(` only at a process's entry
    point; no `os.environ` read of a `ROLLOUTD_*` name anywhere else."""
    env_calls, from_env, direct = [], [], []
    for path in _product_files():
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        if rel != "crds/kit/settings.py":
            env_calls += [f"{rel}:{n.lineno}" for n in _calls(tree, "env")]
            direct += [f"{rel}:{n.lineno}" for n in _reads_a_rolloutd_variable(tree)]
        if rel not in ENTRY_POINTS and rel != "crds/kit/settings.py":
            from_env += [f"{rel}:{n.lineno}" for n in _calls(tree, "from_env")]
    assert env_calls == [], "settings.env( outside crds/kit/settings.py"
    assert from_env == [], "a settings object built below an entry point: take it as an argument"
    assert direct == [], "a ROLLOUTD_ variable read from os.environ"


def test_the_image_cache_honours_rolloutd_home(tmp_path):
    assert SandboxSettings.from_env({"ROLLOUTD_HOME": str(tmp_path / "home")}).images == tmp_path / "home" / "images"
    both = {"ROLLOUTD_HOME": str(tmp_path / "home"), "ROLLOUTD_IMAGE_DIR": str(tmp_path / "cluster")}
    assert SandboxSettings.from_env(both).images == tmp_path / "cluster"


@pytest.mark.parametrize("data_dir", [None, "moved"])
def test_the_sandbox_hides_the_data_dir_by_the_controllers_rule(tmp_path, monkeypatch, data_dir):
    from rolloutd.sandbox.host.hostview import data_dirs

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    environ = {"ROLLOUTD_DATA_DIR": str(tmp_path / data_dir)} if data_dir else {}
    controllers = ControllerSettings.from_env(environ).data_dir
    assert controllers == (tmp_path / data_dir if data_dir else tmp_path / "xdg" / "rolloutd")
    hidden = data_dirs(SandboxSettings.from_env(environ))
    assert str(controllers) in hidden and str(settings.xdg_data_dir()) in hidden
