"""Lease renewals live in memory (`controller/work/renewals.py`): a beat writes no deadline, the expiry pass
writes a renewal down once half the stored lease is used, and a restarted controller still gives a beating
node's leases at least half a lease — what the stored deadlines gave before renewals moved to memory."""
from __future__ import annotations

from rolloutd.controller.work.renewals import Renewals, sort_out
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import Heartbeat, ResultBatch

from .test_scheduler import lease, make, ok, reg


def stored_deadline(sched, attempt_id):
    with sched.engine.connect() as c:
        return c.exec_driver_sql("SELECT deadline FROM items WHERE attempt_id = ?", (attempt_id,)).scalar_one()


def test_a_beat_renews_in_memory_and_the_pass_writes_it_down_once_half_is_used(tmp_path):
    store, sched, clock, job = make(tmp_path, prompts=1, samples=1)  # leaseSeconds 10
    node = reg(sched)
    [l] = lease(sched, node, 1)
    granted = stored_deadline(sched, l.attempt_id)
    assert granted == clock.t + 10
    clock.t += 2
    sched.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
    assert stored_deadline(sched, l.attempt_id) == granted  # the beat wrote nothing
    assert sched.expire() == 0
    assert stored_deadline(sched, l.attempt_id) == granted  # 8 s of 10 left: more than half, not written
    clock.t += 4
    sched.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
    assert sched.expire() == 0
    assert stored_deadline(sched, l.attempt_id) == clock.t + 10  # 4 s left < half: the renewal is written


def test_a_restarted_controller_keeps_a_beating_node_s_leases_for_half_a_lease(tmp_path):
    store, sched, clock, job = make(tmp_path, prompts=1, samples=1)
    node = reg(sched)
    [l] = lease(sched, node, 1)
    for _ in range(4):  # beats every 3 s, the expiry pass between them, as the background loop runs it
        clock.t += 3
        sched.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
        assert sched.expire() == 0
    assert stored_deadline(sched, l.attempt_id) >= clock.t + 5
    again = Scheduler(store, clock=clock)  # a restart: no renewals in memory
    clock.t += 4
    assert again.expire() == 0
    again.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
    assert again.results(node, ResultBatch(results=[ok(l)])).accepted == [l.attempt_id]


def test_an_ended_attempt_forgets_its_renewal(tmp_path):
    store, sched, clock, job = make(tmp_path, prompts=1, samples=1)
    node = reg(sched)
    [l] = lease(sched, node, 1)
    sched.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
    assert sched.queue.renewals.until(l.attempt_id) == clock.t + 10
    sched.results(node, ResultBatch(results=[ok(l)]))
    assert sched.queue.renewals.until(l.attempt_id) is None and len(sched.queue.renewals) == 0


def test_sort_out_persists_renewed_leases_past_half_and_expires_the_unrenewed():
    r = Renewals()
    r.renew("live", 130.0)
    r.renew("lapsed", 95.0)  # renewed once, then the node went silent
    rows = [(1, "live", 104.0, 15.0),     # renewed, half used: written down
            (2, "young", 125.0, 15.0),    # never named yet, not expired
            (3, "dead", 99.0, 15.0),      # never renewed, past its deadline
            (4, "lapsed", 90.0, 15.0),    # its last renewal ran out too
            (5, "live", 120.0, 15.0)]     # (another row of the same attempt id, more than half left: kept)
    persist, dead = sort_out(rows, r, now=100.0)
    assert persist == [(130.0, 1)] and dead == [3, 4]
    assert r.prune(before=100.0) == 1 and r.until("lapsed") is None and r.until("live") == 130.0
