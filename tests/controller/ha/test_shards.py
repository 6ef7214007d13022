"""Node shards' ownership (controller/ha/shards.py) on the real PostgreSQL server: a node goes to the least-loaded
live replica at its first call, and when a replica's membership runs out its nodes move to the live ones (one
move wins), while a graceful stop hands them on at once."""
from __future__ import annotations

import pytest

from rolloutd.controller.ha.shards import Shards
from rolloutd.controller.store import Store
from sqlmodel import Session

from rolloutd.controller.work import tables
from rolloutd.controller.work.tables import NodeRow


def _nodes(store: Store, ids: list[str]) -> None:
    tables.create(store.engine)
    with Session(store.engine) as s:
        for n in ids:
            s.add(NodeRow(id=n, job="default/j", name=n, host="h", registered=0, last_seen=0))
        s.commit()


@pytest.fixture
def two_replicas(pg_server) -> tuple[Store, Shards, Shards]:
    """A store on the real server and two replicas' `Shards` on it (a and b), each renewed then refreshed: both
    live members in both views."""
    store = Store(pg_server.create_database())
    a, b = Shards(store.engine, "http://a"), Shards(store.engine, "http://b")
    for s in (a, b):
        s.renew()
    for s in (a, b):
        s.refresh()
    return store, a, b


def test_nodes_spread_over_live_replicas_and_move_when_one_leaves(two_replicas):
    store, a, b = two_replicas
    ids = [f"n{i}" for i in range(6)]
    _nodes(store, ids)
    owners = [(a if i % 2 else b).owner(n) for i, n in enumerate(ids)]  # first calls, on either replica
    assert sorted(owners) == ["http://a"] * 3 + ["http://b"] * 3  # least-loaded: an even split
    assert all(b.owner(n) == o for n, o in zip(ids, owners))  # both see one owner per node
    mine = set(a.refresh())
    assert mine == {n for n, o in zip(ids, owners) if o == "http://a"}
    b.resign()  # b stops: its row runs out now
    assert set(a.refresh()) == set(ids)  # its nodes moved to the live replica
    assert a.owners == {n: "http://a" for n in ids}


def test_a_replica_that_joins_is_planned_its_share_and_a_hand_over_moves_one_node_once(pg_server):
    """A replica above its fair share plans to hand nodes to the one below it (a member that joined), at each
    node's next call; the hand-over bumps the row's `moves` (the fence's epoch) and happens once."""
    store = Store(pg_server.create_database())
    a = Shards(store.engine, "http://a")
    a.renew()
    a.refresh()
    ids = [f"n{i}" for i in range(5)]
    _nodes(store, ids)
    assert [a.owner(n) for n in ids] == ["http://a"] * 5 and a.refresh() == {n: 1 for n in ids}
    assert a.give == {}  # alone: nothing to give
    b = Shards(store.engine, "http://b")
    b.renew()  # b joins
    a.refresh()
    assert len(a.give) == 2 and set(a.give.values()) == {"http://b"}  # 5 over 2: it keeps 3
    node = next(iter(a.give))
    assert a.hand_over(node, "http://b") and not a.hand_over(node, "http://b")
    assert b.refresh() == {node: 2} and len(a.refresh()) == 4 and list(a.give.values()) == ["http://b"]
    assert b.give == {}


def test_a_node_whose_daemon_cannot_reach_its_owner_is_taken_over_at_once_fenced_and_never_planned_back(two_replicas):
    """Issue #42: b is killed; its membership row has not run out, so the rows still name it and a refresh moves
    nothing. A daemon of b's node, told unreachable, goes back to a: `take_over` moves the node now (moves bumped:
    the fence's epoch), only from the owner named, not while a call of b on it is open (its row held FOR SHARE),
    and once; a's plan hands b nothing (though a is above its share) until b's row runs out."""
    store, a, b = two_replicas
    ids = [f"n{i}" for i in range(4)]
    _nodes(store, ids)
    for i, n in enumerate(ids):
        (a if i % 2 else b).owner(n)
    a.refresh()
    node = next(n for n in ids if a.owners[n] == "http://b")
    a.refresh()
    assert "http://b" in a.members and a.owners[node] == "http://b"  # b's row lives on: a refresh moves nothing
    moves = _owner_rows(store)[node][1]
    assert not a.take_over(node, "http://c")  # not the owner the row names: nothing moves
    with store.engine.connect() as call:  # b's call on the node still open (a paused replica's): the move waits
        tx = call.begin()
        call.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = %s FOR SHARE", (node,))
        assert not a.take_over(node, "http://b")
        tx.commit()
    assert a.take_over(node, "http://b") and not a.take_over(node, "http://b")  # one move wins
    assert _owner_rows(store)[node] == ("http://a", moves + 1) and a.owners[node] == "http://a"
    owned = a.refresh()
    assert node in owned and len(owned) == 3 and "http://b" in a.members
    assert a.give == {}  # above its share (3 of 4), yet plans nothing for the member a daemon could not reach
    assert a.taken == {node: "http://b"}
    assert b.refresh().keys() == {n for n in ids if n != node and _owner_rows(store)[n][0] == "http://b"}
    b.resign()  # its row runs out: its other nodes move, and a remembers no node taken from it
    assert set(a.refresh()) == set(ids) and a.taken == {}


def test_the_plan_gives_only_what_is_above_the_share_to_whoever_is_below_it():
    from rolloutd.controller.ha.shards import _plan

    owners = {f"a{i}": "A" for i in range(8)} | {f"c{i}": "C" for i in range(4)}
    assert list(_plan(owners, ["A", "B", "C"], "A").values()) == ["B"] * 4  # 12 over 3: A gives 4, all to B
    assert _plan(owners, ["A", "B", "C"], "C") == {}  # C holds its share
    even = {"a0": "A", "a1": "A", "a2": "A", "b0": "B", "b1": "B"}
    assert _plan(even, ["A", "B"], "A") == {}  # within one of each other: nothing moves


@pytest.fixture
def own_pg_server():
    """A server of this test's own: a refresh reads from the oldest transaction open on the whole server (its snapshot's
    xmin), so another test's open transaction on the shared server would make it read rows again."""
    from support.postgres import start_server

    server = start_server()
    yield server
    server.stop()


def test_a_refresh_reads_only_the_owner_rows_written_since_the_last_and_misses_none(own_pg_server):
    """After the first (whole) read a refresh reads only the rows stamped since: none when nothing changed; a write
    committed late by a transaction older than a later one's (out of order) is still read; a node gone (its row
    stamped in the same transaction) leaves the view. The view equals a whole read each time."""
    from rolloutd.controller.ha.shards import STAMP

    store = Store(own_pg_server.create_database())
    a, b = Shards(store.engine, "http://a"), Shards(store.engine, "http://b")
    for s in (a, b):
        s.renew()
    ids = [f"n{i}" for i in range(6)]
    _nodes(store, ids + ["late", "early"])
    for n in ids:
        a.owner(n)
    a.refresh()
    whole = a.rows_read
    assert whole == 6

    for _ in range(3):
        a.refresh()
    assert a.rows_read == whole  # nothing written: nothing read

    late = store.engine.connect()  # an older transaction writes first and commits last
    tx = late.begin()
    late.exec_driver_sql(f"INSERT INTO node_owners (node_id, owner, moves, stamp) VALUES ('late', 'http://b', 1, {STAMP})")
    a.refresh()
    with store.engine.begin() as c:
        c.exec_driver_sql(f"INSERT INTO node_owners (node_id, owner, moves, stamp) VALUES ('early', 'http://b', 1, {STAMP})")
    a.refresh()
    assert "early" in a.owners and "late" not in a.owners
    tx.commit()
    late.close()
    a.refresh()
    assert a.owners["late"] == "http://b"

    with store.engine.begin() as c:  # a node retired (`NodeRegistry.retire_silent` with shards): its row stamped
        c.exec_driver_sql("UPDATE nodes SET state = 'gone' WHERE id = 'n0'")
        c.exec_driver_sql(f"UPDATE node_owners SET stamp = {STAMP} WHERE node_id = 'n0'")
    before = a.rows_read
    a.refresh()
    assert "n0" not in a.owners and a.rows_read - before <= 3  # n0, and rows of transactions open at the last read
    c = Shards(store.engine, "http://c")
    c.refresh()
    assert (a.owners, a.moves) == (c.owners, c.moves)


def _owner_rows(store: Store) -> dict[str, tuple[str, int]]:
    with store.engine.connect() as c:
        return {n: (o, m) for n, o, m in c.exec_driver_sql("SELECT node_id, owner, moves FROM node_owners")}


def test_a_purge_deletes_its_jobs_owner_rows_in_its_transaction_and_no_other(store_location):
    """Both stores: the owner rows of a purged job's nodes go with the nodes, in the purge's transaction (rolled back
    with it); every other job's stay as they were. On PostgreSQL each deletion is recorded (stamped)."""
    store = Store(store_location)
    tables.create(store.engine)
    with Session(store.engine) as s:
        for job, n in (("default/j", "j0"), ("default/j", "j1"), ("default/k", "k0")):
            s.add(NodeRow(id=n, job=job, name=n, host="h", registered=0, last_seen=0))
        s.commit()
    with store.engine.begin() as c:
        for n in ("j0", "j1", "k0"):
            c.exec_driver_sql(f"INSERT INTO node_owners (node_id, owner, moves) VALUES ('{n}', 'http://a', 3)")
    with Session(store.engine) as s:
        tables.purge(s, "default/j")
        s.rollback()
    assert set(_owner_rows(store)) == {"j0", "j1", "k0"}
    with Session(store.engine) as s:
        tables.purge(s, "default/j")
        s.commit()
    assert _owner_rows(store) == {"k0": ("http://a", 3)}
    with store.engine.connect() as c:  # on PostgreSQL each deletion recorded for the replicas that read by stamp
        recorded = {n for (n,) in c.exec_driver_sql("SELECT node_id FROM node_owner_deletions")}
    assert recorded == ({"j0", "j1"} if store.dialect == "postgresql" else set())


def test_on_postgresql_two_replicas_drop_a_purged_jobs_nodes_at_their_next_refresh_and_nothing_else(two_replicas):
    """Two replicas read the owner rows by stamp (no whole read due); a job purged deletes its nodes' rows and
    records each deletion's stamp: both replicas' next refresh drops exactly those nodes (reading the 4 records),
    the other job's owners and moves as they were, and the view equals a new replica's whole read."""
    store, a, b = two_replicas
    kept, purged = [f"j{i}" for i in range(6)], [f"k{i}" for i in range(4)]
    _nodes(store, kept)
    tables.create(store.engine)
    with Session(store.engine) as s:
        for n in purged:
            s.add(NodeRow(id=n, job="default/k", name=n, host="h", registered=0, last_seen=0))
        s.commit()
    for i, n in enumerate(kept + purged):
        (a if i % 2 else b).owner(n)
    a.refresh()
    a.hand_over(next(n for n in kept if a.owners[n] == "http://a"), "http://b")  # one row moved twice: moves 2
    for s in (a, b):
        s.refresh()
        s.refresh()
    views = {s.url: (dict(s.owners), dict(s.moves)) for s in (a, b)}
    assert all(set(owners) == set(kept + purged) for owners, _ in views.values())
    read = {s.url: s.rows_read for s in (a, b)}
    for s in (a, b):
        s.refresh()
        assert s.rows_read == read[s.url]  # by stamp: nothing changed, nothing read

    with Session(store.engine) as s:
        tables.purge(s, "default/k")
        s.commit()
    for s in (a, b):
        owned = s.refresh()
        assert s.rows_read - read[s.url] == len(purged)  # by stamp still: the deletions' records, nothing else
        before_owners, before_moves = views[s.url]
        assert s.owners == {n: o for n, o in before_owners.items() if n not in purged}
        assert s.moves == {n: m for n, m in before_moves.items() if n not in purged}
        assert owned == {n: m for n, m in s.moves.items() if s.owners[n] == s.url}
    c = Shards(store.engine, "http://c")
    c.refresh()
    assert (a.owners, a.moves) == (b.owners, b.moves) == (c.owners, c.moves)
    read = {s.url: s.rows_read for s in (a, b)}
    for s in (a, b):  # the deletion seen once: reads by stamp again
        s.refresh()
        assert s.rows_read == read[s.url]


def test_shards_are_on_by_default_with_replicas_on_postgresql_and_never_on_sqlite():
    from rolloutd.controller.ha.replicas import node_shards

    url = "postgresql://rolloutd@/rolloutd?host=/run/postgresql"
    assert node_shards(url, None) and node_shards(url, "1") and node_shards(url, "on")
    assert not node_shards(url, "0") and not node_shards(url, "off") and not node_shards(url, "false")
    assert not node_shards("/var/lib/rolloutd/rolloutd.db", None) and not node_shards("/x/rolloutd.db", "1")


def test_a_gone_members_node_locked_by_its_open_transaction_moves_at_the_next_refresh(pg_server):
    """A replica paused inside a node call's transaction (the owner row held `FOR SHARE` by its fence) past its
    membership: the survivor's refresh moves its other nodes, cannot move that one (the move skips a locked row), so
    ends the paused replica's database sessions (named by the member row), and moves it at its next refresh. The
    survivor's own sessions are not ended; the paused transaction commits nothing once resumed."""
    from sqlalchemy import create_engine

    from rolloutd.controller import dialects

    location = pg_server.create_database()
    store = Store(location)
    a_engine = create_engine(dialects.engine_url(location), connect_args={"application_name": "rolloutd-test-a"})
    try:
        a = Shards(a_engine, "http://a", session="rolloutd-test-a")
        a.renew()
        a.refresh()
        ids = [f"n{i}" for i in range(3)]
        _nodes(store, ids)
        assert [a.owner(n) for n in ids] == ["http://a"] * 3
        b = Shards(store.engine, "http://b")
        b.renew()
        paused = a_engine.connect()
        paused.begin()
        paused.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = 'n0' FOR SHARE")  # a's fence
        paused.exec_driver_sql("UPDATE nodes SET last_seen = 99 WHERE id = 'n0'")
        with store.engine.begin() as c:  # a's membership runs out (its renewals stopped with it)
            c.exec_driver_sql("UPDATE replica_members SET expires = 0 WHERE url = 'http://a'")
        assert set(b.refresh()) == {"n1", "n2"}  # n0 skipped: locked
        with pytest.raises(Exception, match="terminat|closed"):  # its session was ended
            paused.exec_driver_sql("SELECT 1")
        assert set(b.refresh()) == set(ids)
        assert b.owners == {n: "http://b" for n in ids}
        with store.engine.connect() as c:
            assert c.exec_driver_sql("SELECT last_seen FROM nodes WHERE id = 'n0'").scalar() == 0
    finally:
        a_engine.dispose()


def test_each_replica_sees_the_leases_the_others_hold_as_of_their_last_renewal(two_replicas):
    """A job's progress sums every live replica's leases: what a renewed, each renewal replacing the last, and
    none once a stopped."""
    _, a, b = two_replicas
    a.local = {"default/j": {"RUN": 3, "EVAL": 1}, "default/k": {"INIT": 2}}
    a.renew()
    b.refresh()
    assert b.elsewhere("default/j") == {"RUN": 3, "EVAL": 1} and b.elsewhere("default/k") == {"INIT": 2}
    assert a.elsewhere("default/j") == {}  # its own are not elsewhere
    a.local = {"default/j": {"RUN": 1}}
    a.renew()
    b.refresh()
    assert b.elsewhere("default/j") == {"RUN": 1} and b.elsewhere("default/k") == {}
    a.resign()
    b.refresh()
    assert b.elsewhere("default/j") == {}
