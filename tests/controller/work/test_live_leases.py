"""The leases held now live in memory (`controller/work/held_leases.py`): a beat reads and renews them there (no
deadline written), every way out of `leased` forgets them, and a restarted controller loads them back from
the database and gives each a whole lease."""
from __future__ import annotations

import asyncio

from rolloutd.controller.work.held_leases import HeldLease, HeldLeases
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import Heartbeat, ResultBatch

from rolloutd.controller.dialects import is_pg, raw

from .test_scheduler import lease, make, ok, reg


def stored(sched, attempt_id, column="deadline"):
    with sched.work.store.engine.connect() as c:
        return raw(c).execute(f"SELECT {column} FROM items WHERE attempt_id = ?", (attempt_id,)).fetchone()[0]


def written(c) -> object:
    """A mark that moves when another connection commits a change: SQLite's data_version; on PostgreSQL the items'
    row versions (xmin: an UPDATE makes a new one)."""
    if is_pg(c):
        return c.exec_driver_sql("SELECT string_agg(xmin::text, ',' ORDER BY id) FROM items").scalar_one()
    return c.exec_driver_sql("PRAGMA data_version").scalar_one()


class Recording:
    """A plain-statement connection whose statements' texts are kept (either store's)."""

    def __init__(self, db, texts: list[str]):
        self.db, self.texts = db, texts

    def execute(self, sql, *args):
        self.texts.append(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql, rows):
        self.texts.append(sql)
        return self.db.executemany(sql, rows)


def test_a_beat_renews_and_moves_stages_in_memory_and_writes_nothing(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1)  # leaseSeconds 10
    node = reg(sched)
    [l] = lease(sched, node, 1)
    granted = stored(sched, l.attempt_id)
    assert granted == clock.t + 10 and sched.work.queue.leases.get(l.attempt_id).until == granted
    clock.t += 6
    with sched.work.store.engine.connect() as c:
        before = written(c)
        c.rollback()  # PostgreSQL: a new snapshot for the next read
        sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run"}))
        assert written(c) == before  # the beat wrote nothing
    assert stored(sched, l.attempt_id) == granted  # the beat wrote no deadline
    assert stored(sched, l.attempt_id, "stage") == "leased"  # nor the stage: that is in memory
    assert sched.work.queue.leases.get(l.attempt_id).stage == "run"
    assert sched.work.queue.leases.stages(job.metadata.key) == {"run": 1}
    counts = asyncio.run(sched.progress(job)).counts  # progress counts the stage from memory
    assert (counts.queued, counts.run) == (0, 1)
    assert sched.work.queue.leases.get(l.attempt_id).until == clock.t + 10
    clock.t += 6  # past the stored deadline, within the renewed one
    assert sched.work.attempts.expire() == 0
    clock.t += 5
    assert sched.work.attempts.expire() == 1  # no beat since: back to the queue


def test_a_restarted_controller_gives_the_leases_it_finds_a_whole_lease(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=2)
    node = reg(sched)
    kept, silent = lease(sched, node, 2)
    clock.t += 9  # both stored deadlines are 1 s ahead
    again = Scheduler(build_work(store, clock=clock))  # a restart
    assert len(again.work.queue.leases) == 2
    clock.t += 6
    assert again.work.attempts.expire() == 0  # a whole lease from the restart
    again.work.calls.heartbeat(node, Heartbeat(stages={kept.attempt_id: "run"}))
    clock.t += 6
    assert again.work.attempts.expire() == 1  # the one no beat named since the restart
    assert again.work.calls.results(node, ResultBatch(results=[ok(kept)])).accepted == [kept.attempt_id]


def test_every_way_out_of_leased_forgets_the_lease(tmp_path, store_location):
    store, sched, clock, job = make(tmp_path, store_location, prompts=2, samples=2, nodes=1)
    node = reg(sched)
    done, back, cancelled, _ = lease(sched, node, 4)
    sched.work.calls.results(node, ResultBatch(results=[ok(done)]))
    sched.work.attempts.give_back(node, [back.attempt_id], "not started")
    assert sched.work.queue.leases.get(done.attempt_id) is None and sched.work.queue.leases.get(back.attempt_id) is None
    asyncio.run(sched.forget(job))  # the job is deleted: its live items are cancelled
    assert len(sched.work.queue.leases) == 0
    reply = sched.work.calls.heartbeat(node, Heartbeat(stages={cancelled.attempt_id: "run"}))
    assert reply.cancel == [cancelled.attempt_id] and reply.unknown == []


def test_a_lease_held_in_memory_but_not_in_the_database_is_forgotten_not_requeued(tmp_path, store_location):
    """A grant whose transaction did not commit leaves a lease in memory only: the expiry pass drops it and
    leaves the item as the database has it."""
    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1)
    reg(sched)
    sched.work.queue.leases.add("1.1.abcdef", HeldLease(1, "math-demo", "n1-x", "leased", None, False, clock.t - 1))
    assert sched.work.attempts.expire() == 0 and len(sched.work.queue.leases) == 0
    with sched.work.store.engine.connect() as c:
        assert tuple(c.exec_driver_sql("SELECT state, attempt FROM items WHERE id = 1").one()) == ("queued", 0)


def test_a_result_writes_back_only_the_columns_it_changed(tmp_path, store_location):
    """SQLite rewrites every index of a column an UPDATE sets, changed or not: `hot_sql.save` sets only what
    changed (a finished attempt keeps its attempt and node ids, whose indexes are then left alone)."""
    from rolloutd.controller.work import hot_sql

    store, sched, clock, job = make(tmp_path, store_location, prompts=1, samples=1)
    node = reg(sched)
    [l] = lease(sched, node, 1)
    with hot_sql.transaction(sched.work.store.engine) as tx:
        statements: list[str] = []
        db = Recording(tx.db, statements)
        item = hot_sql.items_by_attempt(db, [l.attempt_id])[l.attempt_id]
        sched.work.queue.finish(item, "done")
        hot_sql.save(db, [item])
    [update] = [s for s in statements if s.startswith("UPDATE")]
    assert "state = " in update and "attempt_id" not in update and "node_id" not in update, update
    assert stored(sched, l.attempt_id, "state") == "done"


def test_the_expiry_pass_finds_what_ran_out_by_the_second_it_runs_out():
    """Leases are filed by the second their `until` falls in: renewing one moves it, forgetting one removes it,
    and `expired` names exactly those past their `until` (also within the current second)."""
    live = HeldLeases()
    for i, until in enumerate((100.2, 100.7, 101.5, 130.0)):
        live.add(f"a{i}", HeldLease(i, "j", "n", "leased", None, False, until))
    assert [aid for aid, _ in live.expired(100.5)] == ["a0"]
    assert sorted(aid for aid, _ in live.expired(102.0)) == ["a0", "a1", "a2"]
    live.renew("a1", live.get("a1"), 140.0)
    live.forget("a2")
    assert [aid for aid, _ in live.expired(102.0)] == ["a0"]
    assert sorted(aid for aid, _ in live.expired(141.0)) == ["a0", "a1", "a3"]
    live.forget("a0"), live.forget("a1"), live.forget("a3"), live.forget("a3")
    assert live.expired(1e9) == [] and not live._due and len(live) == 0


def test_stage_and_node_counts_follow_every_lease_in_and_out():
    live = HeldLeases()
    live.add("a", HeldLease(1, "j", "n", "leased", None, False, 10.0))
    live.add("b", HeldLease(2, "j", "n", "leased", None, False, 10.0))
    live.add("c", HeldLease(3, "k", "m", "leased", None, False, 10.0))
    assert (live.held("n"), live.held("m"), live.held("o")) == (2, 1, 0)
    live.set_stage(live.get("a"), "run", 0.0)
    live.set_stage(live.get("b"), "init", 0.0)
    live.set_stage(live.get("b"), "run", 0.0)
    assert live.stages("j") == {"run": 2} and live.stages("k") == {"leased": 1}
    live.forget("a"), live.forget("c")
    assert live.stages("j") == {"run": 1} and live.stages("k") == {}
    assert (live.held("n"), live.held("m")) == (1, 0)
