"""Jobs created before an upgrade delete cleanly after it: a real controller of this version opens a store written by
the oldest schema (data/store-schema1.sql: the SQL dump of a store made by commit 5497a70^'s own `Store`, one
finished job applied from that commit's examples/math-demo.yaml), and the operator's release-finalizer removal is
not refused by spec validation (before: 422 "spec.executor.kubernetes: field is immutable", the job stuck with a
deletionTimestamp for ever)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from support.controller_process import ControllerProcess
from support.waiting import wait_until

FIXTURE = Path(__file__).parent / "data" / "store-schema1.sql"
P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"


def test_a_job_stored_by_the_oldest_schema_deletes_after_the_upgrade(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with sqlite3.connect(data / "rolloutd.db") as conn:
        conn.executescript(FIXTURE.read_text())
    (data / "token").write_text("the-token-of-before\n")  # a store's data dir keeps its token (never re-minted)
    c = ControllerProcess(data).start()
    try:
        with c.client() as api:
            job = api.get(f"{P}/before-upgrade")
            assert job.status_code == 200, job.text
            assert job.json()["status"]["phase"] == "Succeeded" and job.json()["metadata"]["labels"] == {"team": "rl"}
            assert api.delete(f"{P}/before-upgrade").status_code in (200, 202)
            wait_until(lambda: api.get(f"{P}/before-upgrade").status_code == 404, 30,
                       "the operator to release the job and drop its finalizer")
            assert api.get(P).json()["items"] == []
    finally:
        c.stop()
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("controller-*.log"))
    assert "immutable" not in log, log[-3000:]
