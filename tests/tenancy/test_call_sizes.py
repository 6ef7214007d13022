"""A node call that names more attempts than one query can (a lease's `maxItems`, a return's, a beat's or a results
call's lists) is refused with a 422 naming the field, on both stores (the real controller process); a node's
honest calls, the largest its pools allow, are answered. Before, a return of 70 000 ids on PostgreSQL was answered 503 "the database
server cannot be reached" at every retry (past its 65 535 parameters per statement: the driver's error read as an
outage), and any `maxItems` was taken."""
from __future__ import annotations

import secrets

import pytest

from support.sim.noop import noop_job
from support.waiting import wait_until

from rolloutd.crds.node import MAX_ATTEMPTS_PER_CALL, MAX_BACKENDS_PER_CALL, NODE_PROTOCOL
from rolloutd.crds.rolloutjob import MAX_WORKERS

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
TOO_MANY = 70_000  # past PostgreSQL's parameters per statement


@pytest.fixture
def node(served) -> tuple:
    """(client, the node's URL prefix) of a node registered in a fresh job of 16 rollouts."""
    api, source, backends = served
    job = "sizes-" + secrets.token_hex(4)
    assert api.post(P, json=noop_job(job, source, 16, backends)).status_code == 201
    reg = api.post(f"{P}/{job}/nodes/register", json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL})
    assert reg.status_code == 200, reg.text
    return api, f"{P}/{job}/nodes/{reg.json()['nodeId']}"


def _fields(r) -> list[str]:
    assert r.status_code == 422, (r.status_code, r.text)
    return [c["field"] for c in r.json()["details"]["causes"]]


def _ids(n: int) -> list[str]:
    return [f"a{i:06d}" for i in range(n)]


def test_a_lease_asking_for_more_than_a_call_may_name_is_refused_naming_max_items(node):
    api, at = node
    for asked in (10 ** 30, 1 << 63, MAX_ATTEMPTS_PER_CALL + 1):
        assert _fields(api.post(f"{at}/lease", json={"maxItems": asked})) == ["maxItems"]
    leases: list[dict] = []

    def leased() -> bool:
        r = api.post(f"{at}/lease", json={"maxItems": MAX_ATTEMPTS_PER_CALL, "wait": 2.0})
        assert r.status_code == 200, r.text
        leases.extend(r.json()["leases"])
        return len(leases) >= 16
    wait_until(leased, 60, "the job's 16 rollouts leased at the bound")


def test_lists_longer_than_one_query_can_name_are_refused_naming_the_field(node):
    api, at = node
    assert _fields(api.post(f"{at}/return", json={"attemptIds": _ids(TOO_MANY)})) == ["attemptIds"]
    assert _fields(api.post(f"{at}/results", json={"results": [{}] * (MAX_ATTEMPTS_PER_CALL + 1)})) == ["results"]
    too_many = dict.fromkeys(_ids(MAX_ATTEMPTS_PER_CALL + 1), "run")
    for field, body in (("stages", {"stages": too_many}), ("leftRun", {"leftRun": list(too_many)}),
                        ("turns", {"turns": dict.fromkeys(too_many, 1)}),
                        ("llmTokens", {"llmTokens": {f"http://b{i}": 1 for i in range(MAX_BACKENDS_PER_CALL + 1)}})):
        assert _fields(api.post(f"{at}/heartbeat", json=body)) == [field]


def test_the_largest_lists_a_call_may_carry_are_answered(node):
    """At the bound, on PostgreSQL too: one query names them all (unknown ids: nothing returned, all unknown)."""
    api, at = node
    back = api.post(f"{at}/return", json={"attemptIds": _ids(MAX_ATTEMPTS_PER_CALL)})
    assert back.status_code == 200 and back.json()["returned"] == 0, back.text
    beat = api.post(f"{at}/heartbeat", json={"stages": dict.fromkeys(_ids(MAX_ATTEMPTS_PER_CALL), "run"), "full": True})
    assert beat.status_code == 200 and len(beat.json()["unknown"]) == MAX_ATTEMPTS_PER_CALL, beat.text


def test_a_spec_whose_pools_could_outgrow_a_call_is_refused_naming_the_pool(served):
    api, source, backends = served
    spec = noop_job("sizes-" + secrets.token_hex(4), source, 16, backends)
    spec["spec"].setdefault("pipeline", {}).setdefault("workersPerNode", {})["run"] = MAX_WORKERS + 1
    r = api.post(P, json=spec)
    assert r.status_code == 422 and "spec.pipeline.workersPerNode.run" in r.text, r.text
    assert 3 * MAX_WORKERS + 64 < MAX_ATTEMPTS_PER_CALL  # the pools and the warm sandboxes, under a call's bound
