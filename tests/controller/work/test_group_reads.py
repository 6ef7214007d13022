"""Node calls committed in one group (`controller/work/group_commit.py`), with their reads sent before the group's
calls run on PostgreSQL (`group_reads.py`): what the calls share is dealt in their order, a call naming a node or an
attempt an earlier call named reads at its turn, and nothing read ahead is used once the ORM ran in the group. Each
test runs on both stores: SQLite (each call reads at its turn) must give the same answers."""
from __future__ import annotations

import asyncio

from rolloutd.crds.node import Heartbeat, ResultBatch
from rolloutd.crds.trajectory import Failure, Trajectory
from rolloutd.crds.node import Result

from .test_scheduler import lease, make, ok, reg


def together(*calls):
    """The calls submitted in one turn of the loop: one group."""
    async def run():
        return await asyncio.gather(*[c() for c in calls], return_exceptions=True)
    return asyncio.run(run())


def test_the_beats_of_one_group_are_dealt_distinct_items_in_queue_order(tmp_path, store_location):
    """Eight nodes' beats in one group, each asking for three items, one asking past the read-ahead bound (its items
    are read at its turn): every item is granted once, in the queue's order by the beats' order, each with its task."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=20, samples=2, nodes=8)
    nodes = [reg(sched, f"n{i}") for i in range(8)]
    calls = sched.work.calls
    asks = [3, 3, 3, 100, 3, 3, 3, 3]
    answers = together(*[lambda n=n, k=k: calls.heartbeat_grouped(n, Heartbeat(), lease=k)
                         for n, k in zip(nodes, asks)])
    leases = [l for a in answers for l in a.lease.leases]
    items = [l.item for l in leases]
    assert len(items) == len(set(items)), "an item granted twice"
    assert len(leases) == sum(min(k, 5) for k in asks)  # 40 items over 8 nodes: a share of 5 each
    assert sorted(items) == items, "dealt out of the queue's order"
    assert all(l.task["question"] == f"{l.prompt}+1?" for l in leases)
    assert sorted((l.prompt, l.sample) for l in leases) == [(p, s) for p in range(20) for s in range(2)][:len(leases)]
    assert sched.work.queue.counts("math-demo")["leased"] == len(leases)


def test_a_beat_and_a_results_call_of_one_group_naming_the_same_attempts_deliver_each_once(tmp_path, store_location):
    """A node whose results call timed out sends them again on its beat, and both land in one group: the beat, read
    ahead of the group, would see the attempts still leased. It reads at its turn instead (the results call named
    them first): each result is accepted once and the trainer gets each trajectory once."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1, nodes=1)
    node = reg(sched)
    a, b = lease(sched, node, 2)
    calls = sched.work.calls
    batch = [ok(a), ok(b)]
    first, again = together(lambda: calls.results_grouped(node, ResultBatch(results=batch)),
                            lambda: calls.heartbeat_grouped(node, Heartbeat(results=batch), lease=1))
    assert sorted(first.accepted) == sorted([a.attempt_id, b.attempt_id])
    assert again.accepted == [] and set(again.dropped) == {a.attempt_id, b.attempt_id}
    assert len(sched.work.feed.trajectories("math-demo")) == 2


def test_what_a_call_cancelled_with_the_orm_is_seen_cancelled_by_a_later_beat_of_its_group(tmp_path, store_location):
    """A result saying the job is misconfigured fails the job and cancels its live items (through the ORM), and a
    beat after it in the same group reports another node's result: the items read ahead of the group are stale then,
    so the beat reads them again, drops its result as cancelled and is granted nothing."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=4, samples=1, nodes=2)
    n1, n2 = reg(sched, "n1"), reg(sched, "n2")
    [first], [second] = lease(sched, n1, 1), lease(sched, n2, 1)
    config = Result(attempt_id=first.attempt_id, trajectory=Trajectory(
        job="x", prompt=0, sample=0, failure=Failure(kind="config", reason="spec.tasks.kind: no such handler")))
    calls = sched.work.calls
    failed, beat = together(lambda: calls.heartbeat_grouped(n1, Heartbeat(results=[config])),
                            lambda: calls.heartbeat_grouped(n2, Heartbeat(results=[ok(second)]), lease=2))
    assert failed.accepted == [first.attempt_id]
    assert beat.dropped == {second.attempt_id: "cancelled"} and beat.lease.leases == []
    assert len(sched.work.feed.trajectories("math-demo")) == 1  # the config failure only
    assert set(sched.work.queue.counts("math-demo")) == {"failed", "cancelled"}
