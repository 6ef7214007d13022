"""Plain sqlite3 for the node protocol's hot paths: rows as tuples, statements by text; a call's work (`Work`) runs
alone here or with others (`group_commit.GroupCommit`).

Used by `attempts` (lease, beat, result: the attempt path's statements are all here), thousands of calls a
second at a thousand nodes, where an ORM Session and its statements cost ~6 ms of CPU per call; their rare
branches (batch groups, a configuration error) join the same transaction through `Tx.session`. sqlite3 keeps
each statement text prepared (its cache).
"""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from sqlalchemy.engine import Engine
from sqlmodel import Session

from ..dialects import PgRaw, in_list, raw, update_by_id
from .states import ItemState
from .tables import ItemRow

LIVE_SQL = f"('{ItemState.queued}', '{ItemState.leased}')"


class Tx:
    """One transaction on one pooled connection: `db` (the sqlite3 connection, or psycopg's taking the same
    statements: `dialects.raw`) for plain statements, `session()` for the ORM on the same transaction (flushed,
    never committed, by `transaction`). In a group on PostgreSQL the plain statements are pipelined
    (`GroupCommit._pipelined`); the ORM ends the pipeline first (it reads each UPDATE's row count at once)."""

    def __init__(self, conn: Any, db: Any = None) -> None:
        self.conn = conn
        self.db: sqlite3.Connection = db if db is not None else raw(conn)
        self._session: Session | None = None
        self.unpipe: Callable[[], None] = nothing
        self.group: Any = None  # a PostgreSQL group's reads sent ahead (`group_reads.GroupReads`), if any
        self.undo: list[Callable[[], None]] = []  # in-memory changes made with its writes (a grant's backend slot)

    def undone(self) -> None:
        """Its writes were rolled back before their commit (a failed commit may have committed: not then): what
        `undo` holds taken back, newest first, once."""
        undo, self.undo = self.undo, []
        for step in reversed(undo):
            step()

    def session(self) -> Session:
        if self._session is None:
            self.unpipe()
            self._session = Session(bind=self.conn, expire_on_commit=False, autoflush=True)
        return self._session


@contextmanager
def transaction(engine: Engine) -> Iterator[Tx]:
    """Commits when the block ends (rolls back on an exception), with the ORM session's changes. Rolled back before
    its commit, its in-memory changes are undone (`Tx.undone`); not when the commit itself failed, which may have
    committed all the same (the connection lost after the server's commit): the expiry asks the database then."""
    tx: Tx | None = None
    committing = False
    try:
        with engine.begin() as conn:
            tx = Tx(conn)
            try:
                yield tx
                if tx._session is not None:
                    tx._session.flush()
            finally:
                if tx._session is not None:
                    tx._session.close()
            committing = True
    except BaseException:
        if tx is not None and not committing:
            tx.undone()
        raise


@contextmanager
def joined(engine: Engine, tx: Tx | None) -> Iterator[Tx]:
    """The caller's transaction when it has one (a lease riding on a beat or results call), else a new one."""
    if tx is not None:
        yield tx
    else:
        with transaction(engine) as new:
            yield new


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
    read: tuple = ()  # the saved columns' values as read, to write back only what changed


ITEMS = ItemRow.__table__
_GRANTED = ("state", "stage", "node_id", "attempt", "attempt_id", "deadline", "backend", "holds_backend")
_ROW = [c for c in Item.__slots__ if c != "read"]
ITEM_COLUMNS = ", ".join(_ROW)
_SAVED = tuple(c for c in _ROW if c not in ("id", "job", "prompt", "sample", "group_id"))


def items_by_attempt(db: sqlite3.Connection, attempt_ids: Iterable[str]) -> dict[str, Item]:
    return items_ahead(db, attempt_ids)()


def items_ahead(db: sqlite3.Connection, attempt_ids: Iterable[str]) -> Callable[[], dict[str, Item]]:
    """`items_by_attempt`, sent now and read by the function returned (`ahead`: on PostgreSQL it shares the round
    trip of the reads sent with it)."""
    ids = list(attempt_ids)
    if not ids:
        return dict
    # PostgreSQL: several replicas may end the same attempt at once (its node moving between them): the rows are
    # locked, so the second reads them ended (READ COMMITTED re-reads a row it waited for) and drops its result
    rows = ahead(db, f"SELECT {ITEM_COLUMNS} FROM items WHERE attempt_id IN {in_list(len(ids))}"
                 + (" FOR UPDATE" if isinstance(db, PgRaw) else ""), ids, many=True)

    def read() -> dict[str, Item]:
        out = {}
        for r in rows():
            item = Item(*r)
            item.read = tuple(getattr(item, c) for c in _SAVED)
            out[r[7]] = item
        return out
    return read


def save(db: sqlite3.Connection, items: Iterable[Item]) -> None:
    """Write back, by primary key, the columns a state change changed. Only those: SQLite rewrites the entries
    of every index on a column the UPDATE sets, changed or not (a result that set its unchanged attempt and
    node ids dirtied two more scattered index pages, ~3× the WAL frames of the same rows' real changes)."""
    by_columns: dict[tuple[str, ...], list[list]] = {}
    for item in items:
        now = [getattr(item, c) for c in _SAVED]
        changed = tuple(c for c, old, new in zip(_SAVED, item.read or (object(),) * len(_SAVED), now) if old != new)
        if changed:
            by_columns.setdefault(changed, []).append([getattr(item, c) for c in changed] + [item.id])
    for columns, rows in by_columns.items():
        update_by_id(db, ITEMS, columns, rows)


def ahead(db: sqlite3.Connection, sql: str, params: Any = (), many: bool = False) -> Callable[[], Any]:
    """A read sent now, its row (or None; `many`: its rows) read by the function returned. On PostgreSQL, in a call's
    pipeline (`GroupCommit._pipelined`), reads sent together wait for the server once, where each read's own fetch is
    a round trip with the loop blocked, waiting also for every write sent before it. SQLite reads it at once (its
    cursors are not kept across the writes after them)."""
    cursor = db.execute(sql, params)
    fetch = cursor.fetchall if many else cursor.fetchone
    if isinstance(db, PgRaw):
        return fetch
    got = fetch()
    return lambda: got


def policy_ahead(db: sqlite3.Connection, job: str) -> Callable[[], Any]:
    """The job's policy row (version JSON, history JSON, paused), `ahead` (`PolicyVersions.raw_row` reads it)."""
    return ahead(db, "SELECT version, history, paused FROM policies WHERE job = ?", (job,))


def has_live(db: sqlite3.Connection, job: str) -> bool:
    """Whether `job` has an item still queued or leased."""
    return live_later(db, job)()


def live_later(db: sqlite3.Connection, job: str) -> Callable[[], bool]:
    """`has_live` sent now, answered by the function returned: on PostgreSQL from the answers the call's pipeline
    fetched when it ended (also after the commit), so the read waits for no round trip of its own."""
    row = ahead(db, f"SELECT 1 FROM items WHERE job = ? AND state IN {LIVE_SQL} LIMIT 1", (job,))
    return lambda: row() is not None


Queued = tuple[list[tuple[int, int, int, int, float]], dict[int, str]]
# a beat's lease reads its queued items ahead (before its fair share is known) only up to this many: a node that
# asks for more (a hostile one, up to `?lease=65536`) is read for after its share, so it never makes the controller
# read and lock more rows than it could be granted
AHEAD_ITEMS = 64


def queued(db: sqlite3.Connection, job: str, limit: int) -> Queued:
    """(id, prompt, sample, attempt, queued_at) of the job's first `limit` queued items, and their prompts' tasks
    (prompt → JSON text). PostgreSQL: in one round trip (each task once, on its prompt's first item), the items
    locked for the caller's grant, skipping those another replica is granting now (`shards.py`: every replica serves
    leases)."""
    return queued_ahead(db, job, limit)()


def queued_ahead(db: sqlite3.Connection, job: str, limit: int, after: int = 0) -> Callable[..., Queued]:
    """`queued` (past item id `after`, if given), sent now and read by the function returned (`ahead`)."""
    past, params = (" AND id > ?", (job, ItemState.queued.value, after, limit)) if after else \
        ("", (job, ItemState.queued.value, limit))
    if not isinstance(db, PgRaw):
        rows = db.execute("SELECT id, prompt, sample, attempt, queued_at FROM items WHERE job = ? AND state = ?"
                          f"{past} ORDER BY id LIMIT ?", params).fetchall()
        prompts = sorted({row[1] for row in rows})
        tasks = dict(db.execute(f"SELECT prompt, data FROM tasks WHERE job = ? AND prompt IN {in_list(len(prompts))}",
                                (job, *prompts))) if prompts else {}
        return lambda n=None: (rows[:n], tasks)
    rows = ahead(
        db, "WITH q AS (SELECT id, prompt, sample, attempt, queued_at FROM items WHERE job = ? AND state = ?"
        f"{past} ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED)"
        " SELECT q.id, q.prompt, q.sample, q.attempt, q.queued_at,"
        " CASE WHEN row_number() OVER (PARTITION BY q.prompt ORDER BY q.id) = 1 THEN t.data END"
        " FROM q LEFT JOIN tasks t ON t.job = ? AND t.prompt = q.prompt ORDER BY q.id", (*params, job), many=True)

    def read(n: int | None = None) -> Queued:  # the first `n` (all: None), once
        got = rows()
        return [r[:5] for r in got[:n]], {r[1]: r[5] for r in got if r[5] is not None}
    return read


def grant(db: sqlite3.Connection, grants: list[tuple[Any, ...]]) -> None:
    """Items leased: (node_id, attempt, attempt_id, deadline, backend, holds_backend, id) each."""
    update_by_id(db, ITEMS, _GRANTED, [(ItemState.leased.value, "leased", *g) for g in grants])


def cancelled(db: sqlite3.Connection, attempt_ids: list[str]) -> set[str]:
    """Those of `attempt_ids` whose item was cancelled."""
    return {aid for (aid,) in db.execute(
        f"SELECT attempt_id FROM items WHERE attempt_id IN {in_list(len(attempt_ids))} AND state = ?",
        (*attempt_ids, ItemState.cancelled.value))}


def save_pins(db: sqlite3.Connection, pins: Iterable[tuple[str | None, bool, int]]) -> None:
    """(backend, holds_backend, id) each: a backend released or re-pinned (admission is restored from these)."""
    update_by_id(db, ITEMS, ("backend", "holds_backend"), pins)


# ------------------------------------------------------------------ a call's work: alone or grouped

def nothing() -> None:
    """The after-commit step of a call that has none."""


Done = Callable[[], None]  # what a call does once its transaction is committed
Work = Callable[[Tx], tuple[Any, Done]]  # a call's work: its value and its after-commit step


def run_alone(engine: Engine, work: Work) -> Any:
    """A call's work in a transaction of its own, then its after-commit step (`GroupCommit` runs many together)."""
    with transaction(engine) as tx:
        value, after = work(tx)
    if after is not None:
        after()
    return value
