"""The executors' daemon-launch kit: the environment contract round trip (crds/nodeenv.py), the crash
back-off both executors use, and the atomic state file (logic only; tests/e2e and tests/slurm launch
real daemons)."""
from __future__ import annotations

import pytest

from rolloutd.controller.executors.base import StateFile, crash_count, crash_delay, daemon_argv, daemon_env
from rolloutd.crds import nodeenv


def test_the_daemon_env_carries_the_contract_and_never_the_admin_token():
    base = {"PATH": "/bin", "ROLLOUTD_TOKEN": "ADMIN", "ROLLOUTD_JOB": "stale"}
    env = daemon_env(base, {"EXTRA": "1", "ROLLOUTD_TOKEN": "ADMIN2"}, "http://c:7350", "math", "JOIN")
    assert "ROLLOUTD_TOKEN" not in env and env["PATH"] == "/bin" and env["EXTRA"] == "1"
    read = nodeenv.read_node_env({**env, "SLURM_JOB_ID": "12", "SLURM_NODEID": "3", "SLURMD_NODENAME": "n4"})
    assert read == nodeenv.NodeEnv(controller="http://c:7350", job="math", join_token="JOIN",
                                   slurm_job_id="12", slurm_node_id=3, node_name="n4")
    assert not any("JOIN" in a for a in daemon_argv("/py", "--slot", "0"))
    assert set(nodeenv.node_env("u", "j", "t")) <= set(nodeenv.TABLE)


def test_the_drain_seconds_are_read_or_refused_by_name():
    assert nodeenv.read_node_env({}).drain_seconds == nodeenv.DEFAULT_DRAIN_SECONDS
    assert nodeenv.read_node_env({"ROLLOUTD_DRAIN_SECONDS": "7.5"}).drain_seconds == 7.5
    assert nodeenv.read_node_env({"ROLLOUTD_DRAIN_SECONDS": "-3"}).drain_seconds == 0.0
    with pytest.raises(nodeenv.NodeEnvError, match="ROLLOUTD_DRAIN_SECONDS"):
        nodeenv.read_node_env({"ROLLOUTD_DRAIN_SECONDS": "soon"})


def test_crash_back_off_keeps_each_executors_delays():
    # Slurm: a lone loss is replaced at once; quick losses in a row wait 2, 4, 8 … s up to the maximum
    count, delays = 0, []
    for _ in range(6):
        count = crash_count(count, started=100.0, now=105.0, stable_seconds=60.0)
        delays.append(crash_delay(count, 10.0))
    assert delays == [0, 2, 4, 8, 10, 10]
    assert crash_count(5, started=0.0, now=100.0, stable_seconds=60.0) == 1       # it had run long: starts anew
    # local: every quick death counts (2, 4, 8 … s, at most 30); a daemon that ran a while restarts at once
    local = [crash_delay(n, 30.0, free=0) for n in range(1, 7)]
    assert local == [2, 4, 8, 16, 30, 30]
    assert crash_count(3, started=0.0, now=50.0, stable_seconds=10.0, reset=0) == 0
    assert crash_delay(0, 30.0, free=0) == 0


def test_the_state_file_is_replaced_whole_and_unreadable_means_none(tmp_path):
    f = StateFile(tmp_path / "sub" / "state.json")
    assert f.load() is None
    f.save({"a": {"1": {"pid": 5}}})
    assert f.load() == {"a": {"1": {"pid": 5}}} and not (tmp_path / "sub" / "state.tmp").exists()
    f.path.write_text("{not json")
    assert f.load() is None


def test_executors_and_the_reconcile_ports_import_nothing_of_the_controller_around_them():
    """So the reconcile loop can be replaced whole (kopf handlers) and a new executor needs only
    `executors/base.py`: executors import their own package, crds and shared kits; ports.py only crds."""
    import ast
    from pathlib import Path

    controller = Path(__file__).resolve().parents[3] / "controller"
    for path in [controller / "ports.py", *sorted((controller / "executors").rglob("*.py"))]:
        package = path.parent.relative_to(controller).parts  # () for ports.py, ("executors", …) below
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level <= len(package), f"{path.name} imports {'.' * node.level}{node.module}"
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert not name.startswith("rolloutd.controller") or name.startswith("rolloutd.controller.executors"), \
                    f"{path.name} imports {name}"
                assert not name.startswith("rolloutd.agents") or name == "rolloutd.crds.kit.aiokit", f"{path.name}: {name}"
