"""A PostgreSQL group's one pipeline (`GroupCommit`): every beat's reads sent before any call runs, the group synced
once at its end, so the server runs a call's writes while the loop works out the next call. Next step: none planned.

Each call of a group waited twice for the server (its first reads, then its writes at its end), with the loop
blocked; the server's work and the loop's were never at the same time. Here a call's reads are answered before its
turn, and its writes are not waited for. What the calls share is dealt out in their order: the queued items of a job
are read once for all its beats (`ask`, `granted`). A call's reads are sent ahead only when no call before it in the
group names the same node or attempt (`claim`): those see the writes before them by reading at their turn. What was
read ahead is not used once the ORM ran in the group (`stale`: a settled batch group or a failed job may cancel items).
"""
from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any, Callable, Iterable

from . import hot_sql
from .hot_sql import Queued, Tx


def refused(e: BaseException | None) -> bool:
    """Whether `e` is the database's (a statement refused, the pipeline aborted), not a call's own logic's. psycopg
    is the `postgresql` extra's: without it loaded no error can be its."""
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and (isinstance(e, psycopg.Error) or isinstance(getattr(e, "orig", None), psycopg.Error))


class GroupReads:
    """The group's pipeline (open while `piped`) and its reads sent ahead. A work that may touch items has `claims`
    (node id, attempt ids); one that can read ahead has `send(tx)`, called here in the group's order."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self._pipe = ExitStack()
        self._pipe.enter_context(db.pg.pipeline())
        self.piped, self.stale, self._sending = True, False, False
        self._nodes: set[str] = set()
        self._attempts: set[str] = set()
        self._asks: dict[str, int] = {}
        self._pools: dict[str, _Pool] = {}

    def send(self, conn: Any, works: Iterable[Any]) -> None:
        """The reads of every work whose keys no earlier work named, then each job's queued items for them all."""
        self._sending = True
        for work in works:
            claims = getattr(work, "claims", None)
            if claims is not None and self._claim(*claims) and hasattr(work, "send"):
                tx = Tx(conn, self.db)
                tx.group = self
                try:
                    work.send(tx)
                except Exception as e:  # noqa: BLE001 - its own (node not ours, not registered): raised at its turn
                    if refused(e):
                        raise
        self._sending = False
        for job, n in self._asks.items():
            self._pools[job] = _Pool(self.db, job, n)

    def _claim(self, node_id: str, attempt_ids: list[str]) -> bool:
        fresh = node_id not in self._nodes and self._attempts.isdisjoint(attempt_ids)
        self._nodes.add(node_id)
        self._attempts.update(attempt_ids)
        return fresh

    def ask(self, job: str, n: int) -> Callable[[int], Queued]:
        """A beat's lease of up to `n` items of `job`: read with the others' (`send`), dealt at its turn. Asked at
        its turn (not sent ahead), it is dealt from the same items, read now if no beat before it asked."""
        if self._sending:
            self._asks[job] = self._asks.get(job, 0) + n
            return lambda want: self._pools[job].deal(want)
        if job not in self._pools:
            self._pools[job] = _Pool(self.db, job, n)
        return self._pools[job].deal

    def granted(self, job: str, ids: Iterable[int]) -> None:
        """Items of `job` granted by any call of the group: not dealt again."""
        pool = self._pools.get(job)
        if pool is not None:
            pool.taken.update(ids)

    def end(self, error: BaseException | None = None) -> None:
        """Sync the pipeline (a statement the server refused raises here), or drop it after `error`. What was read
        ahead is stale from now on: the calls after read at their turn."""
        if self.piped:
            self.piped, self.stale = False, True
            if error is None:
                self._pipe.close()
            else:
                self._pipe.__exit__(type(error), error, error.__traceback__)


class _Pool:
    """A job's queued items for the group's beats: the first `limit` at the group's start, locked for it (skipping
    those another replica is granting), dealt in order; past them, read at the caller's turn."""

    def __init__(self, db: Any, job: str, limit: int) -> None:
        self.db, self.job, self.limit = db, job, limit
        self._read: Callable[[], Queued] | None = hot_sql.queued_ahead(db, job, limit)
        self._rows: list[tuple] = []
        self._next = 0  # the rows before it are dealt
        self._after, self._more = 0, True  # the last id read; whether more may be queued past it
        self.tasks: dict[int, str] = {}
        self.taken: set[int] = set()  # dealt, or granted by a call that read its own

    def deal(self, want: int) -> Queued:
        if self._read is not None:
            self._take(self._read, self.limit)
            self._read = None
        rows = self._deal(want)
        if len(rows) < want and self._more:
            self._take(hot_sql.queued_ahead(self.db, self.job, want - len(rows), after=self._after), want - len(rows))
            rows += self._deal(want - len(rows))
        return rows, self.tasks

    def _take(self, read: Callable[[], Queued], limit: int) -> None:
        rows, tasks = read()
        self._rows += rows
        self.tasks.update(tasks)
        self._more = len(rows) == limit
        if rows:
            self._after = rows[-1][0]

    def _deal(self, want: int) -> list[tuple]:
        out = []
        while len(out) < want and self._next < len(self._rows):
            row = self._rows[self._next]
            self._next += 1
            if row[0] not in self.taken:
                out.append(row)
                self.taken.add(row[0])
        return out
