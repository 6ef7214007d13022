"""The leader lease and its fence on the store (controller/ha/leadership.py): one leader at a time, a lease that runs
out is taken with a higher epoch, and the old leader's commits after that are refused inside their transaction.

Two `Leadership`s stand for two replicas: each its own engine on one database, as two processes have; once on an
SQLite file, once on the session's PostgreSQL server (`store_location`, tests/conftest.py)."""
from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, text
from sqlmodel import Session

from rolloutd.controller import dialects
from rolloutd.controller.ha.leadership import Fenced, Leadership, current
from rolloutd.controller.store import Store


@pytest.fixture
def engines(store_location):
    Store(store_location).engine.dispose()  # the lease row is the store's schema (`store/replica_tables.py`)
    if dialects.is_url(store_location):
        made = [create_engine(dialects.engine_url(store_location)) for _ in range(2)]
    else:
        made = [create_engine(f"sqlite:///{store_location}", connect_args={"timeout": 30}) for _ in range(2)]
    with made[0].begin() as c:
        c.exec_driver_sql("CREATE TABLE work (x INTEGER)")
    yield made
    for e in made:
        e.dispose()


def _rows(engine) -> list[int]:
    with engine.connect() as c:
        return [r[0] for r in c.exec_driver_sql("SELECT x FROM work ORDER BY x")]


def test_one_leader_then_the_next_epoch_after_the_lease_runs_out(engines):
    a = Leadership(engines[0], "http://a", lease_seconds=0.3, holder="a")
    b = Leadership(engines[1], "http://b", lease_seconds=0.3, holder="b")
    a.epoch = a.try_take()
    assert a.epoch == 1
    assert b.try_take() is None  # a holds it
    assert a.renew()
    time.sleep(0.4)  # a is paused: no renewal
    b.epoch = b.try_take()
    assert b.epoch == 2 and current(engines[1])[:2] == ("b", 2) and current(engines[1])[3] == "http://b"
    assert not a.renew()  # a wakes: its renewal finds the row taken


def test_the_old_leaders_commit_is_refused_and_it_steps_down(engines):
    a = Leadership(engines[0], "http://a", lease_seconds=0.3, holder="a")
    b = Leadership(engines[1], "http://b", lease_seconds=0.3, holder="b")
    lost: list[str] = []
    a.on_lost = lost.append
    a.epoch = a.try_take()
    a.fence(engines[0])  # the leader's store (a replica's lease has an engine of its own: one here, for brevity)
    with engines[0].begin() as c:
        c.exec_driver_sql("INSERT INTO work VALUES (1)")  # the leader's write: committed
    time.sleep(0.4)
    b.epoch = b.try_take()
    assert b.epoch == 2
    with pytest.raises(Fenced):
        with engines[0].begin() as c:  # a woke up and writes before its renewal notices
            c.exec_driver_sql("INSERT INTO work VALUES (2)")
    with pytest.raises(Fenced):  # and through the ORM's session the same
        with Session(engines[0]) as s:
            s.exec(text("INSERT INTO work VALUES (4)"))
            s.commit()
    assert _rows(engines[1]) == [1]  # nothing of the fenced transaction
    assert lost and "fenced" in lost[0]
    with engines[1].begin() as c:  # the new leader's engine is not fenced by a's epoch
        c.exec_driver_sql("INSERT INTO work VALUES (3)")
    assert _rows(engines[0]) == [1, 3]


def test_renewals_keep_the_lease_and_a_graceful_stop_hands_it_over_at_once(engines):
    a = Leadership(engines[0], "http://a", lease_seconds=1.0, renew_seconds=0.1, holder="a")
    b = Leadership(engines[1], "http://b", lease_seconds=1.0, renew_seconds=0.1, holder="b")
    elected: list[int] = []
    a.on_elected = elected.append
    a.start()
    deadline = time.monotonic() + 10
    while not elected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert elected == [1]
    time.sleep(1.5)  # longer than the lease: renewals kept it
    assert b.try_take() is None
    a.stop()
    a.resign()
    assert b.try_take() == 2


@pytest.fixture
def paused_pair(pg_server):
    """Two replicas' `Leadership` on the real server, `a` leading (epoch 1) on its own sessions (named, as a
    process's are), `b` on statements bounded to 10 s (a wait on a lock fails the test rather than hang it); the
    `work` table holds one row."""
    location = pg_server.create_database()
    Store(location).engine.dispose()
    a_engine = create_engine(dialects.engine_url(location), connect_args={"application_name": "rolloutd-test-a"})
    b_engine = create_engine(dialects.engine_url(location), connect_args={"options": "-c statement_timeout=10s"})
    with b_engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE work (x INTEGER)")
        c.exec_driver_sql("INSERT INTO work VALUES (1)")
    a = Leadership(a_engine, "http://a", holder="a", session="rolloutd-test-a")
    assert a.try_take() == 1
    yield a, Leadership(b_engine, "http://b", holder="b")
    a_engine.dispose()
    b_engine.dispose()


def _runs_out(engine) -> None:
    with engine.begin() as c:  # the lease runs out (its holder's renewals stopped with it)
        c.exec_driver_sql("UPDATE leader_lease SET expires = 0")


def test_a_lease_that_ran_out_with_its_holder_paused_in_a_transaction_is_taken_not_waited_for(paused_pair):
    """On the real server: the leader paused between its fence's read (`FOR SHARE` on the row) and its commit, past
    its lease. The follower's try ends the holder's database sessions instead of waiting on the row; the next try
    takes the lease, and the paused leader's transaction is gone: what it was about to commit is not committed."""
    a, b = paused_pair
    _runs_out(b.engine)
    paused = a.engine.connect()
    paused.begin()
    paused.exec_driver_sql("UPDATE work SET x = 10")
    paused.exec_driver_sql("SELECT epoch FROM leader_lease WHERE id = 1 FOR SHARE")  # the fence's read
    assert b.try_take() is None  # the row locked: a's sessions ended, not waited for
    assert b.try_take() == 2
    assert current(b.engine)[0] == "b"
    with pytest.raises(Exception, match="terminat|closed"):  # a resumes: its session is gone
        paused.commit()
    assert _rows(b.engine) == [1]


def test_a_paused_old_leaders_locks_do_not_hold_the_new_leaders_writes(paused_pair):
    """On the real server: the leader paused with a row of its work locked (an update not committed), past its
    lease. The follower takes the lease at once (the lease row is not locked) and ends the old leader's sessions:
    the new leader's write of that row goes through, and the old leader's update is never committed."""
    a, b = paused_pair
    paused = a.engine.connect()
    paused.begin()
    paused.exec_driver_sql("UPDATE work SET x = 10")  # its row lock held while it is paused
    _runs_out(b.engine)
    assert b.try_take() == 2
    with b.engine.begin() as c:
        c.exec_driver_sql("UPDATE work SET x = x + 1")
    assert _rows(b.engine) == [2]
    with pytest.raises(Exception, match="terminat|closed"):
        paused.commit()
    assert _rows(b.engine) == [2]
