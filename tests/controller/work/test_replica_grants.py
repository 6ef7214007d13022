"""Two replicas' work cores on one PostgreSQL database serving node calls at once (controller/ha/shards.py): a grant
skips the queued rows another replica is granting (no rollout leased twice), an attempt ended on two replicas at
once is delivered once, and trajectories are committed in their seq order per job (a trainer never skips one).

The real server (tests/support/postgres.py); the overlaps are made deterministic by holding one replica's
transaction open while the other runs (no timing)."""
from __future__ import annotations

import threading

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.work import hot_sql
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import ResultBatch

from .test_scheduler import make, ok, reg


def _two(tmp_path, pg_server, **kw):
    store, a, clock, job = make(tmp_path, pg_server.create_database(), **kw)
    b = Scheduler(build_work(Store(store.url), clock=clock))  # another replica: its own engine, its own memory
    a.work.attempts.lease_now(reg(a, "warm"), 0)  # the job's policy row, made on first use, exists (as in service)
    return a, b, job


def test_a_grant_skips_the_rows_another_replica_is_granting(tmp_path, pg_server):
    a, b, job = _two(tmp_path, pg_server, prompts=3, samples=2)  # 6 rollouts
    na, nb = reg(a, "na"), reg(b, "nb")
    got: dict[str, list] = {}
    with hot_sql.transaction(a.work.store.engine) as tx:
        first = a.work.attempts.lease_now(na, 4, tx).leases  # granted, not committed: its rows stay locked
        t = threading.Thread(target=lambda: got.update(second=b.work.attempts.lease_now(nb, 4).leases))
        t.start()
        t.join(30)  # it does not wait on them: it takes the others
        assert not t.is_alive(), "the other replica's grant waited on rows this one is granting"
    second = got["second"]
    assert len(first) == 4 and len(second) == 2
    items = [l.item for l in first + second]
    assert len(set(items)) == 6  # every rollout leased once
    assert a.work.attempts.lease_now(na, 4).leases == [] and b.work.attempts.lease_now(nb, 4).leases == []


def test_an_attempt_ended_on_two_replicas_at_once_is_delivered_once(tmp_path, pg_server):
    a, b, job = _two(tmp_path, pg_server, prompts=1, samples=1)
    node = reg(a)
    [l] = a.work.attempts.lease_now(node, 1).leases
    got: dict[str, object] = {}
    with hot_sql.transaction(a.work.store.engine) as tx:
        ack_a, _ = a.work.attempts.results(tx, node, ResultBatch(results=[ok(l)]), job)
        # the node's call reaches the other replica too (it moved): that one waits on the row until this commits
        t = threading.Thread(target=lambda: got.update(ack=b.work.calls.results(node, ResultBatch(results=[ok(l)]))))
        t.start()
        t.join(1.0)
        assert t.is_alive(), "the second replica's result waits on the row the first is ending"
    t.join(30)
    assert ack_a.accepted == [l.attempt_id]
    assert got["ack"].accepted == [] and l.attempt_id in got["ack"].dropped
    assert len(a.work.feed.trajectories(job.metadata.key)) == 1


def test_trajectories_commit_in_seq_order_across_replicas(tmp_path, pg_server):
    a, b, job = _two(tmp_path, pg_server, prompts=1, samples=2)
    na, nb = reg(a, "na"), reg(b, "nb")
    [la] = a.work.attempts.lease_now(na, 1).leases
    [lb] = b.work.attempts.lease_now(nb, 1).leases
    done = threading.Event()
    with hot_sql.transaction(a.work.store.engine) as tx:
        a.work.attempts.results(tx, na, ResultBatch(results=[ok(la)]), job)  # its trajectory has the lower seq
        t = threading.Thread(target=lambda: (b.work.calls.results(nb, ResultBatch(results=[ok(lb)])), done.set()))
        t.start()
        t.join(1.0)
        # a trainer reading now must not see b's (higher) seq before a's commits: b waits for the job's lock
        assert not done.is_set() and b.work.feed.trajectories(job.metadata.key) == []
    t.join(30)
    seqs = [seq for seq, _ in b.work.feed.trajectories(job.metadata.key)]
    assert len(seqs) == 2 and seqs == sorted(seqs)


def test_a_node_handed_over_is_fenced_off_its_old_owner_and_its_leases_go_with_it(tmp_path, pg_server):
    """Node shards' fence: a hand-over waits for (skips while) the owner's open call on the node; once it committed
    the old owner answers nothing for the node and, holding its leases in memory still (as a replica paused through
    the move does), expires none of them; the new owner loads them at the node's first call and ends them once."""
    from rolloutd.controller.ha.serving import NotOwner, Serving
    from rolloutd.controller.ha.shards import Shards
    from rolloutd.controller.work.held_leases import HeldLease
    from rolloutd.crds.node import Heartbeat

    a, b, job = _two(tmp_path, pg_server, prompts=1, samples=2)
    sa, sb = Shards(a.work.store.engine, "http://a"), Shards(b.work.store.engine, "http://b")
    va, _ = Serving(sa, a.work), Serving(sb, b.work)
    node = reg(a, "moving")
    assert sa.owner(node) == "http://a"  # its first call: a is the only member a knows yet
    leases = a.work.attempts.lease_now(node, 2).leases
    beat = Heartbeat(stages={lease.attempt_id: "init" for lease in leases})
    with hot_sql.transaction(a.work.store.engine) as tx:
        a.work.attempts.beat(tx, node, beat, None, job)  # a's call on the node, open: its owner row held
        assert not sa.hand_over(node, "http://b"), "moved while its owner's call on it was open"
    assert sa.hand_over(node, "http://b")
    with pytest.raises(NotOwner) as refused:
        a.work.calls.heartbeat(node, beat)
    assert refused.value.owner == "http://b" and node not in va.held
    for lease in leases:  # a replica paused through the move would hold them still: put them back
        a.work.queue.leases.add(lease.attempt_id, HeldLease(lease.item, job.metadata.key, node, "init", None, False,
                                                            a.work.clock() + 10))
    a.work.clock.t += 60  # every lease past its deadline
    assert a.work.attempts.expire() == 0, "the old owner expired a lease of a node it does not own"
    answer = b.work.calls.heartbeat(node, beat)  # b's first call of it: the leases loaded, not unknown
    assert answer.unknown == [] and answer.cancel == []
    ack = b.work.calls.results(node, ResultBatch(results=[ok(leases[0])]))
    assert ack.accepted == [leases[0].attempt_id]
    assert len(b.work.feed.trajectories(job.metadata.key)) == 1



@pytest.mark.parametrize("asked", [64, 65536])
def test_a_beat_locks_no_more_queued_rows_than_its_node_may_be_granted(tmp_path, pg_server, asked):
    """A beat reads the queued items for its lease ahead of its fair share (`hot_sql.AHEAD_ITEMS`), locking them to
    its commit: a node asking for far more than its share (`?lease=65536`, a hostile daemon) must not lock the rest of
    the queue away from the other replicas' nodes meanwhile."""
    from rolloutd.crds.node import Heartbeat

    a, b, job = _two(tmp_path, pg_server, prompts=40, samples=4, nodes=2)  # 160 rollouts, a share of 80 each
    na, nb = reg(a, "na"), reg(b, "nb")
    got: dict[str, list] = {}
    with hot_sql.transaction(a.work.store.engine) as tx:
        resp, _ = a.work.attempts.beat(tx, na, Heartbeat(), asked, job)  # granted, not committed: its rows locked
        t = threading.Thread(target=lambda: got.update(second=b.work.attempts.lease_now(nb, 200).leases))
        t.start()
        t.join(30)
        assert not t.is_alive()
    first, second = resp.lease.leases, got["second"]
    assert len(first) == min(asked, 80) and len(second) == 80
    assert len({l.item for l in first + second}) == len(first) + len(second)
