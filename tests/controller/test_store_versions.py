"""Schema versions on both stores: a controller older than its database's schema refuses to start (its reason
on stderr, the database untouched) rather than write rows a newer rolloutd would misread."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.store.db import SchemaTooNew
from rolloutd.controller.store.schema import SCHEMA_VERSION

from support.controller_process import free_port
from rolloutd.crds.rolloutjob import RolloutJob
from support.example_job import example_doc


def test_an_older_rolloutd_refuses_a_newer_database_and_leaves_it_as_it_was(tmp_path, store_location):
    store = Store(store_location)
    store.apply(RolloutJob.model_validate(example_doc()))
    with store.engine.begin() as c:  # what a newer rolloutd's migration leaves
        c.exec_driver_sql(f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}")
    store.engine.dispose()

    with pytest.raises(SchemaTooNew, match=f"schema version {SCHEMA_VERSION + 1}, newer than this rolloutd"):
        Store(store_location)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "token").write_text("the-clients-token\n")  # the store's clients' token, kept beside it
    done = subprocess.run([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                           str(tmp_path / "data"), "--store", str(store_location), "--port", str(free_port()),
                           "--executors", ""], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"newer than this rolloutd ({SCHEMA_VERSION})" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr

    with store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT version FROM schema_version").scalar_one() == SCHEMA_VERSION + 1
        assert c.exec_driver_sql("SELECT count(*) FROM jobs").scalar_one() == 1
