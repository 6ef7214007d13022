"""Node calls' transactions committed together (`controller/work/group_commit.GroupCommit`): the calls submitted in one
turn of the event loop share one transaction and one commit; a call that fails is rolled back alone and gets
its own error; each caller is answered only after the commit, and the after-commit steps run after it."""
from __future__ import annotations

import asyncio
import time

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.work import node_calls
from rolloutd.controller.work.group_commit import PG_GROUP_CALLS, GroupCommit, GroupRolledBack
from rolloutd.controller.work.hot_sql import ahead


@pytest.fixture
def engine(store_location):
    store = Store(store_location)
    with store.engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER)")
    return store.engine


def rows(engine):
    with engine.connect() as c:
        return dict(c.exec_driver_sql("SELECT k, v FROM t").all())


def test_calls_of_one_turn_share_a_commit_and_a_failing_one_is_rolled_back_alone(engine):
    group = GroupCommit(engine)
    seen_at_commit: list[dict] = []

    def put(k, v, fail=False):
        def work(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (k, v))
            if fail:
                raise ValueError(f"{k} refused")
            return k, lambda: seen_at_commit.append(rows(engine))
        return work

    async def scenario():
        return await asyncio.gather(group.submit(put("a", 1)), group.submit(put("b", 2, fail=True)),
                                    group.submit(put("c", 3)), return_exceptions=True)

    a, b, c = asyncio.run(scenario())
    assert (a, c) == ("a", "c") and isinstance(b, ValueError) and "b refused" in str(b)
    assert rows(engine) == {"a": 1, "c": 3}  # b's insert rolled back, its neighbours kept
    assert (group.groups, group.calls) == (1, 3)
    assert seen_at_commit == [{"a": 1, "c": 3}, {"a": 1, "c": 3}]  # after-commit steps see the commit


def test_later_turns_make_new_groups(engine):
    group = GroupCommit(engine)

    async def scenario():
        out = []
        for i in range(3):
            out.append(await group.submit(lambda tx, i=i: (tx.db.execute("INSERT INTO t VALUES (?, ?)", (f"k{i}", i)),
                                                            None)))
        return out

    asyncio.run(scenario())
    assert rows(engine) == {"k0": 0, "k1": 1, "k2": 2} and (group.groups, group.calls) == (3, 3)


def test_a_call_alone_that_fails_gets_its_error_and_writes_nothing(engine):
    """A turn of one call (on PostgreSQL its own transaction, without a savepoint): its error is its answer,
    its writes are rolled back, and the next call goes on on a clean connection."""
    group = GroupCommit(engine)

    def work(tx):
        tx.db.execute("INSERT INTO t VALUES (?, ?)", ("lone", 1))
        raise ValueError("lone refused")

    async def scenario():
        try:
            await group.submit(work)
        except ValueError as e:
            failed = e
        await group.submit(lambda tx: (tx.db.execute("INSERT INTO t VALUES (?, ?)", ("next", 2)), None))
        return failed

    assert "lone refused" in str(asyncio.run(scenario()))
    assert rows(engine) == {"next": 2} and (group.groups, group.calls) == (2, 2)


def test_a_large_turn_on_postgresql_commits_in_bounded_groups_and_the_loop_runs_between_them(engine):
    """On PostgreSQL each statement is a round trip with the loop blocked: a turn's calls go in groups of at most
    PG_GROUP_CALLS, and what else the loop had ready runs after the first group, not after them all. SQLite
    keeps one group (its statements are microseconds; one commit is what the group saves)."""
    group = GroupCommit(engine)
    order: list[object] = []

    def put(i):
        def work(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (f"k{i}", i))
            order.append(i)
            return i, None
        return work

    async def scenario():
        futures = [group.submit(put(i)) for i in range(150)]
        asyncio.get_running_loop().call_soon(order.append, "other")  # ready after the group's first turn
        return await asyncio.gather(*futures)

    assert asyncio.run(scenario()) == list(range(150)) and len(rows(engine)) == 150
    if engine.dialect.name == "postgresql":
        assert (group.groups, group.calls) == (3, 150)
        assert order.index("other") == PG_GROUP_CALLS
    else:
        assert (group.groups, group.calls) == (1, 150) and order.index("other") == 150


def test_a_statement_the_database_refuses_rolls_its_group_back_then_is_its_own_calls_error(engine):
    """PostgreSQL runs a group in one pipeline, synced once: a write the server refuses makes it skip everything
    after it, whoever sent it. So the whole group rolls back and every caller is told to retry (503, nothing of it
    written); the groups of the next `CAREFUL_SECONDS` sync each call, where the refused write is the error of the
    call that sent it and its neighbours commit, and a call that goes on with the ORM (which reads each UPDATE's row
    count at once) sees its rows counted. SQLite runs each call's statements at once: the careful answer first."""
    group = GroupCommit(engine)

    def put(k, v):
        def work(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (k, v))  # nothing read back: pipelined
            return k, None
        return work

    def orm_update(tx):
        tx.db.execute("INSERT INTO t VALUES ('o', 1)")
        n = tx.session().connection().exec_driver_sql("UPDATE t SET v = v + 1 WHERE k IN ('a', 'o')").rowcount
        return n, None

    async def scenario():
        return await asyncio.gather(group.submit(put("a", 1)), group.submit(put("a", 9)),
                                    group.submit(put("c", 3)), group.submit(orm_update), return_exceptions=True)

    if engine.dialect.name == "postgresql":
        answers = asyncio.run(scenario())
        assert all(isinstance(a, GroupRolledBack) and a.code == 503 for a in answers), answers
        assert rows(engine) == {} and group.rolled_back == 1 and group.careful_until > time.monotonic()
    a, dup, c, counted = asyncio.run(scenario())
    assert (a, c) == ("a", "c"), (a, c)
    assert "unique" in str(dup).lower() or "duplicate" in str(dup).lower(), dup  # the second "a" is its own error
    assert counted == 2
    assert rows(engine) == {"a": 2, "c": 3, "o": 2}


def test_the_groups_time_and_each_calls_wait_for_its_group_are_counted_for_the_metrics(engine):
    """`/metrics` tells a call's wait for its group from the group's own time (`node_calls.Collector`): calls that
    queue behind a slow group count its time as their wait. On PostgreSQL a turn of 150 calls is three groups, the
    first slowed by 0.2 s: the 86 calls after it waited at least that long each. SQLite runs one group, whose own
    time holds the slow call."""
    group = GroupCommit(engine)

    def put(i):
        def work(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (f"k{i}", i))
            if i == 0:
                time.sleep(0.2)  # a slow call (the server slow to answer), holding its group
            return i, None
        return work

    async def scenario():
        return await asyncio.gather(*[group.submit(put(i)) for i in range(150)])

    assert asyncio.run(scenario()) == list(range(150))
    assert group.seconds >= 0.2
    if engine.dialect.name == "postgresql":
        assert (group.groups, group.calls) == (3, 150)
        assert group.waited >= 0.2 * (150 - PG_GROUP_CALLS)
    else:
        assert (group.groups, group.calls) == (1, 150)
        # every call was in the slow call's group: none waited for it (had they, 150 × 0.2 s); what they waited is
        # the turn's own time before the group started, a few ms each on a loaded box (0.38 s in all, seen in CI)
        assert group.waited < 0.2 * 150 / 10


def test_the_metrics_serve_the_groups_counts():
    group = GroupCommit.__new__(GroupCommit)
    group.groups, group.calls, group.seconds, group.waited, group.rolled_back = 3, 150, 1.5, 17.25, 1
    served = {m.name: m.samples[0].value for m in node_calls.Collector(group).collect()}
    assert served == {"rolloutd_node_call_groups": 3, "rolloutd_node_calls_grouped": 150,
                      "rolloutd_node_call_group_seconds": 1.5, "rolloutd_node_call_group_wait_seconds": 17.25,
                      "rolloutd_node_call_groups_rolled_back": 1}


@pytest.mark.parametrize("calls", [1, 3])
def test_a_read_sent_ahead_answers_after_the_commit_with_what_its_call_had_written(engine, calls):
    """`hot_sql.ahead`: a read sent inside a call and read by its after-commit step (on PostgreSQL from the answers
    the call's pipeline fetched when it ended, with no round trip of its own) sees the call's own writes before it
    and none after it; a call alone (its own transaction) and calls grouped (a savepoint each) alike."""
    group = GroupCommit(engine)
    seen: dict[str, object] = {}

    def work(k):
        def run(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (k, 1))
            read = ahead(tx.db, "SELECT count(*), sum(v) FROM t WHERE k = ?", (k,))
            tx.db.execute("UPDATE t SET v = 5 WHERE k = ?", (k,))  # after the read was sent: not in its answer
            return k, lambda: seen.__setitem__(k, tuple(read()))
        return run

    async def scenario():
        return await asyncio.gather(*(group.submit(work(f"r{i}")) for i in range(calls)))

    assert asyncio.run(scenario()) == [f"r{i}" for i in range(calls)]
    assert seen == {f"r{i}": (1, 1) for i in range(calls)}
    assert rows(engine) == {f"r{i}": 5 for i in range(calls)}


def test_a_call_rolled_back_undoes_its_in_memory_changes_and_a_failed_commit_undoes_none(engine):
    """What a call changed in memory with its writes (`Tx.undo`: a grant's backend slot) is taken back when its
    writes are rolled back: its own error (its savepoint), or its whole group's (a statement refused in PostgreSQL's
    one pipeline). Not when the commit itself fails: that one may have committed (the answer lost on the way), and
    the expiry asks the database later."""
    from sqlalchemy import event

    group = GroupCommit(engine)
    undone: list[str] = []
    changed: list[str] = []  # the calls that changed memory (a call after the group's failure never runs)

    def put(k, v, fail=False):
        def work(tx):
            tx.db.execute("INSERT INTO t VALUES (?, ?)", (k, v))
            changed.append(k)
            tx.undo.append(lambda: undone.append(k))
            if fail:
                raise ValueError(f"{k} refused")
            return k, None
        return work

    async def turn(*works):
        return await asyncio.gather(*(group.submit(w) for w in works), return_exceptions=True)

    a, b, c = asyncio.run(turn(put("a", 1), put("b", 2, fail=True), put("c", 3)))
    assert (a, c) == ("a", "c") and isinstance(b, ValueError)
    assert undone == ["b"] and rows(engine) == {"a": 1, "c": 3}

    if engine.dialect.name == "postgresql":  # a duplicate key refused in the one pipeline: the group rolls back
        undone.clear()
        changed.clear()
        answers = asyncio.run(turn(put("d", 1), put("a", 9), put("e", 3)))
        assert all(isinstance(x, GroupRolledBack) for x in answers), answers
        # the refusal may reach the loop at the group's sync or sooner (at a later call's statement): the calls
        # that ran by then are undone, each of them
        assert "d" in undone and sorted(undone) == sorted(changed) and rows(engine) == {"a": 1, "c": 3}

    undone.clear()

    def commit_fails(conn):
        raise RuntimeError("the commit's answer was lost")

    event.listen(engine, "commit", commit_fails)
    try:
        answers = asyncio.run(turn(put("f", 1), put("g", 2)))
        alone = asyncio.run(turn(put("h", 1)))
    finally:
        event.remove(engine, "commit", commit_fails)
    assert all(isinstance(x, RuntimeError) for x in answers + alone), (answers, alone)
    assert undone == []  # kept: the expiry finds out from the database whether they were written
