"""The tests' PostgreSQL server (tests/support/postgres.py): it runs as an unprivileged user on a Unix socket in
its own directory, and a machine without the binaries skips its tests, except under CI, where that fails."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import support.postgres as pg


def test_the_server_runs_unprivileged_on_a_socket_of_its_own(pg_server):
    pid = pg_server.pid()
    uid = int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("Uid:")).split()[1])
    assert uid != 0 and (uid == os.geteuid() or os.geteuid() == 0)
    assert (pg_server.dir / ".s.PGSQL.5432").is_socket()
    assert pg_server.psql("SHOW listen_addresses").strip() == ""  # no TCP port at all


def test_missing_binaries_fail_under_ci_and_skip_elsewhere(monkeypatch):
    monkeypatch.setattr(pg, "binaries", lambda: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI installs it"):
        pg.start_server()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="apt-get install postgresql"):
        pg.start_server()
