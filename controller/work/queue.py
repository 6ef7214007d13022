"""The item state machine: add, back to the queue, cancel, finish, each written here once.

`attempts` grants leases (a bulk UPDATE on the hot path), extends them and applies an attempt's outcome.

An item is `queued` → `leased` (to one attempt of one node daemon, with a deadline that heartbeats
extend in memory, see `held_leases`) → `done` | `failed` | `cancelled`. A lease that expires or fails for
infrastructure reasons goes back to the queue with attempt+1, until `pipeline.maxAttempts`. All methods run on
the event loop inside the caller's short SQLite transaction, so nothing locks between them.
"""
from __future__ import annotations

import sqlite3
from collections import Counter
from typing import Any, Callable, Iterable

from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from .backends import BackendPool
from .job_state import Wakeups
from .hot_sql import LIVE_SQL, Item, in_list
from .held_leases import HeldLease, HeldLeases
from .states import LIVE, ItemState
from .tables import ItemRow

_ADD_ITEMS = ("WITH RECURSIVE n(sample) AS (SELECT 0 UNION ALL SELECT sample + 1 FROM n WHERE sample + 1 < ?) "
              "INSERT INTO items (job, prompt, sample, state, attempt, holds_backend, queued_at, last_error, group_id) "
              "SELECT g.job, g.prompt, n.sample, ?, 0, FALSE, ?, '', g.id FROM groups AS g CROSS JOIN n WHERE g.id IN ")


class ItemQueue:
    def __init__(self, engine: Engine, pool: BackendPool, clock: Callable[[], float], changed: Wakeups,
                 stall_seconds: float | None = None) -> None:
        self.engine, self.pool, self.clock = engine, pool, clock
        self.changed = changed  # set when a job's queue changed: a waiting lease looks again
        self.leases = HeldLeases(clock, stall_seconds)  # the leases held now, in memory: what beats read and renew
        # since the controller started, all jobs together (the metrics, `collectors.py`): attempts run again after a
        # failed one, rollouts delivered infra-failed (masked: no reward), live rollouts cancelled on their nodes
        self.totals: Counter[str] = Counter({"retries": 0, "masked": 0, "cleanups": 0})
        self.stopped = False
        with Session(self.engine, expire_on_commit=False) as s:  # restore backend pins after a restart
            for item in s.exec(select(ItemRow).where(ItemRow.holds_backend == True)):  # noqa: E712
                self.pool.take(item.backend, item.job)

    def wake(self, job: str) -> None:
        self.changed.set(job)

    def add_groups_items(self, db: Any, group_ids: list[int], samples: int, now: float) -> None:
        """Queue the `samples` items of each of these batch groups (rows of `groups`): one INSERT … SELECT over the
        groups × a recursive series of sample numbers, in group then sample order (the order leases take them), on
        the transaction's plain connection (`dialects.raw`, either database). No Python object is made per item
        (issue 36: the fill thread's Python work held the GIL the event loop needs)."""
        if group_ids and samples > 0:
            db.execute(_ADD_ITEMS + in_list(len(group_ids)) + " ORDER BY g.id, n.sample",
                       (samples, ItemState.queued, now, *group_ids))

    def release(self, item: ItemRow | Item | HeldLease) -> None:
        """The item's task no longer counts on its backend (it left RUN or its attempt ended). The slot is the held
        lease's in memory, which took it: a database row may still say it holds one that memory gave back already
        (its ending was rolled back and comes again) or never took (its node is another replica's)."""
        held = item if isinstance(item, HeldLease) else self.leases.get(item.attempt_id)
        if held is not None and held.holds_backend:
            self.pool.release(held.backend, held.job)
            held.holds_backend = False
        item.holds_backend = False

    def forget_held(self, attempt_ids: Iterable[str]) -> None:
        """Held leases forgotten in memory, their backend slots given back; the database is not touched: their grant
        rolled back (`Attempts.lease_now`'s undo, the expiry), or their node served by another replica now
        (`ha.serving.Serving.drop`)."""
        for aid in attempt_ids:
            if (held := self.leases.get(aid)) is not None:
                self.release(held)
                self.leases.forget(aid)

    def requeue(self, item: ItemRow | Item, reason: str, max_attempts: int | None = None, keep_attempt: bool = False) -> str:
        """Back to the queue, or failed (infra) once `max_attempts` are used up. Returns the new state.
        `keep_attempt`: the attempt was not the rollout's fault (given back unstarted, or the
        backend's outage): it is not counted."""
        self.release(item)
        self.leases.forget(item.attempt_id)
        item.last_error = reason
        item.node_id, item.deadline, item.stage = None, None, None
        if keep_attempt:
            item.attempt = max(item.attempt - 1, 0)
        if max_attempts is not None and item.attempt >= max_attempts:
            item.state = ItemState.failed
            self.totals["masked"] += 1
        else:
            self.totals["retries"] += not keep_attempt
            item.state, item.attempt_id, item.backend = ItemState.queued, None, None
            item.queued_at = self.clock()
        return item.state

    def finish(self, item: ItemRow | Item, state: ItemState) -> None:
        """The attempt's result is final: done, or failed (a configuration error)."""
        self.release(item)
        self.leases.forget(item.attempt_id)
        item.state, item.stage, item.deadline = state, None, None

    def cancel_item(self, item: ItemRow) -> None:
        """Cancelled (a deleted or failed job, a surplus group); daemons learn it at their next beat."""
        self.release(item)
        self.leases.forget(item.attempt_id)
        self.totals["cleanups"] += item.state == ItemState.leased
        item.state, item.deadline = ItemState.cancelled, None

    def cancel_live(self, s: Session, job: str) -> None:
        """Cancel every live item of `job`."""
        for item in s.exec(select(ItemRow).where(ItemRow.job == job, ItemRow.state.in_(LIVE))):
            self.cancel_item(item)
            s.add(item)

    def count_queued(self, db: sqlite3.Connection, job: str, at_most: int) -> int:
        """The job's queued items, counted up to `at_most` (reads at most that many index entries)."""
        return db.execute("SELECT count(*) FROM (SELECT 1 FROM items WHERE job = ? AND state = ? LIMIT ?) AS q",
                          (job, ItemState.queued.value, at_most)).fetchone()[0]

    def count_live(self, db: sqlite3.Connection, job: str, at_most: int) -> int:
        """The job's live items, counted up to `at_most` (reads at most that many index entries)."""
        return db.execute(f"SELECT count(*) FROM (SELECT 1 FROM items WHERE job = ? AND state IN {LIVE_SQL} LIMIT ?) AS live",
                          (job, at_most)).fetchone()[0]

    def counts(self, job: str) -> dict[str, int]:
        """State → the job's items (from the (job, state) index alone: no row is read)."""
        with Session(self.engine, expire_on_commit=False) as s:
            q = select(ItemRow.state, func.count()).where(ItemRow.job == job).group_by(ItemRow.state)
            return {state: n for state, n in s.exec(q)}
