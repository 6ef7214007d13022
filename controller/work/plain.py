"""Plain sqlite3 for the node protocol's hot paths: one transaction per call, rows as tuples, statements by text.

Used by `leases` (lease, beat) and `results`, thousands of calls a second at a thousand nodes, where an ORM
Session and its statements cost ~6 ms of CPU per call; their rare branches (batch groups, a configuration
error) join the same transaction through `Tx.session`. sqlite3 keeps each statement text prepared (its cache).
"""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from sqlalchemy.engine import Engine
from sqlmodel import Session

from .states import ItemState

LIVE_SQL = f"('{ItemState.queued}', '{ItemState.leased}')"


class Tx:
    """One transaction on one pooled connection: `db` (the sqlite3 connection) for plain statements,
    `session()` for the ORM on the same transaction (flushed, never committed, by `transaction`)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.db: sqlite3.Connection = conn.connection.driver_connection
        self._session: Session | None = None

    def session(self) -> Session:
        if self._session is None:
            self._session = Session(bind=self.conn, expire_on_commit=False, autoflush=True)
        return self._session


@contextmanager
def transaction(engine: Engine) -> Iterator[Tx]:
    """Commits when the block ends (rolls back on an exception), with the ORM session's changes."""
    with engine.begin() as conn:
        tx = Tx(conn)
        try:
            yield tx
            if tx._session is not None:
                tx._session.flush()
        finally:
            if tx._session is not None:
                tx._session.close()


@contextmanager
def joined(engine: Engine, tx: Tx | None) -> Iterator[Tx]:
    """The caller's transaction when it has one (a lease riding on a beat or results call), else a new one."""
    if tx is not None:
        yield tx
    else:
        with transaction(engine) as new:
            yield new


def in_list(n: int) -> str:
    return "(" + ",".join("?" * n) + ")"


# ------------------------------------------------------------------ items as plain objects

@dataclass(slots=True)
class Item:
    """An `ItemRow` without the ORM: `queue`'s state changes work on either; `save` writes it back."""
    id: int
    job: str
    prompt: int
    sample: int
    state: str
    stage: str | None
    attempt: int
    attempt_id: str | None
    node_id: str | None
    deadline: float | None
    backend: str | None
    holds_backend: bool
    queued_at: float
    last_error: str
    group_id: int | None


ITEM_COLUMNS = ", ".join(Item.__slots__)
_SAVED = [c for c in Item.__slots__ if c not in ("id", "job", "prompt", "sample", "group_id")]
_SAVE = f"UPDATE items SET {', '.join(f'{c} = ?' for c in _SAVED)} WHERE id = ?"


def items_by_attempt(db: sqlite3.Connection, attempt_ids: Iterable[str]) -> dict[str, Item]:
    ids = list(attempt_ids)
    if not ids:
        return {}
    rows = db.execute(f"SELECT {ITEM_COLUMNS} FROM items WHERE attempt_id IN {in_list(len(ids))}", ids)
    return {r[7]: Item(*r) for r in rows}


def save(db: sqlite3.Connection, items: Iterable[Item]) -> None:
    """Write back every field a state change may touch, by primary key."""
    db.executemany(_SAVE, [[getattr(i, c) for c in _SAVED] + [i.id] for i in items])


def has_live(db: sqlite3.Connection, job: str) -> bool:
    """Whether `job` has an item still queued or leased."""
    return db.execute(f"SELECT 1 FROM items WHERE job = ? AND state IN {LIVE_SQL} LIMIT 1", (job,)).fetchone() \
        is not None
