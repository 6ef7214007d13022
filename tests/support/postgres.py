"""A real PostgreSQL server for the tests: one per session (`tests/support/sim/pgserver.py`: initdb + postgres under a
temporary directory as an unprivileged user, on a Unix socket), a fresh database per test that asks for one.

`store_location` (tests/conftest.py) parametrises a test over both stores: an SQLite file, or such a database's URL.
Outside CI a machine without Debian's `postgresql` skips the PostgreSQL half (saying why); under CI=true it fails.
"""
from __future__ import annotations

import os

import pytest

from support.sim.pgserver import PgServer, binaries

STORES = ("sqlite", "postgresql")


def start_server() -> PgServer:
    bindir = binaries()
    if bindir is None:
        why = "PostgreSQL's server binaries are missing (/usr/lib/postgresql/*/bin): apt-get install postgresql"
        if os.environ.get("CI") == "true":
            pytest.fail(why + " (CI installs it: .ci/system-packages.sh)")
        pytest.skip(why)
    return PgServer(bindir, fsync=False).start()
