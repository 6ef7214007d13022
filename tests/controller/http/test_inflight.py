"""The in-flight view (`GET …/rolloutjobs/{name}/inflight`) and the rollout counters of /metrics, over HTTP
against a real app and scheduler, with the node protocol played by the test and the scheduler's clock its own."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutd.crds.node import NODE_PROTOCOL, LeaseResponse

from support.node_api import JOIN, call, node_api
from ..work.test_scheduler import Clock

INFLIGHT = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs/math-demo/inflight"


@pytest.fixture
def api(tmp_path):
    clock = Clock()
    with node_api(tmp_path, clock=clock, lease_seconds=600) as (client, scheduler):
        yield client, scheduler, clock


def lease(client, n: int) -> tuple[str, list[str]]:
    nid = call(client, "register", {"job": "math-demo", "name": "n1", "protocol": NODE_PROTOCOL})["nodeId"]
    leases = LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": n})).leases
    return nid, [l.attempt_id for l in leases]


def counters(client) -> dict[str, float]:
    text = client.get("/metrics", headers=JOIN).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("rolloutd_rollout")}


def test_every_leased_rollout_with_its_stage_time_and_node_the_stuck_one_flagged(api):
    client, scheduler, clock = api
    nid, (stuck, moving, unstarted) = lease(client, 3)
    call(client, f"{nid}/heartbeat", {"stages": {stuck: "run", moving: "init"}})
    clock.t += 30
    call(client, f"{nid}/heartbeat", {"stages": {stuck: "run", moving: "eval", unstarted: "leased"}})
    clock.t += 2
    doc = client.get(INFLIGHT, params={"stalledAfterSeconds": 20}, headers=JOIN).json()
    assert doc["total"] == 3 and doc["stalled"] == 2 and doc["stalledAfterSeconds"] == 20
    assert doc["stages"] == {"queued": 1, "init": 0, "run": 1, "eval": 1}
    rows = {r["attemptId"]: r for r in doc["items"]}
    assert rows[stuck]["stage"] == "run" and rows[stuck]["inStageSeconds"] == 32 and rows[stuck]["stalled"]
    assert rows[moving]["stage"] == "eval" and rows[moving]["inStageSeconds"] == 2 and not rows[moving]["stalled"]
    # leased 32 s ago and never started on its node: stalled in the queue of its node
    assert rows[unstarted]["stage"] == "queued" and rows[unstarted]["stalled"]
    assert rows[stuck]["sinceHeartbeatSeconds"] == 2 and rows[stuck]["node"] == nid and rows[stuck]["attempt"] == 1
    assert [r["stalled"] for r in doc["items"]] == [True, True, False]  # stalled first
    # the controller's default threshold (300 s) flags none; a limit bounds the rows, stalled first
    assert client.get(INFLIGHT, headers=JOIN).json()["stalled"] == 0
    one = client.get(INFLIGHT, params={"stalledAfterSeconds": 20, "limit": 1}, headers=JOIN).json()
    assert one["truncated"] and len(one["items"]) == 1 and one["items"][0]["stalled"]


def test_a_bad_query_names_its_field_and_an_unknown_job_is_404(api):
    client, _, _ = api
    r = client.get(INFLIGHT, params={"stalledAfterSeconds": "-1"}, headers=JOIN)
    assert r.status_code == 400 and "stalledAfterSeconds" in r.text
    r = client.get(INFLIGHT, params={"limit": 0}, headers=JOIN)
    assert r.status_code == 400 and "limit" in r.text
    assert client.get(INFLIGHT.replace("math-demo", "nope"), headers=JOIN).status_code == 404


def test_retries_masked_samples_and_stalls_are_counted_without_ids(api):
    client, scheduler, clock = api
    scheduler.work.queue.leases.stall_seconds = 20
    before = counters(client)
    assert before == {"rolloutd_rollout_retries_total": 0, "rolloutd_rollouts_masked_total": 0,
                      "rolloutd_rollout_cleanups_total": 0, "rolloutd_rollout_stalls_total": 0}
    nid, _ = lease(client, 0)
    for _ in range(3):  # maxAttempts 3: two retries of each of the 8 rollouts, then each delivered masked
        leases = LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": 8})).leases
        assert len(leases) == 8
        if _ == 0:  # the first round: one rollout sits in RUN past the threshold before it fails
            call(client, f"{nid}/heartbeat", {"stages": {leases[0].attempt_id: "run"}})
            clock.t += 25
        failed = {"kind": "infra", "reason": "sandbox died"}
        call(client, f"{nid}/results", {"results": [
            {"attemptId": l.attempt_id, "trajectory": {"job": "x", "prompt": 0, "sample": 0, "failure": failed}}
            for l in leases]})
    got = counters(client)
    # all 8 sat 25 s in a stage (7 of them leased and unstarted): each counted once, as it left it
    assert got["rolloutd_rollout_retries_total"] == 16 and got["rolloutd_rollouts_masked_total"] == 8
    assert got["rolloutd_rollout_stalls_total"] == 8
    text = client.get("/metrics", headers=JOIN).text
    assert not [line for line in text.splitlines() if line.startswith("rolloutd_rollout") and "{" in line]


def test_rollouts_cancelled_on_their_nodes_are_counted_as_cleanups(api):
    client, scheduler, _ = api
    nid, leased = lease(client, 3)
    asyncio.run(scheduler.forget(scheduler.work.store.get("math-demo")))  # the job is being deleted
    assert counters(client)["rolloutd_rollout_cleanups_total"] == 3  # the 5 never leased need no cleanup
    assert sorted(call(client, f"{nid}/heartbeat", {"stages": {a: "run" for a in leased}})["cancel"]) == sorted(leased)


def test_a_daemon_with_beat_turns_tells_the_turn_of_each_rollout_in_run(api):
    client, _, _ = api
    reg = call(client, "register?features=beat-turns", {"job": "math-demo", "name": "n1", "protocol": NODE_PROTOCOL})
    assert reg["features"] == ["beat-turns"]
    nid = reg["nodeId"]
    running, starting = (l.attempt_id for l in
                         LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": 2})).leases)
    call(client, f"{nid}/heartbeat", {"stages": {running: "run", starting: "init"}, "turns": {running: 3,
                                                                                            "9999.1.ffffff": 1}})
    rows = {r["attemptId"]: r for r in client.get(INFLIGHT, headers=JOIN).json()["items"]}
    assert rows[running]["turn"] == 3 and rows[starting]["turn"] is None
