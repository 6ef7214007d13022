"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py.

pytest imports test modules with --import-mode=importlib; the helpers every part shares are the package
tests/support (`from support.waiting import wait_until`), importable because pyproject's pytest settings
put tests/ on sys.path (`pythonpath`). tests/README.md says where a test goes. `store_location` runs a test once per store (SQLite, PostgreSQL).

`make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`): the tests that use a real engine, the Slurm
cluster or a whole job of processes form one group that runs in order on one worker (one engine, one cluster, and no
second job to compete with their timing); every other file is a group of its own, so its module fixtures and order hold."""
from __future__ import annotations

from pathlib import Path

import pytest

SERIAL_FIXTURES = {"tiny_engine", "smollm2_engine", "engine_pool"}
SERIAL_FOLDERS = ("e2e", "faults", "slurm", "rl")
# files that start engines of their own, or whose bounds (a CPU share, a build's time) are measured against the clock
SERIAL_FILES = {"agents/test_engine_vllm.py", "agents/test_engine_unit.py", "agents/daemon/test_fit.py",
                "tenancy/test_sandbox_tenant.py", "tenancy/test_build_bounds.py"}
HERE = Path(__file__).resolve().parent


def _serial(item) -> bool:
    rel = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
    return (bool(SERIAL_FIXTURES & set(getattr(item, "fixturenames", ()))) or rel.split("/")[0] in SERIAL_FOLDERS
            or rel in SERIAL_FILES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("serial" if _serial(item) else item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def pg_server():
    """The session's PostgreSQL server (tests/support/postgres.py), started on first use, stopped at the end."""
    from support.postgres import start_server

    server = start_server()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_kind(request) -> str:
    return request.param


@pytest.fixture
def new_store_location(request, store_kind, tmp_path):
    """Makes a fresh store location of this run's kind: an SQLite file, or a new database on the session's server."""
    made = iter(range(1, 1000))

    def new():
        if store_kind == "sqlite":
            return tmp_path / f"rolloutd-{next(made)}.db"
        return request.getfixturevalue("pg_server").create_database()
    return new


@pytest.fixture
def store_location(new_store_location):
    """Where a test's store lives, once per store: an SQLite file, then a fresh database on the session's server."""
    return new_store_location()
