"""Node calls' transactions committed together (`GroupCommit`): the calls of one turn of the event loop in one
transaction, each in a savepoint of its own, then one commit. Used by `node_calls.NodeCalls`; on PostgreSQL a group
is one pipeline with its beats' reads sent ahead (`group_reads.py`). Next step: `group_reads.py`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

from sqlalchemy.engine import Engine

from ..dialects import PgRaw, raw
from ..errors import ServiceUnavailable
from ..store.faults import storage_reason
from .group_reads import GroupReads, refused
from .hot_sql import Tx, Work, transaction

log = logging.getLogger("rolloutd.scheduler")
RETRY_SECONDS = 0.002  # a group commit deferred by a worker's write transaction looks again this much later
# calls per group on PostgreSQL: each of a call's statements is a round trip with the loop blocked, so an unbounded
# group after a slow one grows larger still (measured: the benchmarks page, "Constants"); the rest waits for the
# next turn, after the loop has served what arrived meanwhile
PG_GROUP_CALLS = 64
# after a PostgreSQL group rolled back whole (a statement refused in its one pipeline), the groups of the next this
# many seconds sync each call on its own again, so that a refused statement is its own call's error
CAREFUL_SECONDS = 30.0
_WRITERS: "weakref.WeakKeyDictionary[Engine, threading.Lock]" = weakref.WeakKeyDictionary()
Entry = tuple[asyncio.Future, Any, BaseException | None, Callable[[], None] | None]  # (future, value, error, after)


def worker_writing(engine: Engine) -> threading.Lock:
    """Held by a worker thread for the whole of a write transaction on `engine` (SQLite: a batch's fill step).
    The loop's group commit would wait for SQLite's write lock inside BEGIN IMMEDIATE with the whole loop
    blocked; while this is held it waits its turn on the loop instead (`GroupCommit._run`), and other calls go on
    (issue 36)."""
    return _WRITERS.setdefault(engine, threading.Lock())


class GroupRolledBack(ServiceUnavailable):
    """A node call whose PostgreSQL group rolled back whole: a statement of the group was refused, and in one
    pipeline the server skips everything after it, whoever sent it. Nothing of the call took effect: retry it."""


def _flush(tx: Tx) -> None:
    if tx._session is not None:
        tx._session.flush()


class GroupCommit:
    """Node calls' transactions committed together. A call's work (`submit`) waits for the next turn of the
    event loop, where every call submitted meanwhile runs in one transaction, each in a savepoint of its own (a
    call that fails is rolled back alone and gets its error), then one commit; then each caller gets its answer,
    and each call's after-commit step runs. A thousand daemons' beats arrive together: at ~500 calls a second,
    one commit per call was a third of the controller's time (WAL frames, locks, checkpoints).

    On PostgreSQL the group is one pipeline, synced once (`group_reads.GroupReads`): a statement the server refuses
    then rolls the whole group back (each caller retries), and the groups of the next `CAREFUL_SECONDS` sync each
    call on its own, where a refused statement is its own call's error.

    Nothing awaits inside a group: no other code of the loop runs while its transaction is open. The work must
    not take the store's lock either (a thread holding it may be waiting for our write lock): callers read their
    job before they submit."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pending: list[tuple[Work, asyncio.Future, float]] = []  # (work, its caller's answer, submitted at)
        self.groups = self.calls = 0  # for the metrics and the bench
        self.seconds = self.waited = 0.0  # time in groups; calls' time from submitted to their group's start, summed
        self.rolled_back = 0  # PostgreSQL groups rolled back whole
        self.careful_until = 0.0  # monotonic time until which PostgreSQL groups sync each call

    def submit(self, work: Work) -> "asyncio.Future[Any]":
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._run)
        self._pending.append((work, future, time.monotonic()))
        return future

    def _run(self) -> None:
        if self.engine.dialect.name == "sqlite" and worker_writing(self.engine).locked():
            asyncio.get_running_loop().call_later(RETRY_SECONDS, self._run)  # the calls stay pending meanwhile
            return
        pg = self.engine.dialect.name == "postgresql"
        if pg and len(self._pending) > PG_GROUP_CALLS:
            group, self._pending = self._pending[:PG_GROUP_CALLS], self._pending[PG_GROUP_CALLS:]
            asyncio.get_running_loop().call_soon(self._run)  # the rest: after the loop's other ready work
        else:
            group, self._pending = self._pending, []
        start = time.monotonic()
        self.waited += sum(start - submitted for _, _, submitted in group)
        if len(group) == 1 and pg:
            done = self._alone(*group[0][:2])  # a call alone needs no savepoint: two round trips to the server saved
        else:
            done = self._together(group)
        self.seconds += time.monotonic() - start
        if done is None:
            return
        self.groups, self.calls = self.groups + 1, self.calls + len(group)
        for future, value, error, _ in done:
            if future.done():  # its caller went away (the request was cancelled)
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        for _, _, error, after in done:
            if after is not None:
                after()

    def _together(self, group: list[tuple[Work, asyncio.Future, float]]) -> list[Entry] | None:
        """The group's calls in one transaction, a savepoint each; None when the commit failed or the group was
        rolled back whole (every caller has the error)."""
        done: list[Entry] = []
        txs: list[Tx] = []  # the calls' transactions: their in-memory changes undone if the group rolls back
        reads: GroupReads | None = None
        committing = False  # a failed commit may have committed (the answer lost): nothing is undone then
        try:
            with self.engine.begin() as conn:
                db = raw(conn)
                if conn.dialect.name == "sqlite":  # psycopg has begun one already, at its first statement
                    db.execute("BEGIN IMMEDIATE")  # savepoints below must not each begin (and commit) one
                elif time.monotonic() >= self.careful_until:
                    reads = GroupReads(db)
                try:
                    if reads is not None:
                        reads.send(conn, [work for work, _, _ in group])
                    for work, future, _ in group:
                        done.append(self._call(conn, db, work, future, reads, txs))
                    if reads is not None:
                        reads.end()  # the one sync: a statement refused anywhere in the group raises here
                except BaseException as e:
                    if reads is not None:
                        reads.end(e)  # out of pipeline mode before the rollback
                    raise
                committing = True
        except BaseException as e:  # noqa: BLE001 - the commit failed: no call of the group took effect
            if not committing:
                for tx in txs:
                    tx.undone()
            error = e if isinstance(e, Exception) else RuntimeError(f"group commit interrupted: {e!r}")
            cause = e.__cause__ if isinstance(e, GroupRolledBack) else e
            if reads is not None and refused(cause) and storage_reason(cause) is None:  # not a server away
                self.rolled_back, self.careful_until = self.rolled_back + 1, time.monotonic() + CAREFUL_SECONDS
                log.warning("a group of %d node calls rolled back whole, each retries: %s", len(group), cause)
                error = GroupRolledBack("rolled back with the node calls committed together: retry")
            elif isinstance(e, GroupRolledBack):
                error = cause
            for _, future, _ in group:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(e, Exception):
                raise
            return None
        return done

    @classmethod
    def _call(cls, conn: Any, db: Any, work: Work, future: asyncio.Future, reads: GroupReads | None,
              txs: list[Tx]) -> Entry:
        """A call in a savepoint of its own: its own logic's error rolls back the savepoint and is its answer. In the
        group's open pipeline (`reads`) an error the server raises may be an earlier call's statement: it ends the
        group (`GroupRolledBack`). Otherwise (SQLite; PostgreSQL while careful, or after the ORM ended the group's
        pipeline) the call is synced on its own (`_pipelined`), so the server's error is its own too."""
        tx = Tx(conn, db)
        txs.append(tx)
        shared = reads is not None and reads.piped
        if shared:  # the ORM reads each UPDATE's row count at once: it ends the group's pipeline
            tx.group, tx.unpipe = reads, reads.end
        try:
            try:
                with contextlib.nullcontext() if shared else cls._pipelined(tx):
                    db.execute("SAVEPOINT call")
                    value, after = work(tx)
                    _flush(tx)
                entry: Entry = (future, value, None, after)
            except Exception as e:  # noqa: BLE001 - this call's error is its caller's answer
                if shared and refused(e):  # the group cannot go on: rolled back whole
                    raise GroupRolledBack(str(e)) from e
                db.execute("ROLLBACK TO call")
                tx.undone()
                entry = (future, None, e, None)
            db.execute("RELEASE call")
            return entry
        finally:
            if tx._session is not None:
                tx._session.close()

    @staticmethod
    @contextmanager
    def _pipelined(tx: Tx) -> Iterator[None]:
        """PostgreSQL: the call's statements sent without waiting for each answer (psycopg's pipeline mode) up to
        a read that needs its rows, and synced when the call's work ends, so that a statement's error is raised
        here, as this call's. A group's calls were a round trip per statement with the loop blocked (a beat with
        results: ~10); writes, savepoints and locks now ride with the next read or the sync."""
        if not isinstance(tx.db, PgRaw):
            yield
            return
        with ExitStack() as stack:
            stack.enter_context(tx.db.pg.pipeline())
            tx.unpipe = stack.close  # the ORM's statements run after the pipeline's end (idempotent)
            yield

    def _alone(self, work: Work, future: asyncio.Future) -> list[Entry]:
        """One call as a whole transaction (PostgreSQL, `hot_sql.transaction`: undone in memory if rolled back before
        its commit): its error, or its commit's, is its answer."""
        try:
            with transaction(self.engine) as tx, self._pipelined(tx):
                value, after = work(tx)
        except Exception as e:  # noqa: BLE001 - this call's error is its caller's answer
            return [(future, None, e, None)]
        return [(future, value, None, after)]
