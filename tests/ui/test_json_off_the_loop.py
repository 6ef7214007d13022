"""The web UI's JSON answers that grow with a job (one trajectory's view, the trajectories table, the curves, the
config) are encoded in the route's worker thread by json's C encoder, never by FastAPI's generic encoder on the
event loop (a 65 536-token trajectory's view held the loop 0.53 s there: `python -m bench answers`). Real app, real
store; the generic encoder replaced by one that fails the test if it is called."""
from __future__ import annotations

import json

import fastapi.routing
import pytest
from fastapi.testclient import TestClient

from rolloutd.controller.api import create_app
from rolloutd.controller.root import assemble
from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

ADMIN = {"Authorization": "Bearer admin"}
JOB = "/ui/api/jobs/default/j"
TOKENS = 4096


@pytest.fixture
def client(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": 0, "question": "q", "answer": "a"}) + "\n")
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j"},
        "spec": {"tasks": {"kind": "math", "source": str(tmp_path / "d.jsonl")}, "agent": {"kind": "oracle"}}}))
    data = {"job": "j", "prompt": 0, "sample": 0, "reward": 1.0, "tokenIds": list(range(TOKENS)),
            "logprobs": [-0.5] * TOKENS, "lossMask": [1] * TOKENS, "failure": {"kind": "none"},
            "messages": [{"role": "user", "content": "q \u00e9"}]}
    with store.engine.begin() as c:
        c.exec_driver_sql("INSERT INTO trajectories (seq, job, item, prompt, sample, reward, failure, reason, data) "
                          "VALUES (7, 'j', 0, 0, 0, 1.0, 'none', '', ?)", (json.dumps(data),))
    with TestClient(create_app(assemble(store, "admin", work={})), headers=ADMIN) as c:
        yield c


def test_the_growing_answers_never_go_through_the_generic_encoder(client, monkeypatch):
    def generic(*a, **k):
        raise AssertionError("FastAPI's generic encoder ran on the loop")
    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", generic)
    view = client.get(f"{JOB}/trajectories/7")
    assert view.status_code == 200, view.text
    assert view.headers["content-type"] == "application/json"
    got = view.json()
    assert got["raw"]["tokenIds"] == list(range(TOKENS)) and got["seq"] == 7 and got["reward"] == 1.0
    assert got["messages"][0]["content"] == "q \u00e9"   # as Starlette writes it: UTF-8, not \\u escapes
    assert "\u00e9".encode() in view.content
    rows = client.get(f"{JOB}/trajectories")
    assert rows.status_code == 200, rows.text
    assert [r["seq"] for r in rows.json()["items"]] == [7]
    curves = client.get(f"{JOB}/curves")
    assert curves.status_code == 200 and "byPolicy" in curves.json(), curves.text
    config = client.get(f"{JOB}/config")
    assert config.status_code == 200 and config.json(), config.text
    assert client.get(f"{JOB}/trajectories/8").status_code == 404


def test_the_patch_is_seen_by_a_route_that_still_uses_the_generic_encoder(client, monkeypatch):
    """The check above can fail: a route returning a plain dict is refused by the same patch."""
    calls = []
    original = fastapi.routing.jsonable_encoder
    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert client.get("/ui/api/me").status_code == 200
    assert calls, "the patched encoder is not the one FastAPI calls: the test above would prove nothing"


@pytest.mark.parametrize("view", [{}, {"a": [1, 2.5], "é": None}])
@pytest.mark.parametrize("stored", ["{}", ' { "x": [1, 2], "s": "é}" } ', '{"tokenIds":[0],"reward":null}'])
def test_the_stored_trajectory_is_sent_as_stored_under_raw_with_its_seq(view, stored):
    from rolloutd.controller.ui.answers import with_raw
    assert json.loads(with_raw(view, 3, stored)) == {**view, "raw": {"seq": 3, **json.loads(stored)}}
