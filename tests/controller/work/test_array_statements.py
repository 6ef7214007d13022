"""`dialects.update_by_id` and `insert_rows` write what an `executemany` of `UPDATE … WHERE id = ?` or `INSERT`
writes, on either store: one statement over arrays on PostgreSQL (NULLs, booleans and floats included), sqlite3's
executemany on SQLite. Inserted rows take their ids in the order given: the trainer feed's seqs follow it."""
from __future__ import annotations

from sqlalchemy import text

from rolloutd.controller.dialects import insert_rows, update_by_id
from rolloutd.controller.store import Store
from rolloutd.controller.work import hot_sql
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.feed import FEED_COLUMNS, Feed


def items(engine, n: int) -> list[int]:
    with engine.begin() as c:
        for p in range(n):
            c.execute(text("INSERT INTO items (job, prompt, sample, state, attempt, holds_backend, queued_at, "
                           "last_error) VALUES ('j', :p, 0, 'queued', 0, false, 0, '')"), {"p": p})
        return [r[0] for r in c.execute(text("SELECT id FROM items ORDER BY id"))]


def read(engine) -> list[tuple]:
    with engine.begin() as c:
        return [tuple(r) for r in c.execute(text(
            "SELECT id, state, stage, node_id, attempt, attempt_id, deadline, backend, holds_backend FROM items "
            "ORDER BY id"))]


def test_a_grant_writes_every_row_and_column_it_names_and_nothing_else(store_location):
    engine = build_work(Store(store_location)).attempts.engine
    ids = items(engine, 5)
    granted = ids[1:4]
    with hot_sql.transaction(engine) as tx:
        hot_sql.grant(tx.db, [(f"n{i}", 2, f"{i}.2.x", 10.5 * i, None if i % 2 else "b", i % 2 == 0, i)
                              for i in granted])
    rows = {r[0]: r[1:] for r in read(engine)}
    for i in granted:
        assert rows[i] == ("leased", "leased", f"n{i}", 2, f"{i}.2.x", 10.5 * i, None if i % 2 else "b", i % 2 == 0)
    for i in (ids[0], ids[4]):
        assert rows[i] == ("queued", None, None, 0, None, None, None, False)
    with hot_sql.transaction(engine) as tx:  # two columns only: the others keep what the grant wrote
        update_by_id(tx.db, hot_sql.ITEMS, ("backend", "holds_backend"), [(None, False, granted[0])])
    rows = {r[0]: r[1:] for r in read(engine)}
    assert rows[granted[0]][6:] == (None, False) and rows[granted[0]][:6] == ("leased", "leased", f"n{granted[0]}", 2,
                                                                              f"{granted[0]}.2.x", 10.5 * granted[0])
    with hot_sql.transaction(engine) as tx:
        update_by_id(tx.db, hot_sql.ITEMS, ("stage",), [])  # nothing to write: no statement
    assert {r[0]: r[1:] for r in read(engine)} == rows



def test_inserted_rows_are_the_rows_given_in_their_order_of_columns(store_location):
    engine = build_work(Store(store_location)).attempts.engine
    columns = ("job", "prompt", "sample", "state", "attempt", "holds_backend", "queued_at", "last_error", "backend")
    odd = 'no, "{a}" \\ ü NULL'  # an array literal's separators, quotes, escapes and keyword, as text
    given = [("j", p, s, "queued", 0, s == 1, 0.25 * p if p else 7, "" if p else odd, None if s else "b")
             for p in (2, 0, 1) for s in (1, 0)]  # queued_at: an int among floats (a clock in whole seconds)
    with hot_sql.transaction(engine) as tx:
        insert_rows(tx.db, hot_sql.ITEMS, columns, given)
        insert_rows(tx.db, hot_sql.ITEMS, columns, [])  # nothing to write: no statement
    with engine.begin() as c:
        got = [tuple(r) for r in c.execute(text(f"SELECT {', '.join(columns)} FROM items ORDER BY id"))]
    assert got == given  # the ids follow the order given, not the values


def test_a_column_of_another_python_type_or_of_none_only_is_stored_as_its_columns_type(store_location):
    """Whole-second clocks in a float column, 0/1 in a boolean one, ints as floats in an integer one, no value at all
    in a text one: each array is sent as its column's type."""
    engine = build_work(Store(store_location)).attempts.engine
    columns = ("job", "prompt", "sample", "state", "attempt", "holds_backend", "queued_at", "last_error", "backend")
    with hot_sql.transaction(engine) as tx:
        insert_rows(tx.db, hot_sql.ITEMS, columns, [("j", float(p), 0, "queued", 0, p % 2, 10 + p, "", None)
                                                    for p in range(3)])
    with engine.begin() as c:
        got = [tuple(r) for r in c.execute(text(f"SELECT {', '.join(columns)} FROM items ORDER BY id"))]
    assert got == [("j", p, 0, "queued", 0, bool(p % 2), 10.0 + p, "", None) for p in range(3)]
    if str(store_location).startswith("postgresql"):  # SQLite's columns take any type: it reads back what it got
        assert all(type(r[1]) is int and type(r[5]) is bool and type(r[6]) is float for r in got)


def test_a_feed_insert_gives_the_rows_seqs_in_the_order_delivered(store_location):
    """64 results of one call, delivered in an order that is neither the items' nor the prompts' (a node reports
    as rollouts end): the trainer reads them in that order, every column as given."""
    work = build_work(Store(store_location))
    order = [(i * 37) % 64 for i in range(64)]
    rows = [{"job": "j", "item": 1000 + i, "prompt": i // 8, "sample": i % 8, "reward": (1 if i % 3 else 0.5),
             "failure": "none" if i % 5 else "agent", "data": f'{{"item": {1000 + i}, "text": "ü \\" {{a}}"}}',
             "group_id": i // 8 if i % 2 else None, "task_id": f"t{i}", "policy": "[0, 1]", "reason": "",
             "t_queue": 0.5, "t_init": None, "t_run": 2, "t_eval": 0.25, "t_end": 1e9 + i, "generated": i,
             "turns": 1, "tool_errors": None, "truncated": i % 2} for i in order]
    with hot_sql.transaction(work.attempts.engine) as tx:
        Feed.insert(tx.db, rows)
    read = work.feed.trajectories("j")
    assert [data for _, data in read] == [r["data"] for r in rows]
    assert [seq for seq, _ in read] == sorted(seq for seq, _ in read)
    with work.attempts.engine.begin() as c:
        got = [dict(zip(FEED_COLUMNS, r)) for r in c.execute(text(
            f"SELECT {', '.join(FEED_COLUMNS)} FROM trajectories ORDER BY seq"))]
    assert got == rows
