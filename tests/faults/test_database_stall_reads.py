"""A stalled PostgreSQL server holds the calls that read it, in worker threads, not the event loop: the web UI's job
page and jobs list, the trainer's trajectories (and groups, batches, backends, policy) and /metrics wait for it while
the loop goes on answering (`/healthz` here).

Real controller process, real PostgreSQL server; the stall is a relay in front of the server's socket that keeps the
connections open and forwards nothing (`support/pg_relay.py`). Before, each of these read the store on the event loop:
one such call made during a database stall, by any reader of the job, froze the whole controller (`/healthz`
unanswered) until the database came back. The scheduler's own pass still reads the nodes on the loop every
FULL_PASS_SECONDS: a stall longer than that holds the loop whatever the callers do (the operations page says so), so
the stall here starts right after one such read's transaction has ended (holding the read itself, or its ROLLBACK,
would hold the loop: CI's run of 8a3ab50 failed on that race)."""
from __future__ import annotations

import threading

import httpx

from rolloutd.controller.work.node_registry import FULL_PASS_SECONDS
from rolloutd.crds.names import API_PREFIX
from support.controller_process import ControllerProcess
from support.example_job import example_doc
from support.pg_relay import PgRelay
from support.waiting import wait_until

PASS_READ = b"FROM nodes WHERE state"  # `NodeRegistry.retire_silent`'s read
JOB = f"{API_PREFIX}/namespaces/default/rolloutjobs/unseen"
# four at once: each holds one of the loop's worker threads, of which there are six on two cores (and the scheduler's
# own records take one), so a fifth would wait for a thread rather than for the database
READS = ("/ui/api/jobs/default/unseen", "/ui/api/jobs", f"{JOB}/trajectories", "/metrics")


def test_reads_during_a_database_stall_hold_their_calls_not_the_controller(pg_server, tmp_path):
    relay = PgRelay(pg_server.create_database(), tmp_path / "relay")
    controller = ControllerProcess(tmp_path / "data", env={"ROLLOUTD_STORE": relay.url}).start()
    admin = {"Authorization": f"Bearer {controller.token}"}
    answers: dict = {}

    def call(path: str) -> None:
        answers[path] = httpx.get(f"{controller.url}{path}", headers=admin, timeout=120)
    callers = [threading.Thread(target=call, args=(path,), daemon=True) for path in READS]
    try:
        for name in ("seen", "unseen"):
            doc = example_doc()
            doc["metadata"]["name"] = name
            assert httpx.put(f"{controller.url}{API_PREFIX}/rolloutjobs/{name}", json=doc, headers=admin,
                             timeout=30).status_code == 201
        assert httpx.get(f"{controller.url}/ui/api/jobs/default/seen", headers=admin, timeout=30).status_code == 200

        relay.hold_after(PASS_READ)  # for the next FULL_PASS_SECONDS, only the calls' reads meet the stall
        wait_until(lambda: relay.holding, 2 * FULL_PASS_SECONDS + 10, "the scheduler's nodes pass to end")
        for caller in callers:
            caller.start()
        wait_until(lambda: relay.held >= len(READS), 30, "every call's read to reach the held database")
        assert httpx.get(f"{controller.url}/healthz", timeout=10).status_code == 200  # the loop is not held
        assert answers == {}  # while every call still waits for its database
        relay.release()
        for caller in callers:
            caller.join(60)
        assert {path: answers[path].status_code for path in READS} == {path: 200 for path in READS}
        assert answers[READS[0]].json()["name"] == "unseen"
        assert {j["name"] for j in answers[READS[1]].json()["items"]} == {"seen", "unseen"}
        assert 'rolloutd_jobs{phase="Pending"} 2.0' in answers["/metrics"].text
    finally:
        relay.release()
        controller.stop()
