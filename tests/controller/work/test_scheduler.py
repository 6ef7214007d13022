"""The scheduler's logic in-process with a controllable clock: leases, expiry, exactly-once
results, infra retries, the backend min-heap. (The end-to-end tests in tests/e2e run the same
code under real node daemons.)"""
from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from rolloutd.controller.work.backends import BackendPool
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work import background
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.controller.store import Store
from rolloutd.crds.node import NODE_PROTOCOL, Heartbeat, RegisterRequest, Result, ResultBatch
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Failure, Trajectory
from support.waiting import until
from support.example_job import example_doc

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "math-demo.yaml"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(tmp_path, store_location, prompts=3, samples=2, backends=("http://a", "http://b"), max_attempts=2, nodes=1, on_idle=None):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(prompts)))
    doc = example_doc()
    doc["spec"]["tasks"] = {"kind": "math", "source": str(data)}
    doc["spec"]["samplesPerPrompt"] = samples
    doc["spec"]["llm"]["backends"] = [{"url": u} for u in backends]
    doc["spec"]["pipeline"]["maxAttempts"] = max_attempts
    doc["spec"]["pipeline"]["leaseSeconds"] = 10
    doc["spec"]["executor"]["nodes"] = nodes  # more: leases are capped at each node's fair share
    store = Store(store_location)
    store.apply(RolloutJob.model_validate(doc))
    clock = Clock()
    sched = Scheduler(build_work(store, clock=clock, on_idle=on_idle))
    job = store.get("math-demo")
    sched.work.expansions.expand(job)
    return store, sched, clock, job


def reg(sched, name="n1"):
    return sched.work.registry.register(RegisterRequest(job="math-demo", protocol=NODE_PROTOCOL, name=name)).node_id


def ok(lease, reward=1.0):
    return Result(attempt_id=lease.attempt_id, trajectory=Trajectory(job="x", prompt=0, sample=0, reward=reward))


def infra(lease):
    return Result(attempt_id=lease.attempt_id,
                  trajectory=Trajectory(job="x", prompt=0, sample=0, failure=Failure(kind="infra", reason="sandbox died")))


def lease(sched, node, n):
    return asyncio.run(sched.work.attempts.lease(node, n)).leases


def test_every_item_delivered_exactly_once(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location)
    node = reg(sched)
    leases = lease(sched, node, 100)
    assert sorted((l.prompt, l.sample) for l in leases) == [(p, s) for p in range(3) for s in range(2)]
    assert lease(sched, node, 100) == []  # nothing left to lease
    ack = sched.work.calls.results(node, ResultBatch(results=[ok(l) for l in leases]))
    assert len(ack.accepted) == 6
    again = sched.work.calls.results(node, ResultBatch(results=[ok(leases[0])]))  # a duplicate report
    assert again.accepted == [] and leases[0].attempt_id in again.dropped
    rows = sched.work.feed.trajectories("math-demo")
    assert len(rows) == 6
    got = sorted((json.loads(d)["prompt"], json.loads(d)["sample"]) for _, d in rows)
    assert got == [(p, s) for p in range(3) for s in range(2)]  # job/prompt/sample come from the item
    prog = asyncio.run(sched.progress(job))
    assert prog.done and prog.counts.succeeded == 6


def test_the_last_result_of_a_job_marks_it_succeeded_without_waiting_for_a_resync(tmp_path, store_location):
    """The scheduler tells the operator when a job has nothing queued or leased left; the job's
    observing daemon (the kopf handler, run by hand here) marks it Succeeded at once, although its next
    periodic pass is a minute away."""
    from rolloutd.controller.executors.base import NodeState
    from rolloutd.controller.operator.handlers import Nudges, Reconciler, observe
    from support.store_api import Stopped, StoreApi

    class OneNode:  # an executor whose one node is up
        async def ensure(self, job, nodes): pass
        async def observe(self, job): return [NodeState("n1", "running")]
        async def release(self, job): pass

    idle: list[str] = []
    nudges = Nudges()  # made first, given to both: the scheduler is built with its listener, nothing patched later
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=2,
                                    on_idle=lambda name: (idle.append(name), nudges.nudge(name)))

    def phase() -> str:
        return store.get("math-demo").status.phase.value

    async def scenario():
        rec = Reconciler(StoreApi(store), {"local": OneNode()}, sched, interval=60.0, nudges=nudges)
        stopped = Stopped()
        node = reg(sched)
        task = asyncio.create_task(observe("math-demo", "default", rec, stopped))
        try:
            await until(lambda: phase() == "Running", 5, "the first pass")
            leases = (await sched.work.attempts.lease(node, 100)).leases
            sched.work.calls.results(node, ResultBatch(results=[ok(l) for l in leases[:3]]))
            assert idle == []  # one item still leased
            sched.work.calls.results(node, ResultBatch(results=[ok(leases[3])]))
            assert idle == ["math-demo"]
            await until(lambda: phase() == "Succeeded", 5, "Succeeded (the next periodic pass is 60 s away)")
            await asyncio.wait_for(task, 5)  # a finished job's daemon ends by itself
        finally:
            stopped.set()
            task.cancel()

    asyncio.run(scenario())


def test_expired_lease_is_requeued_and_late_result_dropped(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1)
    n1, n2 = reg(sched, "n1"), reg(sched, "n2")
    [first] = lease(sched, n1, 1)
    clock.t += 11  # n1 went silent past its lease; n2 kept beating
    sched.work.calls.heartbeat(n2, Heartbeat())
    assert sched.work.attempts.expire() == 1
    [second] = lease(sched, n2, 1)
    assert second.item == first.item and second.attempt == 2 and second.attempt_id != first.attempt_id
    late = sched.work.calls.results(n1, ResultBatch(results=[ok(first)]))
    assert late.accepted == [] and "stale" in late.dropped[first.attempt_id]
    assert sched.work.calls.results(n2, ResultBatch(results=[ok(second)])).accepted == [second.attempt_id]
    assert len(sched.work.feed.trajectories("math-demo")) == 1


def test_heartbeat_extends_leases(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1)
    node = reg(sched)
    [l] = lease(sched, node, 1)
    for _ in range(5):
        clock.t += 6
        sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
        assert sched.work.attempts.expire() == 0
    assert asyncio.run(sched.progress(job)).counts.run == 1


def test_a_lease_the_daemon_never_received_expires_although_the_node_beats(tmp_path, store_location):
    """The controller commits a lease and dies before its answer reaches the daemon: the daemon
    keeps beating without it. That lease must go back to the queue when its deadline passes
    (before, every lease of a beating node was extended, and the job never completed)."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=2)
    node = reg(sched)
    got, lost = lease(sched, node, 2)
    for _ in range(3):
        clock.t += 6  # leaseSeconds is 10
        sched.work.calls.heartbeat(node, Heartbeat(stages={got.attempt_id: "run"}))
    assert sched.work.attempts.expire() == 1
    again = lease(sched, node, 5)
    assert [(l.prompt, l.sample) for l in again] == [(lost.prompt, lost.sample)]
    assert again[0].attempt_id != lost.attempt_id
    ack = sched.work.calls.results(node, ResultBatch(results=[ok(got), ok(again[0])]))
    assert len(ack.accepted) == 2 and asyncio.run(sched.progress(job)).done


def test_infra_failure_is_retried_then_delivered_without_reward(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1, max_attempts=2)
    node = reg(sched)
    [a1] = lease(sched, node, 1)
    sched.work.calls.results(node, ResultBatch(results=[infra(a1)]))
    assert sched.work.feed.trajectories("math-demo") == []  # retried, not delivered
    [a2] = lease(sched, node, 1)
    assert a2.attempt == 2
    sched.work.calls.results(node, ResultBatch(results=[infra(a2)]))
    [(_, data)] = sched.work.feed.trajectories("math-demo")
    t = json.loads(data)
    assert t["failure"]["kind"] == "infra" and t["reward"] is None
    prog = asyncio.run(sched.progress(job))
    assert prog.done and prog.counts.failed == 1 and prog.counts.succeeded == 0


def test_give_back_requeues_without_using_an_attempt(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=2)
    node = reg(sched)
    leases = lease(sched, node, 2)
    assert sched.work.attempts.give_back(node, [l.attempt_id for l in leases], "SIGTERM") == 2
    sched.work.registry.deregister(node)  # what a SIGTERMed daemon does next (else n2's fair share would be 1 of 2)
    again = lease(sched, reg(sched, "n2"), 2)
    assert [l.attempt for l in again] == [1, 1]


def test_min_heap_balances_inflight_within_one_and_releases_on_leaving_run(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=10, samples=2, backends=("http://a", "http://b", "http://c"))
    node = reg(sched)
    live = []
    for step in range(10):
        live += lease(sched, node, 2)
        counts = [sched.work.pool.inflight[u] for u in ("http://a", "http://b", "http://c")]
        assert max(counts) - min(counts) <= 1, counts
        if step % 3 == 2:  # some tasks leave RUN: their backend slot is freed at once
            done, live = live[:3], live[3:]
            sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "eval" for l in done},
                                            left_run=[l.attempt_id for l in done]))
    assert sum(sched.work.pool.inflight.values()) == len(live)


def test_unhealthy_backend_gets_no_new_tasks_and_unstarted_ones_are_repinned(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=2)
    node = reg(sched)
    leases = lease(sched, node, 4)
    on_a = [l for l in leases if l.backend == "http://a"]
    assert len(on_a) == 2
    sched.work.pool.set_health("http://a", False, "connection refused")
    resp = sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "init" for l in on_a}))
    assert set(resp.repin) == {l.attempt_id for l in on_a}
    assert set(resp.repin.values()) == {"http://b"}
    assert sched.work.pool.inflight["http://b"] == 4 and sched.work.pool.inflight["http://a"] == 0


def test_a_slow_health_answer_is_busy_a_refused_connection_is_down(tmp_path, store_location):
    """Real sockets: one backend accepts connections but never answers (a vLLM API server stalled
    while streaming), one refuses them (dead). Only the dead one is unhealthy at once; the silent
    one is declared unhealthy after `slow_grace` seconds of silence."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshakes; nobody ever reads the requests
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    busy, dead = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (silent, closed))
    try:
        store, sched, clock, job = make(tmp_path, store_location, backends=(busy, dead))
        reg(sched)  # the job's backends join the pool
        sched.work.health.timeout, sched.work.health.slow_grace = 0.2, 10.0

        async def go():
            await background.check_health(sched.work)
            first = (sched.work.pool.healthy(busy), sched.work.pool.healthy(dead))
            clock.t += 11.0
            await background.check_health(sched.work)
            return first

        assert asyncio.run(go()) == (True, False)
        assert not sched.work.pool.healthy(busy) and "unanswered for 11s" in sched.work.pool.unhealthy[busy]
        assert "connection failed" in sched.work.pool.unhealthy[dead]  # a fixed reason, never the error text
    finally:
        silent.close()
        closed.close()


def test_a_daemon_of_another_protocol_is_refused_with_a_clear_reason(tmp_path, store_location):
    from rolloutd.controller.errors import BadRequest

    store, sched, clock, job = make(tmp_path, store_location)
    for protocol in (None, NODE_PROTOCOL + 1):  # a daemon from before the check; a newer one
        with pytest.raises(BadRequest, match="no newer than the controller"):
            sched.work.registry.register(RegisterRequest(job="math-demo", protocol=protocol, name="old"))
    assert sched.work.registry.nodes("math-demo") == []


def test_removed_backend_repins_tasks_not_yet_running(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1)
    node = reg(sched)
    l1, l2 = lease(sched, node, 2)
    job = store.get("math-demo")
    job.spec.llm.backends = [b for b in job.spec.llm.backends if b.url != l1.backend]
    store.apply(job)
    resp = sched.work.calls.heartbeat(node, Heartbeat(stages={l1.attempt_id: "leased", l2.attempt_id: "run"}))
    assert resp.repin == {l1.attempt_id: l2.backend}  # the running one keeps its backend


def test_deleting_a_job_cancels_live_attempts(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=2)
    node = reg(sched)
    a, b = lease(sched, node, 2)
    asyncio.run(sched.forget(job))
    resp = sched.work.calls.heartbeat(node, Heartbeat(stages={a.attempt_id: "run", b.attempt_id: "init"}))
    assert sorted(resp.cancel) == sorted([a.attempt_id, b.attempt_id])
    assert sched.work.calls.results(node, ResultBatch(results=[ok(a)])).dropped[a.attempt_id] == "cancelled"
    assert sum(sched.work.pool.inflight.values()) == 0


def test_restart_restores_backend_pins(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1)
    node = reg(sched)
    lease(sched, node, 2)
    again = Scheduler(build_work(store))
    assert again.work.pool.inflight["http://a"] == 1 and again.work.pool.inflight["http://b"] == 1


def test_bad_dataset_fails_the_job_with_its_message(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location)
    doc = job.wire()
    doc["metadata"] = {"name": "broken"}
    doc["spec"]["tasks"]["source"] = str(tmp_path / "missing.jsonl")
    store.apply(RolloutJob.model_validate(doc))
    asyncio.run(sched.admit(store.get("broken")))  # the reconcile's step; progress only reads
    prog = asyncio.run(sched.progress(store.get("broken")))
    assert prog.failed and "not found" in prog.failed


def test_pool_skips_stale_entries_and_respects_allowed():
    pool = BackendPool()
    for u in ("x", "y"):
        pool.add(u)
    assert pool.acquire({"y"}) == "y"
    assert pool.acquire({"x", "y"}) == "x"
    assert pool.acquire({"x", "y"}) in ("x", "y")
    pool.set_health("x", False)
    assert pool.acquire({"x"}) is None
    pool.set_health("x", True)
    assert pool.acquire({"x"}) == "x"
    assert pool.acquire({"z"}) == "z"  # a backend a job lists is added on first use


def test_a_config_failure_fails_the_job_unscored_and_cancels_the_rest(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location)
    node = reg(sched)
    leases = lease(sched, node, 100)
    why = "spec.agent.sampling.maxTotalTokens: the prompt of task q0 has 1017 tokens, more than 512"
    bad = Result(attempt_id=leases[0].attempt_id, trajectory=Trajectory(
        job="x", prompt=0, sample=0, failure=Failure(kind="config", reason=why)))
    assert sched.work.calls.results(node, ResultBatch(results=[bad])).accepted == [leases[0].attempt_id]
    progress = asyncio.run(sched.progress(store.get("math-demo")))
    assert progress.failed == why and not progress.done
    [row] = [json.loads(d) for _, d in sched.work.feed.trajectories("math-demo")]
    assert row["reward"] is None and row["failure"] == {"kind": "config", "reason": why}
    # the other rollouts would fail the same way: cancelled on the daemon at its next beat, not scored
    beat = sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run" for l in leases[1:]}))
    assert sorted(beat.cancel) == sorted(l.attempt_id for l in leases[1:])
    late = sched.work.calls.results(node, ResultBatch(results=[ok(leases[1])]))
    assert late.dropped == {leases[1].attempt_id: "cancelled"} and len(sched.work.feed.trajectories("math-demo")) == 1
    assert lease(sched, reg(sched, "n2"), 10) == []


def test_a_failure_during_an_outage_of_every_backend_uses_no_attempt(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1, backends=("http://a",), max_attempts=1)
    node = reg(sched)
    [first] = lease(sched, node, 1)
    sched.work.pool.set_health("http://a", False, "connection refused")
    ack = sched.work.calls.results(node, ResultBatch(results=[infra(first)]))
    assert ack.accepted == [first.attempt_id]
    assert sched.work.feed.trajectories("math-demo") == []  # not given up although maxAttempts is 1
    assert lease(sched, node, 1) == []  # leasing pauses while no backend is healthy
    sched.work.pool.set_health("http://a", True)
    [again] = lease(sched, node, 1)
    assert again.attempt == 1 and again.backend == "http://a"
    # with a healthy backend the same failure is the rollout's: its one attempt is used up
    sched.work.calls.results(node, ResultBatch(results=[infra(again)]))
    [row] = [json.loads(d) for _, d in sched.work.feed.trajectories("math-demo")]
    assert row["failure"]["kind"] == "infra" and row["reward"] is None


def test_queued_work_is_divided_among_the_job_s_nodes_by_fair_share(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=3, samples=2, nodes=3)
    first = reg(sched, "n1")
    got = {first: lease(sched, first, 100)}
    assert len(got[first]) == 2  # 6 items, 3 nodes: the first daemon up does not take them all
    assert lease(sched, first, 100) == []
    for name in ("n2", "n3"):
        node = reg(sched, name)
        got[node] = lease(sched, node, 100)
    assert [len(v) for v in got.values()] == [2, 2, 2]
    leased = [(l.prompt, l.sample) for v in got.values() for l in v]
    assert sorted(leased) == [(p, k) for p in range(3) for k in range(2)]
    # a node that gives its share back (SIGTERM) leaves it to the others
    sched.work.attempts.give_back(first, [l.attempt_id for l in got[first]], "SIGTERM")
    sched.work.registry.deregister(first)
    second = list(got)[1]
    assert lease(sched, second, 100) == []  # 6 live over the 3 nodes the job asked for: it holds its 2
    sched.work.calls.results(second, ResultBatch(results=[ok(l) for l in got[second]]))
    assert len(lease(sched, second, 100)) == 2  # 4 live: ceil(4 / 3) = 2, so the queue never stalls


def test_a_long_queue_leaves_every_node_its_free_slots_and_a_short_one_caps_them(tmp_path, store_location):
    """The fair share is only counted as far as it matters: with a queue long enough for every
    node, a lease gets all it asks; once it is short, the count is exact and caps the lease."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=20, samples=2, nodes=2)  # 40 items
    node = reg(sched, "n1")
    assert len(lease(sched, node, 4)) == 4  # 40 live over 2 nodes: 20 each, far more than 4
    assert len(lease(sched, node, 100)) == 16  # ceil(40 / 2) = 20, minus the 4 it holds
    assert lease(sched, node, 100) == []


def test_the_share_reads_only_the_queue_as_far_as_it_needs(tmp_path, store_location, monkeypatch):
    """The leases held are live items the controller knows without a read: the share counts only the queued ones,
    and only as many as it needs. At 1000 nodes × 64 slots a node's share needs ~63 000 live items, and counting
    them on every lease took ~6 ms (the whole controller's time at a thousand leases a second)."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=20, samples=2, nodes=2)  # 40 items
    node = reg(sched, "n1")
    queue = sched.work.attempts.queue
    monkeypatch.setattr(queue, "count_live", lambda *a: pytest.fail("counted the live items"))
    reads, count_queued = [], queue.count_queued
    monkeypatch.setattr(queue, "count_queued", lambda db, job, at_most: reads.append(at_most) or count_queued(db, job, at_most))
    assert len(lease(sched, node, 4)) == 4  # share: 7 live items give a share of 4; 40 queued
    assert len(lease(sched, node, 100)) == 16  # 4 held here + 36 queued = 40 live: ceil(40 / 2) = 20, minus 4
    assert lease(sched, node, 100) == []  # 20 held + 20 queued: its 20
    assert reads == [7, 2 * (100 + 4 - 1) + 1 - 4, 2 * (100 + 20 - 1) + 1 - 20]


def test_the_queue_s_last_count_less_what_was_granted_stands_for_a_second(tmp_path, store_location, monkeypatch):
    """A thousand nodes leasing at once count the queue once a second, not once each: the count, less what was
    granted since, still shows the share is not binding. Once it does not (the queue ran short), or a second has
    passed, the queue is counted again, and the share comes out as exact as before."""
    from rolloutd.controller.work.node_share import QUEUE_SECONDS
    store, sched, clock, job = make(tmp_path, store_location, prompts=20, samples=2, nodes=4)  # 40 items
    nodes = [reg(sched, f"n{i}") for i in range(4)]
    queue = sched.work.attempts.queue
    reads, count_queued = [], queue.count_queued
    monkeypatch.setattr(queue, "count_queued", lambda db, job, at_most: reads.append(at_most) or count_queued(db, job, at_most))
    assert len(lease(sched, nodes[0], 4)) == 4  # needs 13 live items: 40 queued, counted up to 13
    assert len(lease(sched, nodes[1], 4)) == 4  # needs 13, 4 held here: 9 more; the count less 4 granted shows 9
    assert reads == [13]
    clock.t += QUEUE_SECONDS
    assert len(lease(sched, nodes[2], 4)) == 4  # a second later: counted again
    assert reads == [13, 5]
    assert len(lease(sched, nodes[3], 100)) == 10  # needs more than the count showed: counted whole, 28 queued:
    assert reads == [13, 5, 4 * 99 + 1 - 12]       # ceil(40 / 4) = 10
    assert len(lease(sched, nodes[0], 100)) == 6  # 22 held + 18 queued = 40 live: its 10 minus the 4 it holds


def test_a_slow_event_loop_does_not_make_a_healthy_backend_look_down(tmp_path, store_location):
    """The controller's loop stuck for a second (a thousand nodes' calls queued) while a probe waits: the
    backend answered at once, so it stays healthy even with no grace for slowness at all."""
    import http.server
    import threading
    import time

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        store, sched, clock, job = make(tmp_path, store_location, backends=(url,))
        reg(sched)
        sched.work.health.timeout, sched.work.health.slow_grace = 0.2, 0.0  # a timeout would mark it down at once

        async def go():
            probe = asyncio.create_task(background.check_health(sched.work))
            await asyncio.sleep(0.02)  # the probe is on its way
            time.sleep(1.0)  # the loop does not come back for a second
            await probe

        asyncio.run(go())
        assert sched.work.pool.healthy(url), sched.work.pool.unhealthy
    finally:
        sched.stop()
        server.shutdown()
        server.server_close()


def test_a_node_silent_for_long_is_retired_and_one_that_calls_is_kept(tmp_path, store_location):
    from rolloutd.controller.errors import NotFound
    from rolloutd.controller.work.node_registry import NODE_SILENCE_SECONDS

    store, sched, clock, job = make(tmp_path, store_location)
    quiet, talking = reg(sched, "quiet"), reg(sched, "talking")
    clock.t += NODE_SILENCE_SECONDS + 1
    sched.work.calls.heartbeat(talking, Heartbeat())
    sched.work.attempts.expire()
    assert [(n.id, n.state) for n in sched.work.registry.nodes("math-demo")] == [(talking, "active")]  # `nodes` omits the gone
    with pytest.raises(NotFound):
        sched.work.calls.heartbeat(quiet, Heartbeat())


def test_each_lease_carries_its_own_prompts_task_in_queue_order(tmp_path, store_location):
    """The grant's queued rows and their tasks (on PostgreSQL read in one statement, each task on its prompt's first
    row only): every lease, whichever of its prompt's samples, carries that prompt's task, in the queue's order."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=3, samples=3)
    node = reg(sched)
    leases = sched.work.attempts.lease_now(node, 7).leases
    assert [(l.prompt, l.sample) for l in leases] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert [l.task["question"] for l in leases] == [f"{l.prompt}+1?" for l in leases]
    rest = sched.work.attempts.lease_now(node, 7).leases  # the second sample onwards of a prompt begun before
    assert [(l.prompt, l.sample, l.task["question"]) for l in rest] == [(2, 1, "2+1?"), (2, 2, "2+1?")]


def test_a_grant_whose_call_failed_before_its_commit_gives_its_backend_slot_back_at_once(tmp_path, store_location):
    """A lease granted in memory (its backend slot taken, its lease held) whose call then failed before the commit
    (a later statement of it, or its group rolled back): the database never leased it and the node was answered an
    error. Its slots come back at once, not at the leases' deadline, and the items are leased again."""
    from rolloutd.controller.work import hot_sql

    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1)
    node = reg(sched)
    work = sched.work

    def granted_then_failed(tx):
        assert len(work.attempts.lease_now(node, 2, tx).leases) == 2
        raise RuntimeError("a later statement failed")

    with pytest.raises(RuntimeError):
        hot_sql.run_alone(work.store.engine, lambda tx: (granted_then_failed(tx), None))
    assert sum(work.pool.inflight.values()) == 0 and not work.attempts.held.by_attempt
    assert len(lease(sched, node, 2)) == 2  # both items are leased again


def test_a_grant_whose_commit_failed_gives_its_backend_slot_back_when_it_expires(tmp_path, store_location):
    """A lease granted in memory whose commit failed: it may have committed all the same (the server's answer lost),
    so memory keeps it until its deadline, when the expiry asks the database: never leased there (this commit was
    refused), it is forgotten and its slot must come back with it: each failed commit otherwise cost the backend one
    slot for good, until the job's cap refused every lease."""
    from sqlalchemy import event

    from rolloutd.controller.work import hot_sql

    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1)
    node = reg(sched)
    work = sched.work

    def commit_fails(conn):
        raise RuntimeError("the commit failed")

    event.listen(work.store.engine, "commit", commit_fails)
    try:
        with pytest.raises(RuntimeError):
            hot_sql.run_alone(work.store.engine, lambda tx: (work.attempts.lease_now(node, 2, tx), None))
    finally:
        event.remove(work.store.engine, "commit", commit_fails)
    assert sum(work.pool.inflight.values()) == 2  # in memory until the leases' deadline
    clock.t += 11
    assert work.attempts.expire() == 0  # nothing was leased in the database: nothing to requeue
    assert sum(work.pool.inflight.values()) == 0
    assert not any(work.pool.admission.admitted.get(u, {}).get("math-demo") for u in ("http://a", "http://b"))
    assert len(lease(sched, node, 2)) == 2  # both items are leased again


def test_a_result_whose_transaction_rolled_back_and_came_again_frees_its_backend_slot_once(tmp_path, store_location):
    """A node's results applied in a transaction that then rolled back (its group's commit failed): the node is
    answered an error and sends them again. The backend slot its attempt held is freed once, not once per try: a
    second release took the slot of another rollout still running there (the backend then admitted one too many)."""
    from rolloutd.controller.work import hot_sql

    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=1, backends=("http://a",))
    node = reg(sched)
    work = sched.work
    first, second = lease(sched, node, 2)
    assert work.pool.inflight["http://a"] == 2

    def applied_then_failed(tx):
        ack, _ = work.attempts.results(tx, node, ResultBatch(results=[ok(first)]), store.get("math-demo"))
        assert ack.accepted == [first.attempt_id]
        raise RuntimeError("the commit failed")

    with pytest.raises(RuntimeError):
        hot_sql.run_alone(work.store.engine, lambda tx: (applied_then_failed(tx), None))
    assert work.calls.results(node, ResultBatch(results=[ok(first)])).accepted == [first.attempt_id]
    assert work.pool.inflight["http://a"] == 1  # the second rollout still runs there
    assert work.pool.admission.admitted["http://a"]["math-demo"] == 1
    assert work.calls.results(node, ResultBatch(results=[ok(second)])).accepted == [second.attempt_id]
    assert work.pool.inflight["http://a"] == 0 and len(work.feed.trajectories("math-demo")) == 2
