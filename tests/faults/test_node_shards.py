"""Node shards (controller/shards.py): two controller replicas on the real PostgreSQL server each serve the node
calls of the nodes they own — none forwarded once the daemons moved to their owners — and when the replica that
is not the leader is killed (kill -9) mid-job its nodes move to the other, which adopts their leases from the
database: every rollout is delivered exactly once to a streaming trainer and the job ends Succeeded.

Real controllers, real daemons (four, of the leader's local executor), real bwrap (gated oracle rollouts: the kill
lands while every rollout waits at INIT's gate)."""
from __future__ import annotations

import re
import shutil

import httpx
import pytest
from sqlalchemy import create_engine

from rolloutd.controller import dialects
from support.cluster import held_at_gate, plugin_env
from support.fault_jobs import gated_oracle_job, scored_once
from support.waiting import alive, wait_until

from .test_failover import Trainer

ROLLOUTS, NODES = 8, 4


@pytest.fixture
def pg_replicas(tmp_path, monkeypatch, pg_server):
    from support.replicas import Replicas

    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/system-packages.sh installs it)")
    (tmp_path / "sandboxes").mkdir()
    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(tmp_path / "sandboxes"))
    r = Replicas(tmp_path, {**plugin_env(), "ROLLOUTD_NODE_SHARDS": "1"}, store=pg_server.create_database())
    yield r
    r.stop()


def owners(replicas) -> dict[str, str]:
    engine = create_engine(dialects.engine_url(replicas.store))
    try:
        with engine.connect() as c:
            return dict(c.exec_driver_sql("SELECT o.node_id, o.owner FROM node_owners o JOIN nodes n "
                                          "ON n.id = o.node_id WHERE n.state != 'gone'").fetchall())
    finally:
        engine.dispose()


def node_calls(member) -> dict[str, float]:
    """served / forwarded node calls, from the replica's /metrics."""
    text = httpx.get(member.url + "/metrics", headers={"Authorization": f"Bearer {member.token}"}, timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(r'rolloutd_replica_node_calls_total\{how="(\w+)"\} ([0-9.e+]+)', text)}


def test_both_replicas_serve_their_nodes_and_a_killed_ones_nodes_move_with_nothing_lost(pg_replicas, tmp_path):
    replicas = pg_replicas
    leader = replicas.start(0)
    assert replicas.wait_leader(120)[0] is leader
    follower = replicas.start(1)
    gate = tmp_path / "gate"
    doc = gated_oracle_job("sharded", gate, rollouts=ROLLOUTS)
    doc["spec"]["executor"]["nodes"] = NODES
    follower.apply(doc)
    # the stages of the leases both replicas hold: the status sums them (each replica writes its own each second)
    wait_until(lambda: held_at_gate(leader, "sharded") == ROLLOUTS, 240, "every rollout held at INIT's gate", every=0.2)
    owned = owners(replicas)
    assert len(owned) == NODES and set(owned.values()) == {leader.url, follower.url}, owned

    before = {m.url: node_calls(m) for m in (leader, follower)}
    wait_until(lambda: all(node_calls(m).get("served", 0) >= before[m.url].get("served", 0) + 2 * NODES
                           for m in (leader, follower)), 120, "both replicas answering their nodes' beats", every=0.5)
    after = {m.url: node_calls(m) for m in (leader, follower)}
    for m in (leader, follower):  # every call reached its owner: none forwarded while the job ran
        assert after[m.url].get("forwarded", 0) == before[m.url].get("forwarded", 0), (before, after)
    print(f"node calls: before {before}, after {after}; owners {sorted(owned.values())}")

    trainer = Trainer(replicas.servers, replicas.data_dir / "token", "sharded")
    trainer.start()
    pids = leader.daemon_pids()
    moved = [n for n, o in owned.items() if o == follower.url]
    follower.kill()
    wait_until(lambda: set(owners(replicas).values()) == {leader.url}, 60, "the killed replica's nodes moved",
               every=0.2)
    assert pids and all(alive(p) for p in pids), "the daemons live on"
    gate.touch()
    leader.wait_done("sharded", 240)
    scored_once(leader, "sharded", ROLLOUTS)
    trainer.join(120)
    assert trainer.error is None, trainer.error
    delivered, duplicated = trainer.counts()
    assert (delivered, duplicated) == (ROLLOUTS, 0)
    counts = leader.get("sharded")["status"]["counts"]
    assert (counts["total"], counts["succeeded"], counts.get("infraFailed", 0)) == (ROLLOUTS, ROLLOUTS, 0), counts
    print(f"kill -9 of the replica owning {len(moved)} of {NODES} nodes: all moved, "
          f"{delivered} delivered, {duplicated} duplicated")
