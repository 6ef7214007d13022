"""Node calls' transactions committed together (`controller/work/hot_sql.GroupCommit`): the calls submitted in one
turn of the event loop share one transaction and one commit; a call that fails is rolled back alone and gets
its own error; each caller is answered only after the commit, and the after-commit steps run after it."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.work.hot_sql import GroupCommit


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
