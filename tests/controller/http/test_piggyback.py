"""Leases riding on beat and results replies (`?lease=N`): only a caller that asks gets the `lease` field (an
older daemon never meets it), the leases it brings are ordinary ones, and every result still lands exactly once."""
from __future__ import annotations

import json

import pytest

from rolloutd.crds.node import NODE_PROTOCOL, HeartbeatResponse, LeaseResponse, ResultAck

from support.node_api import JOIN, NODES, call, node_api, result


@pytest.fixture
def node(tmp_path):
    with node_api(tmp_path) as (api, scheduler):
        reg = api.post(f"{NODES}/register", json={"job": "math-demo", "name": "n1", "protocol": NODE_PROTOCOL},
                       headers=JOIN)
        assert reg.status_code == 200, reg.text
        yield api, scheduler, reg.json()["nodeId"]


def test_a_lease_rides_on_a_reply_only_when_asked_and_every_result_lands_once(node):
    api, scheduler, nid = node
    first = LeaseResponse.model_validate(call(api, f"{nid}/lease", {"maxItems": 2})).leases
    assert len(first) == 2

    plain = call(api, f"{nid}/results", {"results": [result(first[0].attempt_id)]})
    assert set(plain) == {"accepted", "dropped"}  # what a daemon that never asks knows
    asked = ResultAck.model_validate(call(api, f"{nid}/results?lease=3", {"results": [result(first[1].attempt_id)]}))
    assert asked.accepted == [first[1].attempt_id] and len(asked.lease.leases) == 3 and not asked.lease.done

    riding = asked.lease.leases
    stages = {lease.attempt_id: "run" for lease in riding}
    assert "lease" not in call(api, f"{nid}/heartbeat", {"stages": stages})
    beat = HeartbeatResponse.model_validate(call(api, f"{nid}/heartbeat?lease=5", {"stages": stages}))
    assert beat.unknown == [] and beat.cancel == [] and len(beat.lease.leases) == 3  # the last 3 of 8 items
    riding += beat.lease.leases
    assert len({lease.item for lease in first + riding}) == 8

    ack = ResultAck.model_validate(call(api, f"{nid}/results?lease=1", {"results": [result(x.attempt_id)
                                                                                      for x in riding]}))
    assert sorted(ack.accepted) == sorted(x.attempt_id for x in riding)
    assert ack.lease.leases == [] and ack.lease.done  # nothing left: the daemon may stop
    again = ResultAck.model_validate(call(api, f"{nid}/results", {"results": [result(riding[0].attempt_id)]}))
    assert again.accepted == [] and riding[0].attempt_id in again.dropped
    delivered = [json.loads(data)["prompt"] * 2 + json.loads(data)["sample"]
                 for _, data in scheduler.work.feed.trajectories("math-demo")]
    assert sorted(delivered) == list(range(8))


def test_a_bad_lease_parameter_is_refused_and_a_lost_node_still_gets_its_results_answer(node):
    api, scheduler, nid = node
    r = api.post(f"{NODES}/{nid}/heartbeat?lease=-1", json={}, headers=JOIN)
    assert r.status_code == 400 and "lease" in r.json()["message"]
    (lease,) = LeaseResponse.model_validate(call(api, f"{nid}/lease", {"maxItems": 1})).leases
    scheduler.work.registry.deregister(nid)
    ack = ResultAck.model_validate(call(api, f"{nid}/results?lease=2", {"results": [result(lease.attempt_id)]}))
    assert ack.accepted == [] and ack.lease.leases == []
    assert api.post(f"{NODES}/{nid}/lease", json={"maxItems": 1}, headers=JOIN).status_code == 404
