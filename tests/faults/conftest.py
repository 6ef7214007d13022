"""Fault fixtures: a real controller (local executor) whose real node daemons run gated oracle rollouts in real bwrap
sandboxes (support/fault_jobs.py: no engine), with short leases so that outages and stalls stay short."""
from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from support.cluster import Cluster, plugin_env


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Iterator[Cluster]:
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/system-packages.sh installs it)")
    (tmp_path / "sandboxes").mkdir()
    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(tmp_path / "sandboxes"))
    c = Cluster(tmp_path, plugin_env()).start()
    yield c
    c.stop()


@pytest.fixture
def replicas(tmp_path, monkeypatch, store_kind, request):
    """Two controller replicas on one store, once on the data dir's SQLite file, once on a database of the session's
    PostgreSQL server (support/replicas.py); neither started: the test starts them."""
    from support.replicas import Replicas

    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/system-packages.sh installs it)")
    (tmp_path / "sandboxes").mkdir()
    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(tmp_path / "sandboxes"))
    store = request.getfixturevalue("pg_server").create_database() if store_kind == "postgresql" else None
    r = Replicas(tmp_path, plugin_env(), store=store)
    yield r
    r.stop()
