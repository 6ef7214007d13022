"""Trajectory seqs after a restore, on both stores: the store's largest seq is below the one recorded beside it,
so the next trajectory is numbered above the recorded one (SQLite: the placeholder row moves its rowid; PostgreSQL:
the column's sequence is set past it too, a row inserted with its own seq does not move it)."""
from __future__ import annotations

from rolloutd.controller.store import Store
from rolloutd.controller.work import hot_sql, seq_floor, tables
from rolloutd.controller.work.feed import Feed


def trajectory(item: int) -> dict:
    return {"job": "j", "item": item, "prompt": 0, "sample": item, "reward": 1.0, "failure": "none", "data": "{}",
            "group_id": None, "task_id": None, "policy": None, "reason": "", "t_queue": None, "t_init": None,
            "t_run": None, "t_eval": None, "t_end": None, "generated": None, "turns": None, "tool_errors": None,
            "truncated": None}


def seqs(store: Store) -> list[int]:
    with hot_sql.transaction(store.engine) as tx:
        return [s for (s,) in tx.db.execute("SELECT seq FROM trajectories WHERE job = 'j' ORDER BY seq")]


def test_after_a_restore_new_trajectories_are_numbered_above_every_seq_handed_out(tmp_path, store_location):
    store = Store(store_location)
    tables.create(store.engine)
    with hot_sql.transaction(store.engine) as tx:
        Feed.insert(tx.db, [trajectory(1), trajectory(2)])
    assert seqs(store) == [1, 2]
    record = tmp_path / seq_floor.SEQ_FILE
    record.write_text("500\n")  # seqs up to 500 were handed out before the backup this store came from
    with hot_sql.transaction(store.engine) as tx:
        floor = seq_floor.raise_floor(tx.db, record)
        Feed.insert(tx.db, [trajectory(3)])
    assert floor == 500 + seq_floor.MARGIN
    assert seqs(store) == [1, 2, floor + 1]
    with hot_sql.transaction(store.engine) as tx:  # nothing rewound now: the floor stays where it is
        assert seq_floor.raise_floor(tx.db, record) is None
        Feed.insert(tx.db, [trajectory(4)])
    assert seqs(store)[-1] == floor + 2
