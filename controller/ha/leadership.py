"""Leader election for controller replicas on one database: a lease row (holder, epoch, expiry), renewed by the
leader from a thread of its own, and a fence on every commit of the leader's store (the epoch checked in the
same transaction). Used by `replicas.py` (the replica's switch from follower to leader); next step: there.

The bound: a leader renews every RENEW_SECONDS a lease of LEASE_SECONDS; a follower tries every RENEW_SECONDS.
When the leader dies (kill -9, its machine, its database connection) the row expires at most LEASE_SECONDS after
its last renewal and a follower takes it within RENEW_SECONDS after that: ≤ LEASE_SECONDS + RENEW_SECONDS = 6 s,
then the new leader builds its scheduler from the database (as a restarted controller does, ~1 s). A paused
leader (SIGSTOP) that wakes after losing the row commits nothing more: each commit of its store reads the row's
epoch inside the transaction (SQLite: the write lock is held from the first write to the commit; PostgreSQL:
`FOR SHARE` makes a concurrent take-over wait) and is rolled back unless the epoch is still its own; then the
process exits (EXIT_LOST), as Kubernetes controllers do, to be restarted as a follower by its supervisor. A lease
that ran out while its holder's transaction on the row stays open (paused between its fence and its commit) is not
waited for: the follower ends the holder's database sessions (`replica_tables.end_sessions`) and takes it next try;
once taken, the old holder's sessions are ended too, so no row a paused old leader locked holds the new one's writes.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from sqlalchemy import event
from sqlalchemy.engine import Engine

from ..errors import ServiceUnavailable
from ..store.replica_tables import SESSION, end_sessions

log = logging.getLogger("rolloutd.leadership")

LEASE_SECONDS = 5.0
RENEW_SECONDS = 1.0
EXIT_LOST = 3  # the process's exit status when it lost the lease (its supervisor restarts it as a follower)

class Fenced(ServiceUnavailable):
    """A leader-only write refused: another replica holds the leader lease now (a caller gets 503: retry elsewhere)."""


def _pg(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def _now(conn, pg: bool) -> float:
    """The clock leases are measured with: the database server's on PostgreSQL (replicas on several machines
    share it), this machine's on SQLite (its replicas share the machine)."""
    if pg:
        return float(conn.exec_driver_sql("SELECT extract(epoch from clock_timestamp())").scalar())
    return time.time()


def holder_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def current(engine: Engine) -> tuple[str, int, float, str]:
    """(holder, epoch, expires, url) of the lease row."""
    with engine.connect() as c:
        row = c.exec_driver_sql("SELECT holder, epoch, expires, url FROM leader_lease WHERE id = 1").first()
    return tuple(row) if row else ("", 0, 0.0, "")  # type: ignore[return-value]


class Leadership:
    """This replica's side of the lease. `run` (a thread) tries to take it until it does, calls `on_elected(epoch)`,
    then renews it; when a renewal finds the row taken (or the lease ran out while the database could not be
    reached) it calls `on_lost(reason)` — once, never returning to lead in this process."""

    def __init__(self, engine: Engine, url: str, *, lease_seconds: float = LEASE_SECONDS,
                 renew_seconds: float = RENEW_SECONDS, holder: str | None = None, session: str = SESSION) -> None:
        self.engine, self.url, self.lease, self.every = engine, url, lease_seconds, renew_seconds
        self.session = session  # the application_name of `engine`'s connections (PostgreSQL: the lease names it)
        self.holder = holder or holder_id()
        self.epoch: int | None = None  # ours while we lead
        self.pg = _pg(engine)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self.on_elected: Callable[[int], None] = lambda epoch: None
        self.on_lost: Callable[[str], None] = lambda reason: None  # the row is the store's (its schema version 4)

    # ------------------------------------------------------------ the row

    def try_take(self) -> int | None:
        """Take the row if it ran out (or was never held): the new epoch, else None. On PostgreSQL a row that ran
        out but is locked (its holder paused in a transaction) is not waited for: the holder's sessions are ended,
        as they are once the lease is taken (what a paused old leader locked is not waited for either)."""
        if not self.pg:
            with self.engine.begin() as c:
                now = _now(c, False)
                n = c.exec_driver_sql("UPDATE leader_lease SET holder = ?, epoch = epoch + 1, expires = ?, url = ? "
                                      "WHERE id = 1 AND expires < ?",
                                      (self.holder, now + self.lease, self.url, now)).rowcount
                return int(c.exec_driver_sql("SELECT epoch FROM leader_lease WHERE id = 1").scalar()) if n else None
        with self.engine.begin() as c:
            now = _now(c, True)
            expires, session = c.exec_driver_sql("SELECT expires, session FROM leader_lease WHERE id = 1").one()
            if expires >= now:
                return None
            taken = c.exec_driver_sql("SELECT 1 FROM leader_lease WHERE id = 1 AND expires < %s FOR UPDATE SKIP LOCKED",
                                      (now,)).first() is not None
            if taken:
                epoch = int(c.exec_driver_sql(
                    "UPDATE leader_lease SET holder = %s, epoch = epoch + 1, expires = %s, url = %s, session = %s "
                    "WHERE id = 1 RETURNING epoch", (self.holder, now + self.lease, self.url, self.session)).scalar())
        # taken: the old leader's sessions ended too (fenced already, a paused one's locks would hold our writes)
        end_sessions(self.engine, session, "the leader lease was taken from it" if taken else
                     "the leader lease ran out with its row locked")
        return epoch if taken else None

    def renew(self) -> bool:
        """Extend our lease; False when the row is no longer ours (taken after it ran out)."""
        with self.engine.begin() as c:
            now = _now(c, self.pg)
            return c.exec_driver_sql(
                "UPDATE leader_lease SET expires = %s WHERE id = 1 AND epoch = %s AND holder = %s" if self.pg else
                "UPDATE leader_lease SET expires = ? WHERE id = 1 AND epoch = ? AND holder = ?",
                (now + self.lease, self.epoch, self.holder)).rowcount == 1

    def resign(self) -> None:
        """A graceful stop: the row runs out now, so a follower takes it at its next try instead of LEASE_SECONDS on."""
        if self.epoch is None:
            return
        try:
            with self.engine.begin() as c:
                c.exec_driver_sql("UPDATE leader_lease SET expires = 0 WHERE id = 1 AND epoch = %s" if self.pg else
                                  "UPDATE leader_lease SET expires = 0 WHERE id = 1 AND epoch = ?", (self.epoch,))
        except Exception as e:  # noqa: BLE001 - the lease runs out on its own
            log.warning("could not hand the leader lease back: %s", e)

    # ------------------------------------------------------------ the loop

    def start(self) -> "Leadership":
        threading.Thread(target=self.run, name="leadership", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set() and self.epoch is None:
            try:
                self.epoch = self.try_take()
            except Exception as e:  # noqa: BLE001 - the database away: try again
                log.warning("leader lease: %s", e)
            if self.epoch is None:
                self._stop.wait(self.every)
        if self.epoch is None:
            return
        log.info("leading (epoch %d, holder %s)", self.epoch, self.holder)
        self.on_elected(self.epoch)
        renewed = time.monotonic()
        while not self._stop.wait(self.every):
            try:
                if not self.renew():
                    return self.lose("the leader lease was taken by another replica")
                renewed = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the database away: another replica may lead once it runs out
                if time.monotonic() - renewed >= self.lease:
                    return self.lose(f"the leader lease could not be renewed for {self.lease:g} s: {e}")
                log.warning("leader lease renewal failed: %s", e)

    def lose(self, reason: str) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        log.critical("stepping down: %s", reason)
        self.on_lost(reason)

    # ------------------------------------------------------------ the fence

    def fence(self, engine: Engine) -> None:
        """Every commit on `engine` first checks, in its transaction, that the lease's epoch is still ours; one that
        is not is rolled back and raises `Fenced` (and this replica steps down)."""
        sql = "SELECT epoch FROM leader_lease WHERE id = 1" + (" FOR SHARE" if _pg(engine) else "")

        @event.listens_for(engine, "commit")
        def _check(conn) -> None:  # noqa: ANN001
            cur = conn.connection.cursor()
            try:
                cur.execute(sql)
                row = cur.fetchone()
            finally:
                cur.close()
            if row is None or self.epoch is None or int(row[0]) != self.epoch:
                conn.connection.dbapi_connection.rollback()
                self.lose(f"a write was fenced off: the lease's epoch is {row and row[0]}, ours {self.epoch}")
                raise Fenced(f"not the leader any more (epoch {self.epoch}, the lease's {row and row[0]})")
