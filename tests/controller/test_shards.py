"""Node shards' ownership (controller/shards.py) on the real PostgreSQL server: a node goes to the least-loaded
live replica at its first call, and when a replica's membership runs out its nodes move to the live ones (one
move wins), while a graceful stop hands them on at once."""
from __future__ import annotations

from rolloutd.controller.shards import Shards
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


def test_nodes_spread_over_live_replicas_and_move_when_one_leaves(pg_server):
    store = Store(pg_server.create_database())
    a, b = Shards(store.engine, "http://a"), Shards(store.engine, "http://b")
    for s in (a, b):
        s.renew()
    for s in (a, b):
        s.refresh()
    ids = [f"n{i}" for i in range(6)]
    _nodes(store, ids)
    owners = [(a if i % 2 else b).owner(n) for i, n in enumerate(ids)]  # first calls, on either replica
    assert sorted(owners) == ["http://a"] * 3 + ["http://b"] * 3  # least-loaded: an even split
    assert all(b.owner(n) == o for n, o in zip(ids, owners))  # both see one owner per node
    mine = a.refresh()
    assert mine == {n for n, o in zip(ids, owners) if o == "http://a"}
    b.resign()  # b stops: its row runs out now
    assert a.refresh() == set(ids)  # its nodes moved to the live replica
    assert a.owners == {n: "http://a" for n in ids}
