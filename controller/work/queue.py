"""The item state machine: add, back to the queue, cancel, finish, each written here once.

`attempts` grants leases (a bulk UPDATE on the hot path), extends them and applies an attempt's outcome.

An item is `queued` → `leased` (to one attempt of one node daemon, with a deadline that heartbeats
extend in memory, see `live`) → `done` | `failed` | `cancelled`. A lease that expires or fails for infrastructure
reasons goes back to the queue with attempt+1, until `pipeline.maxAttempts`. All methods run on
the event loop inside the caller's short SQLite transaction, so nothing locks between them.
"""
from __future__ import annotations

import sqlite3
from collections import Counter
from typing import Callable

from sqlalchemy import func, insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from .backends import BackendPool
from .job_state import Wakeups
from .hot_sql import LIVE_SQL, Item
from .held_leases import HeldLease, HeldLeases
from .states import LIVE, ItemState
from .tables import ItemRow


class ItemQueue:
    def __init__(self, engine: Engine, pool: BackendPool, clock: Callable[[], float], changed: Wakeups,
                 stall_seconds: float | None = None) -> None:
        self.engine, self.pool, self.clock = engine, pool, clock
        self.changed = changed  # set when a job's queue changed: a waiting lease looks again
        self.leases = HeldLeases(clock, stall_seconds)  # the leases held now, in memory: what beats read and renew
        # since the controller started, all jobs together (the metrics, `api.py`): attempts run again after a
        # failed one, rollouts delivered infra-failed (masked: no reward), live rollouts cancelled on their nodes
        self.totals: Counter[str] = Counter({"retries": 0, "masked": 0, "cleanups": 0})
        self.stopped = False
        with Session(self.engine, expire_on_commit=False) as s:  # restore backend pins after a restart
            for item in s.exec(select(ItemRow).where(ItemRow.holds_backend == True)):  # noqa: E712
                self.pool.take(item.backend, item.job)

    def wake(self, job: str) -> None:
        self.changed.set(job)

    def add_items(self, s: Session, job: str, prompt: int, group_id: int, samples: int, now: float) -> None:
        """Queue the `samples` items of one batch group: one row built, inserted `samples` times in one statement
        (a model object per row cost ~0.6 ms of the event loop each)."""
        row = ItemRow(job=job, prompt=prompt, sample=0, queued_at=now, group_id=group_id)
        base = {c.name: getattr(row, c.name) for c in ItemRow.__table__.columns if c.name != "id"}
        s.execute(insert(ItemRow.__table__), [{**base, "sample": k} for k in range(samples)])

    def release(self, item: ItemRow | Item | HeldLease) -> None:
        """The item's task no longer counts on its backend (it left RUN or its attempt ended)."""
        if item.holds_backend:
            self.pool.release(item.backend, item.job)
            item.holds_backend = False

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

    def count_live(self, db: sqlite3.Connection, job: str, at_most: int) -> int:
        """The job's live items, counted up to `at_most` (reads at most that many index entries)."""
        return db.execute(f"SELECT count(*) FROM (SELECT 1 FROM items WHERE job = ? AND state IN {LIVE_SQL} LIMIT ?) AS live",
                          (job, at_most)).fetchone()[0]

    def counts(self, job: str) -> dict[str, int]:
        """State → the job's items (from the (job, state) index alone: no row is read)."""
        with Session(self.engine, expire_on_commit=False) as s:
            q = select(ItemRow.state, func.count()).where(ItemRow.job == job).group_by(ItemRow.state)
            return {state: n for state, n in s.exec(q)}
