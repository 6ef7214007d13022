"""A core/v1 Event posted about a job outside `default` (what the operator and kopf post) is kept under the
job's key and served back: it answered 500 (IndexError) and stalled the operator's observe daemon for 60 s,
so a namespaced job's status (and the UI's live pages) stopped moving. Real app, real store."""
from __future__ import annotations

import json

from fastapi.testclient import TestClient

from rolloutd.controller.api import create_app
from rolloutd.controller.root import assemble
from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

ADMIN = {"Authorization": "Bearer admin"}


def test_an_event_about_a_namespaced_job_is_kept_and_served(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": 0, "question": "q", "answer": "a"}) + "\n")
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j", "namespace": "team-x"},
        "spec": {"tasks": {"kind": "math", "source": str(tmp_path / "d.jsonl")}, "agent": {"kind": "oracle"}}}))
    with TestClient(create_app(assemble(store, "admin"))) as api:
        r = api.post("/api/v1/namespaces/team-x/events", headers=ADMIN, json={
            "involvedObject": {"kind": "RolloutJob", "name": "j", "namespace": "team-x"}, "type": "Warning",
            "reason": "HandlerFailed", "message": "boom"})
        assert r.status_code == 201, r.text
        assert r.json()["reason"] == "HandlerFailed" and r.json()["involvedObject"]["namespace"] == "team-x"
        listed = api.get("/api/v1/namespaces/team-x/events", headers=ADMIN).json()["items"]
        assert [e["reason"] for e in listed] == ["HandlerFailed"]
    assert [e["reason"] for e in store.events("team-x/j")] == ["HandlerFailed"]  # what the job page shows
