"""A live job page reads the job, its events and its policy again only when one of them changed: read afresh every
second they cost the event loop ~3 ms a build (the nodes' commits leave the connections' page caches cold), most of
a dashboard's cost at a hundred nodes. What changes must still show at the next build: a status write, a new event,
a policy announced, a job deleted. Real app, real store, real scheduler; the builds made due at once."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from rolloutd.controller.api import create_app
from rolloutd.controller.store import Store
from rolloutd.controller.ui import live
from rolloutd.controller.root import assemble
from rolloutd.crds.job_status import RolloutJobStatus
from rolloutd.crds.rolloutjob import RolloutJob

ADMIN = {"Authorization": "Bearer admin"}
PAGE = "/ui/api/jobs/default/j"


@pytest.fixture
def page(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "SUMMARY_SECONDS", 0.0)  # every request builds (a build is otherwise kept 1 s)
    monkeypatch.setattr(live, "BUILD_SHARE", 0)
    monkeypatch.setattr(live, "BUSY_SECONDS", 0.0)  # a test client's first calls lag the loop: not a busy controller
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": 0, "question": "q", "answer": "a"}) + "\n")
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j"},
        "spec": {"tasks": {"kind": "math", "source": str(tmp_path / "d.jsonl")}, "agent": {"kind": "oracle"}}}))
    reads = {"job": 0, "events": 0}
    get_wire, events = store.get_wire, store.events

    def counted_get_wire(*a, **k):
        reads["job"] += 1
        return get_wire(*a, **k)

    def counted_events(*a, **k):
        reads["events"] += 1
        return events(*a, **k)

    root = assemble(store, "admin", work={})
    scheduler = root.scheduler
    with TestClient(create_app(root), headers=ADMIN) as client:
        store.get_wire, store.events = counted_get_wire, counted_events
        yield client, store, scheduler, reads


def test_an_unchanged_job_is_not_read_again(page):
    client, _store, _scheduler, reads = page
    first = client.get(PAGE)
    assert first.status_code == 200, first.text
    assert reads == {"job": 1, "events": 1}
    for _ in range(3):
        assert client.get(PAGE).status_code == 200
    assert reads == {"job": 1, "events": 1}


def test_a_status_write_an_event_and_a_deletion_show_at_the_next_build(page):
    client, store, _scheduler, _reads = page
    assert client.get(PAGE).json()["phase"] == "Pending"
    store.update_status("j", RolloutJobStatus.model_validate({"phase": "Running", "message": "on its way"}))
    doc = client.get(PAGE).json()
    assert (doc["phase"], doc["status"]["message"]) == ("Running", "on its way")
    store.add_event("j", "Scaled", "3 nodes")
    assert [e["reason"] for e in client.get(PAGE).json()["events"]] == ["Scaled"]
    store.mark_deleted("j")
    assert client.get(PAGE).json()["phase"] == "Cancelling"


def test_the_page_carries_the_newest_events_in_order(page):
    client, store, _scheduler, _reads = page
    for i in range(live.EVENTS_SHOWN + 10):
        store.add_event("j", "Step", f"event {i}")
    shown = [e["message"] for e in client.get(PAGE).json()["events"]]
    assert shown == [f"event {i}" for i in range(10, live.EVENTS_SHOWN + 10)]
    assert len(store.events("j")) == live.EVENTS_SHOWN + 10  # the API's …/events still has them all


def test_a_policy_change_shows_at_the_next_build(page):
    client, _store, scheduler, _reads = page
    assert client.get(PAGE).json()["policy"]["paused"] is False
    scheduler.work.policies._set("j", paused=True)  # what an announce does first (then waits for the daemons)
    assert client.get(PAGE).json()["policy"]["paused"] is True
    scheduler.work.policies._set("j", paused=False, version=json.dumps(3), history=json.dumps([None, 3]))
    assert client.get(PAGE).json()["policy"] == {"version": 3, "history": [None, 3], "paused": False, "staleness": {},
                                                 "spec": {"updateMode": "drain", "pauseOnUpdate": True,
                                                          "maxStaleness": None}}  # the job's spec.policy beside
