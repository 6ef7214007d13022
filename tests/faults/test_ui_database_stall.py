"""A stalled PostgreSQL server holds the web UI's page that reads it, never the controller: its job page's reads run
in a worker thread, so the loop goes on answering every other call (the nodes', the probes') meanwhile.

Real controller process, real PostgreSQL server; the stall is a relay in front of the server's socket that keeps the
connections open and forwards nothing (`support/pg_relay.py`). Before, the job page read the store on the event loop:
one page opened during a database stall, by any reader of the job, froze the whole controller (`/healthz`
unanswered) until the database came back."""
from __future__ import annotations

import threading

import httpx

from rolloutd.crds.names import API_PREFIX
from support.controller_process import ControllerProcess
from support.example_job import example_doc
from support.pg_relay import PgRelay
from support.waiting import wait_until


def test_a_job_page_read_during_a_database_stall_holds_that_page_only(pg_server, tmp_path):
    relay = PgRelay(pg_server.create_database(), tmp_path / "relay")
    controller = ControllerProcess(tmp_path / "data", env={"ROLLOUTD_STORE": relay.url}).start()
    admin = {"Authorization": f"Bearer {controller.token}"}
    page: dict = {}

    def open_page(path: str) -> None:  # pages never built: their builds read the store
        page[path] = httpx.get(f"{controller.url}/ui/api/{path}", headers=admin, timeout=120)
    openers = [threading.Thread(target=open_page, args=(path,), daemon=True) for path in ("jobs/default/unseen", "jobs")]
    try:
        for name in ("seen", "unseen"):
            doc = example_doc()
            doc["metadata"]["name"] = name
            assert httpx.put(f"{controller.url}{API_PREFIX}/rolloutjobs/{name}", json=doc, headers=admin,
                             timeout=30).status_code == 201
        assert httpx.get(f"{controller.url}/ui/api/jobs/default/seen", headers=admin, timeout=30).status_code == 200

        relay.hold()
        for opener in openers:
            opener.start()
        wait_until(lambda: relay.held >= 2, 30, "the pages' reads to reach the held database")
        assert httpx.get(f"{controller.url}/healthz", timeout=10).status_code == 200  # the loop is not held
        assert page == {}  # while both pages still wait for their database
        relay.release()
        for opener in openers:
            opener.join(60)
        assert page["jobs/default/unseen"].status_code == 200 and page["jobs/default/unseen"].json()["name"] == "unseen"
        assert page["jobs"].status_code == 200 and {j["name"] for j in page["jobs"].json()["items"]} == {"seen", "unseen"}
    finally:
        relay.release()
        controller.stop()
