"""The node protocol's negotiated features, over HTTP (`crds.node.FEATURES`): beat-results (a beat carries
results, its reply acknowledges them, paced by `beatGap`) and beat-deltas (a change-prompted beat names only
what changed and renews nothing). A daemon that does not ask meets none of the new reply fields."""
from __future__ import annotations

import json

import pytest

from rolloutd.controller.store.durability import Durable
from rolloutd.crds.node import NODE_PROTOCOL, LeaseResponse, beat_gap

from support.node_api import JOIN, NODES, call, node_api, result
from ..work.test_scheduler import Clock


@pytest.fixture
def api(tmp_path):
    clock = Clock()
    with node_api(tmp_path, clock=clock, lease_seconds=10) as (client, scheduler):
        yield client, scheduler, clock


def register(api, features=None):
    query = "" if features is None else f"?features={features}"
    return call(api, f"register{query}", {"job": "math-demo", "name": "n1", "protocol": NODE_PROTOCOL})


def test_only_a_daemon_that_asks_meets_the_features_fields(api):
    client, scheduler, _ = api
    old = register(client)
    assert "features" not in old
    beat = call(client, f"{old['nodeId']}/heartbeat", {"stages": {}})
    assert not {"accepted", "dropped", "beatGap"} & set(beat)
    new = register(client, "beat-results,beat-deltas,something-newer")
    assert new["features"] == ["beat-results", "beat-deltas"]  # what it asked, less what this controller lacks
    beat = call(client, f"{new['nodeId']}/heartbeat", {"stages": {}})
    assert beat["accepted"] == [] and beat["dropped"] == {} and beat["beatGap"] >= beat_gap(1)


def test_results_ride_on_beats_once_each_with_the_next_leases(api):
    client, scheduler, _ = api
    nid = register(client, "beat-results,beat-deltas")["nodeId"]
    leases = LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": 3})).leases
    a, b, c = (l.attempt_id for l in leases)
    reply = call(client, f"{nid}/heartbeat?lease=2", {
        "full": False, "stages": {c: "run"}, "leftRun": [],
        "results": [result(a), result(b, 0.0), result("9999.1.ffffff")]})
    assert sorted(reply["accepted"]) == sorted([a, b]) and "stale" in reply["dropped"]["9999.1.ffffff"]
    assert len(reply["lease"]["leases"]) == 2 and reply["unknown"] == []
    again = call(client, f"{nid}/heartbeat", {"full": False, "stages": {}, "results": [result(a)]})
    assert again["accepted"] == [] and a in again["dropped"]  # a repeat is dropped, never delivered twice
    delivered = [json.loads(d) for _, d in scheduler.work.feed.trajectories("math-demo")]
    assert sorted(t["reward"] for t in delivered) == [0.0, 1.0]


def test_a_delta_beat_renews_nothing_and_a_full_beat_renews_what_it_names(api):
    client, scheduler, clock = api
    nid = register(client, "beat-results,beat-deltas")["nodeId"]
    named, unnamed = (l.attempt_id for l in
                      LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": 2})).leases)
    clock.t += 6  # leaseSeconds 10
    granted = scheduler.work.queue.leases.get(named).until
    call(client, f"{nid}/heartbeat", {"full": False, "stages": {named: "run", unnamed: "run"}})
    assert scheduler.work.queue.leases.get(named).until == granted  # a delta beat is no sign the lease is still held
    call(client, f"{nid}/heartbeat", {"full": True, "stages": {named: "run"}})
    assert scheduler.work.queue.leases.get(named).until == clock.t + 10
    clock.t += 5
    assert scheduler.work.attempts.expire() == 1  # the one no full beat named: back to the queue
    reply = call(client, f"{nid}/heartbeat", {"full": False, "stages": {unnamed: "eval"}})
    assert reply["unknown"] == [unnamed]
    assert call(client, f"{nid}/heartbeat", {"results": [result(named)]})["accepted"] == [named]


def test_the_beat_gap_grows_with_the_registered_daemons(api, monkeypatch):
    client, scheduler, _ = api
    scheduler.work.registry.budget = 100.0
    nids = [register(client, "beat-results")["nodeId"] for _ in range(50)]
    scheduler.work.attempts.expire()  # the silent-node pass counts the live daemons
    gap = call(client, f"{nids[0]}/heartbeat", {"stages": {}})["beatGap"]
    assert gap == pytest.approx(50 / 100.0)



ENGINE = "http://127.0.0.1:8000"  # math-demo's backend


@pytest.mark.parametrize("field,value", [("llmProcessed", {ENGINE: 10 ** 400}), ("llmTokens", {ENGINE: -1}),
                                         ("llmRateHeld", [1.0, "NaN"]), ("llmRateHeld", [1e400])])
def test_a_hostile_beats_counts_are_refused_naming_the_field_and_the_next_beat_is_served(api, field, value):
    """A node's token counts and held seconds are bounded (`crds.node.Count`, `Seconds`): 10**400 processed tokens
    overflowed the work share's float rates (a 500 on this and every later beat of every job on that backend for
    the share's window), NaN would poison the namespace's counters."""
    client, _, _ = api
    nid = register(client, "token-share,work-share")["nodeId"]
    call(client, f"{nid}/heartbeat", {"stages": {}, "llmProcessed": {ENGINE: 0}})  # the node's baseline
    r = client.post(f"{NODES}/{nid}/heartbeat", content=json.dumps({"stages": {}, field: value}),
                    headers={**JOIN, "content-type": "application/json"})
    assert r.status_code == 422 and field in r.text, r.text
    assert ENGINE in call(client, f"{nid}/heartbeat", {"stages": {}, "llmProcessed": {ENGINE: 2 ** 53}})["llmRates"]


def test_a_beat_waiting_for_the_disk_keeps_its_nodes_leases(tmp_path, monkeypatch):
    """A beat that carries results is answered only once they are on the disk, and its node beats again only after
    that answer: an fsync slower than a lease (a busy disk; CI, 2026-11-30) must not expire the node's other leases
    while it waits (the expiry pass runs meanwhile), and each, a lease granted on that beat's reply too, runs a whole
    lease from the answer."""
    clock, slow = Clock(), {}

    async def slow_settle(self):
        if "scheduler" in slow:  # the beat's own sync: it takes two and a half leases, the expiry pass runs meanwhile
            clock.t += 25
            slow["expired"] = slow["scheduler"].work.attempts.expire()

    monkeypatch.setattr(Durable, "settle", slow_settle)
    with node_api(tmp_path, clock=clock, lease_seconds=10) as (client, scheduler):
        nid = register(client, "beat-results,beat-deltas")["nodeId"]
        done, running = (l.attempt_id for l in
                         LeaseResponse.model_validate(call(client, f"{nid}/lease", {"maxItems": 2})).leases)
        slow["scheduler"] = scheduler
        reply = call(client, f"{nid}/heartbeat?lease=1",
                     {"full": True, "stages": {running: "run"}, "results": [result(done)]})
        assert reply["accepted"] == [done]
        granted = reply["lease"]["leases"][0]["attemptId"]  # granted before the sync, answered after it
        assert slow["expired"] == 0  # nothing requeued while the node waited for our disk
        for aid in (running, granted):
            assert scheduler.work.queue.leases.get(aid).until == clock.t + 10  # a whole lease from the answer
        clock.t += 11
        assert scheduler.work.attempts.expire() == 2  # then they run out as any other
