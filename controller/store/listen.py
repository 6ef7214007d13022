"""Watch wake-ups across processes on a PostgreSQL store: a job's write is announced with NOTIFY on CHANNEL (its
key as the payload) and every controller on the database LISTENs on a connection of its own, in a thread.

`store.Store` announces after each committed job write (`announce`) and starts a `Listener` when the API serves
watches (`StoreDB.listen`); a heard key drops that job from the process's cache and wakes its watchers, as a write
of its own would. SQLite has one process per file: nothing to announce. Next step: the trajectory feed's
wake-ups (`work/feed.py`) for trainer streams served by another replica.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from sqlalchemy.engine import Engine

log = logging.getLogger("rolloutd.store")
CHANNEL = "rolloutd_changes"
RETRY_SECONDS = 1.0


def announce(engine: Engine, key: str) -> None:
    """NOTIFY the other processes that job `key` changed (one statement, committed at once)."""
    with engine.connect() as c:
        c.exec_driver_sql("SELECT pg_notify(%(channel)s, %(key)s)", {"channel": CHANNEL, "key": key})
        c.commit()


class Listener:
    """A thread LISTENing on CHANNEL (reconnecting after a lost connection); `heard(key)` runs for every
    notification, `heard(None)` after a reconnection (anything may have changed meanwhile)."""

    def __init__(self, conninfo: str, heard: Callable[[str | None], None]) -> None:
        self.conninfo, self.heard = conninfo, heard
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once LISTEN holds (a test waits for it before writing elsewhere)
        self._thread = threading.Thread(target=self._run, name="store-listen", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import psycopg

        first = True
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if not first:
                        self.heard(None)
                    first = False
                    self.ready.set()
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0):
                            self.heard(n.payload)
            except psycopg.Error as e:
                log.warning("listening for other controllers' changes: %s (again in %.0f s)", e, RETRY_SECONDS)
                self.ready.clear()
                time.sleep(RETRY_SECONDS)
