"""Node shards (controller/ha/shards.py): two controller replicas on the real PostgreSQL server each serve the node
calls of the nodes they own — none forwarded once the daemons moved to their owners — and when the replica that
is not the leader is killed (kill -9) mid-job its nodes move to the other at their daemons' next calls (taken over
on the daemon's word that the killed one gave no answer), which adopts their leases from the database: every rollout is delivered exactly once to a streaming trainer and the job ends Succeeded.

Real controllers, real daemons (four, of the leader's local executor), real bwrap (gated oracle rollouts: the kill
lands while every rollout waits at INIT's gate)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections import Counter

import httpx
import pytest
from sqlalchemy import create_engine

from rolloutd.controller import dialects
from rolloutd.controller.ha.shards import OWNER
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


def _beat_past_ended_sessions(member, node: str) -> httpx.Response:
    """A node's beat sent to `member`; retried while it answers 503 for a database session ended under it (its pool
    reconnects after the first: at most once per pooled connection)."""
    for _ in range(12):
        r = httpx.post(f"{member.url}/apis/rolloutd.io/v1alpha1/nodes/{node}/heartbeat", json={}, timeout=30,
                       headers={"Authorization": f"Bearer {member.token}"})
        if r.status_code != 503 or "administrator command" not in r.text:
            return r
    return r


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
    for m in (leader, follower):  # every call reached its owner: none forwarded, none redirected while the job ran
        assert after[m.url].get("forwarded", 0) == 0, (before, after)  # (owner-redirect: calls are redirected)
        assert after[m.url].get("redirected", 0) == before[m.url].get("redirected", 0), (before, after)
    # the daemons start at the leader: those of the follower's nodes were told at their first call, and moved
    assert after[leader.url].get("redirected", 0) >= 1, after
    print(f"node calls: before {before}, after {after}; owners {sorted(owned.values())}")

    trainer = Trainer(replicas.servers, replicas.data_dir / "token", "sharded")
    trainer.start()
    pids = leader.daemon_pids()
    moved = [n for n, o in owned.items() if o == follower.url]
    handed = node_calls(leader).get("handed", 0)
    follower.kill()
    wait_until(lambda: set(owners(replicas).values()) == {leader.url}, 60, "the killed replica's nodes moved",
               every=0.2)
    # each at its daemon's next call: the daemon could not reach the owner the leader's 421 named, went back saying
    # so, and the leader took the node over then (none waited for the killed one's row to run out: issue #42)
    # and none of the leader's nodes handed to the killed one meanwhile (it was a member until its row ran out)
    calls = node_calls(leader)
    assert (calls.get("taken", 0), calls.get("handed", 0)) == (len(moved), handed), (calls, moved)
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


def _two_gates(tmp_path, name: str) -> tuple[dict, object, object]:
    """The gated job of NODES nodes, its first half of rollouts held by gate `early`, the rest by `late`."""
    early, late = tmp_path / "early", tmp_path / "late"
    doc = gated_oracle_job(name, late, rollouts=ROLLOUTS)
    doc["spec"]["executor"]["nodes"] = NODES
    source = tmp_path / f"{name}.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    source.write_text("".join(json.dumps({**row, "gate": str(early if i < ROLLOUTS // 2 else late)}) + "\n"
                              for i, row in enumerate(rows)))
    return doc, early, late


def test_a_replica_that_joins_takes_its_share_of_running_nodes_with_nothing_lost(pg_replicas, tmp_path):
    """One replica serves every node of a running job; a second starts: half the nodes move to it at their next
    call (their held leases adopted, results in flight and beats answered wherever they land), both serve their
    own nodes from then on, and every rollout ends on its first attempt, delivered once."""
    replicas = pg_replicas
    first = replicas.start(0)
    assert replicas.wait_leader(120)[0] is first
    doc, early, late = _two_gates(tmp_path, "joined")
    first.apply(doc)
    wait_until(lambda: held_at_gate(first, "joined") == ROLLOUTS, 240, "every rollout held at INIT's gate", every=0.2)
    assert set(owners(replicas).values()) == {first.url}
    trainer = Trainer(replicas.servers, replicas.data_dir / "token", "joined")
    trainer.start()

    joiner = replicas.start(1)
    early.touch()  # half the rollouts end while their nodes move: their results reach whichever replica owns them
    wait_until(lambda: sorted(Counter(owners(replicas).values()).items()) ==
               sorted({first.url: NODES // 2, joiner.url: NODES // 2}.items()), 60, "half the nodes moved", every=0.2)
    before = node_calls(joiner)
    wait_until(lambda: node_calls(joiner).get("served", 0) >= before.get("served", 0) + 2 * NODES // 2, 120,
               "the joiner answering its nodes' calls itself", every=0.5)
    handed = node_calls(first).get("handed", 0)
    assert handed == NODES // 2, node_calls(first)
    # owner-redirect: the calls of the nodes handed over that reached the first replica were answered 421 naming the
    # joiner (nothing processed) and re-sent there; none forwarded. From then on the daemons call only their owners
    told = node_calls(first)
    assert told.get("redirected", 0) >= handed and told.get("forwarded", 0) == 0, told
    served = node_calls(joiner).get("served", 0)
    wait_until(lambda: node_calls(joiner).get("served", 0) >= served + 2 * NODES // 2, 120, "the joiner's nodes' beats",
               every=0.5)
    assert node_calls(first).get("redirected", 0) == told["redirected"], (told, node_calls(first))
    assert node_calls(joiner).get("forwarded", 0) == 0, node_calls(joiner)
    late.touch()
    first.wait_done("joined", 240)
    got = scored_once(first, "joined", ROLLOUTS)
    assert [t["attempt"] for t in got] == [1] * ROLLOUTS, [(t["prompt"], t["sample"], t["attempt"]) for t in got]
    trainer.join(120)
    assert trainer.error is None, trainer.error
    assert trainer.counts() == (ROLLOUTS, 0)
    counts = first.get("joined")["status"]["counts"]
    assert (counts["total"], counts["succeeded"], counts.get("infraFailed", 0)) == (ROLLOUTS, ROLLOUTS, 0), counts
    print(f"a replica joined a running job: {handed:g} of {NODES} nodes handed over at their next call; "
          f"calls {node_calls(first)} / {node_calls(joiner)}; {ROLLOUTS} delivered once, all on attempt 1")


def test_a_paused_replica_whose_nodes_moved_answers_none_of_their_calls(pg_replicas, tmp_path):
    """The replica that does not lead is paused (SIGSTOP) past its membership's lapse: its nodes move to the leader.
    Resumed, it must answer none of their calls from its memory nor commit for them: each call is checked against
    the node's owner row in its transaction (the fence) and forwarded to the owner, whose address the reply names.
    To look at the first moments after a resume (before its own refresh would correct its view), this test holds
    the resumed replica's membership renewal back (its row locked): its view stays the one from before the pause.
    Paused inside a node call's transaction, it held that node's row: the leader ended its database sessions
    (`replica_tables.end_sessions`) to move the node, and its first calls after the resume may find a session ended."""
    replicas = pg_replicas
    leader = replicas.start(0)
    assert replicas.wait_leader(120)[0] is leader
    other = replicas.start(1)
    gate = tmp_path / "gate"
    doc = gated_oracle_job("paused", gate, rollouts=ROLLOUTS)
    doc["spec"]["executor"]["nodes"] = NODES
    other.apply(doc)
    wait_until(lambda: held_at_gate(leader, "paused") == ROLLOUTS, 240, "every rollout held at INIT's gate", every=0.2)
    wait_until(lambda: set(owners(replicas).values()) == {leader.url, other.url}, 60, "both replicas own nodes")
    moved = sorted(n for n, o in owners(replicas).items() if o == other.url)
    trainer = Trainer(replicas.servers, replicas.data_dir / "token", "paused")
    trainer.start()
    engine = create_engine(dialects.engine_url(replicas.store))
    os.killpg(other.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: set(owners(replicas).values()) == {leader.url}, 60, "the paused replica's nodes moved",
                   every=0.2)
        with engine.connect() as hold:  # its renewal waits on this lock: it keeps its view from before the pause
            hold.exec_driver_sql("SELECT 1 FROM replica_members WHERE url = %s FOR UPDATE", (other.url,))
            os.killpg(other.proc.pid, signal.SIGCONT)
            before = node_calls(other)
            for node in moved:  # what its daemon would send it (a beat), the admin token standing in for the node's
                r = _beat_past_ended_sessions(other, node)
                # the daemons declared owner-redirect: 421 naming the owner, not answered nor forwarded
                assert r.status_code == 421, r.text
                assert r.headers.get(OWNER) == leader.url, ("answered by the paused replica", dict(r.headers))
            after = node_calls(other)
            # none served; each redirected, by its fence or by the view a fenced call corrected (the daemons' own
            # calls that waited in its socket through the pause were fenced the moment it resumed)
            assert after.get("served", 0) == before.get("served", 0), (before, after)
            assert sum(after.get(k, 0) - before.get(k, 0) for k in ("fenced", "redirected")) >= len(moved), (before, after)
            hold.rollback()
    finally:
        os.killpg(other.proc.pid, signal.SIGCONT)
        engine.dispose()
    gate.touch()
    leader.wait_done("paused", 240)
    got = scored_once(leader, "paused", ROLLOUTS)
    assert [t["attempt"] for t in got] == [1] * ROLLOUTS, [(t["prompt"], t["sample"], t["attempt"]) for t in got]
    trainer.join(120)
    assert trainer.error is None, trainer.error
    assert trainer.counts() == (ROLLOUTS, 0)
    print(f"paused past its lapse: {len(moved)} nodes moved; resumed, none of their calls served there: {after} "
          f"(at the resume {before})")
