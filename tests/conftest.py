"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py.

pytest imports test modules with --import-mode=importlib; the helpers every part shares are the package
tests/support (`from support.waiting import wait_until`), importable because pyproject's pytest settings
put tests/ on sys.path (`pythonpath`). tests/README.md says where a test goes. `store_location` runs a test once per store (SQLite, PostgreSQL)."""
from __future__ import annotations

import pytest


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
