"""The store's database and its watch side: SQLite (WAL; a path) or PostgreSQL (a URL, `dialects.py`) with its
schema version, watchers' wake-ups, the change log (each row's id is a resourceVersion) and the events.

`store.Store` builds RolloutJobs' reads and writes on it; `kube/watch.py` reads the change log.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import event, func
from sqlmodel import Session, SQLModel, create_engine, select

from rolloutd.crds.errors import ConfigurationError

from .. import dialects
from . import nul_text
from .durability import Durable
from .replica_tables import SESSION
from ..errors import Gone
from .schema import (MIGRATIONS, SCHEMA_VERSION, Change, ChangeRow, EventRow, SchemaVersionRow, seed, timestamp,
                           utcnow)


# Per connection: a page cache that holds the node protocol's working set at a thousand nodes (the items and
# their indexes, ~100 MB of database), and the file mapped so a page missing from it costs no read call.
CACHE_KIB = 64 << 10
MMAP_BYTES = 1 << 30
# SQLite checkpoints the WAL inside the commit that grows it past this many pages (default 1000): a quarter of that
# makes each such stall of a node call's commit a quarter as long (the benchmarks page, Constants)
AUTOCHECKPOINT_PAGES = 250
MIGRATION_LOCK = 0x726F6C6C  # PostgreSQL advisory lock key held while a controller migrates ("roll")
PG_OLDEST = (14,)  # `pg_terminate_backend(pid, timeout)` (`replica_tables.end_sessions`); 13 is out of support
EVENTS_PER_JOB = 500  # a job's newest events kept (`add_event`); older ones go as new ones come


class SchemaTooNew(ConfigurationError, RuntimeError):
    """The database was moved forward by a newer rolloutd: this one stops rather than write rows it cannot read."""


class ServerTooOld(ConfigurationError, RuntimeError):
    """The PostgreSQL server is older than the oldest this rolloutd uses features of (`PG_OLDEST`)."""


class StoreDB:
    """Thread-safe; one writer at a time (a lock), readers concurrent thanks to WAL."""

    def __init__(self, path: Path | str, *, home: Path | None = None):
        """`path`: the SQLite file, or a `postgresql://` URL (`dialects.is_url`); `home`: where files beside the
        store go (the SQLite file's folder unless given; none for a server without one)."""
        self.url = str(path) if dialects.is_url(path) else None
        self.path = None if self.url else Path(path)
        self.home = home if home is not None or self.path is None else self.path.parent
        self.autocheckpoint = AUTOCHECKPOINT_PAGES  # pages of WAL past which a commit checkpoints (`checkpoint_aside`)
        self.engine = self._pg_engine(self.url) if self.url else self._sqlite_engine(self.path)
        self.dialect = self.engine.dialect.name
        self.where = dialects.redacted(self.url) if self.url else str(self.path)  # for messages
        self.durable = Durable(self.path)  # commits are written, not synced: `settle()` before promising one

        self._lock = threading.RLock()
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._marks: dict[str, int] = {}  # job key → its writes and events so far, in this process (`mark_of`)
        self._listener = None  # PostgreSQL: the thread hearing other processes' writes (`listen`)
        self._migrate()

    def _sqlite_engine(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            f"sqlite:///{path}", connect_args={"check_same_thread": False, "timeout": 30},
            # LIFO: the event loop's calls, one after another, reuse the connection the last one returned, whose
            # page cache is warm (a FIFO pool rotates them, and each starts cold: ~90 page reads per node call)
            pool_use_lifo=True,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit is written, synced at the next checkpoint; what the API acknowledges is synced
            # first (`durability.Durable`): the node protocol's beats and leases pay no fsync each
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            cur.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            cur.execute(f"PRAGMA wal_autocheckpoint={self.autocheckpoint}")
            cur.close()
        return engine

    @staticmethod
    def _pg_engine(url: str):
        try:
            import psycopg  # noqa: F401 - the [postgresql] extra
        except ImportError:
            raise ImportError("a postgresql:// store needs psycopg 3: pip install 'rolloutd[postgresql]'") from None
        # times stored without a zone are UTC whatever the server's default; LIFO as above (a warm backend); no
        # pre-ping (a round trip per checkout; the benchmarks page, Constants): a connection the server dropped fails
        # the call that used it, and SQLAlchemy then replaces every pooled one. Named by this process's SESSION (what
        # a replica taking over from this one ends, `replica_tables.end_sessions`); a transaction left idle by a paused
        # process ended by the server (`dialects.IDLE_IN_TRANSACTION_SECONDS`); text with a NUL stored (`nul_text`)
        options = f"-c timezone=UTC -c idle_in_transaction_session_timeout={dialects.IDLE_IN_TRANSACTION_SECONDS}s"
        engine = create_engine(dialects.engine_url(url), pool_size=dialects.PG_POOL,
                               max_overflow=dialects.PG_OVERFLOW, pool_use_lifo=True, pool_pre_ping=False,
                               connect_args={"application_name": SESSION, "options": options})
        event.listen(engine, "connect", lambda dbapi_conn, _record: nul_text.install(dbapi_conn))  # NUL in text
        return engine

    # ------------------------------------------------------------ schema

    def _migrate(self) -> None:
        """Create what is missing and move an older schema forward; refuse a newer one. On PostgreSQL under a
        transaction-scoped advisory lock: controllers starting together migrate one after another."""
        with self.engine.begin() as conn:
            if self.dialect == dialects.POSTGRESQL:
                if conn.dialect.server_version_info[:1] < PG_OLDEST:
                    raise ServerTooOld(f"the PostgreSQL server of {self.where} runs version "
                                       f"{'.'.join(map(str, conn.dialect.server_version_info))}; rolloutd needs "
                                       f"{PG_OLDEST[0]} or newer")
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            SQLModel.metadata.create_all(conn)
            s = Session(bind=conn)
            row = s.get(SchemaVersionRow, 1)
            if row is None:
                s.add(SchemaVersionRow(id=1, version=SCHEMA_VERSION))
                seed(s)
            elif row.version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"database {self.where} has schema version {row.version}, newer than this "
                    f"rolloutd ({SCHEMA_VERSION}); upgrade rolloutd (it refuses to write a schema it does not know)"
                )
            else:
                while row.version < SCHEMA_VERSION:
                    MIGRATIONS[row.version](s)
                    row.version += 1
                    s.add(row)
            s.flush()
            s.close()

    def schema_version(self) -> int:
        with Session(self.engine) as s:
            return s.get(SchemaVersionRow, 1).version

    def checkpoint_aside(self, backstop_pages: int) -> None:
        """A thread copies the WAL back now (`wal_checkpoints.Checkpointer`): commits checkpoint only past
        `backstop_pages`. The pooled connections are replaced (the setting is per connection, set when one opens)."""
        if self.dialect != dialects.SQLITE:
            return
        self.autocheckpoint = backstop_pages
        self.engine.dispose()

    # ------------------------------------------------------------ notifications

    def listen(self) -> None:
        """On PostgreSQL: hear the other processes' job writes (`listen.py`); once, from the server."""
        if self.url is not None and self._listener is None:
            from .listen import Listener

            conninfo = dialects.engine_url(self.url).replace("postgresql+psycopg://", "postgresql://", 1)
            heard = lambda key: self.changed_elsewhere(None if key is None else [key])  # noqa: E731
            self._listener = Listener(conninfo, heard).start()

    def changed_elsewhere(self, keys: Iterable[str] | None) -> None:
        """Another process wrote the jobs `keys` (None: perhaps any, while we were not listening): marked, and the
        watchers woken, as after a write of our own, without announcing it. Told by `listen.py` and `change_poll.py`."""
        with self._lock:
            for key in (self._marks.keys() if keys is None else keys):
                self._marks[key] = self._marks.get(key, 0) + 1
        self._notify()

    def _announce(self, key: str) -> None:
        if self.url is not None:
            from .listen import announce

            announce(self.engine, key)

    def subscribe(self) -> asyncio.Event:
        ev = asyncio.Event()
        self._listeners.add((asyncio.get_running_loop(), ev))
        return ev

    def unsubscribe(self, ev: asyncio.Event) -> None:
        self._listeners = {(lp, e) for lp, e in self._listeners if e is not ev}

    def _notify(self) -> None:
        for loop, ev in list(self._listeners):
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed
                self._listeners.discard((loop, ev))

    # ------------------------------------------------------------ the change log and events

    def current_rv(self) -> int:
        with Session(self.engine) as s:
            return s.exec(select(func.max(ChangeRow.rv))).one() or 0

    def changes_since(self, rv: int, name: str | None = None, limit: int = 500) -> list[Change]:
        """The changes after `rv` (of one job when `name`, a `job_key`, is given)."""
        with Session(self.engine) as s:
            oldest = s.exec(select(func.min(ChangeRow.rv))).one()
            if oldest is not None and rv < oldest - 1:
                raise Gone(f"resourceVersion {rv} is too old (oldest kept: {oldest}); list again and watch from there")
            q = select(ChangeRow).where(ChangeRow.rv > dialects.int64(rv))
            if name:
                q = q.where(ChangeRow.name == name)
            rows = s.exec(q.order_by(ChangeRow.rv).limit(limit)).all()
        return [Change(r.rv, r.type, r.name, json.loads(r.object)) for r in rows]

    def change_before(self, name: str, rv: int) -> Change | None:
        """The last change of job `name` at or before `rv` (None when the kept log has none)."""
        with Session(self.engine) as s:
            r = s.exec(select(ChangeRow).where(ChangeRow.name == name, ChangeRow.rv <= dialects.int64(rv))
                       .order_by(ChangeRow.rv.desc()).limit(1)).first()
        return None if r is None else Change(r.rv, r.type, r.name, json.loads(r.object))

    def events(self, key: str, last: int | None = None) -> list[dict[str, Any]]:
        """The job's events in order; with `last`, only the newest `last` of them."""
        with Session(self.engine) as s:
            q = select(EventRow).where(EventRow.name == key).order_by(EventRow.id.desc())
            rows = s.exec(q if last is None else q.limit(last)).all()
        return [{"time": timestamp(r.time), "type": r.type, "reason": r.reason, "message": r.message}
                for r in reversed(rows)]

    def mark_of(self, key: str) -> int:
        """A count that moves whenever the job's row or its events change after a commit (in memory, this process):
        read before the job, it tells a reader whether what it read then is still current."""
        return self._marks.get(key, 0)

    def _mark(self, key: str) -> None:
        with self._lock:
            self._marks[key] = self._marks.get(key, 0) + 1

    def event_records(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        """Events with their id and job key (the core/v1 Event view builds on these)."""
        with Session(self.engine) as s:
            q = select(EventRow)
            if names is not None:
                q = q.where(EventRow.name.in_(names))
            rows = s.exec(q.order_by(EventRow.id)).all()
        return [{"id": r.id, "name": r.name, "time": timestamp(r.time), "type": r.type, "reason": r.reason,
                 "message": r.message} for r in rows]

    def add_event(self, key: str, reason: str, message: str, type_: str = "Normal") -> None:
        """Append an event; a job keeps its newest EVENTS_PER_JOB (whoever posts them, the table stays bounded)."""
        with self._lock, Session(self.engine) as s:
            s.add(EventRow(name=key, time=utcnow(), type=type_, reason=reason, message=message))
            s.flush()
            oldest_kept = s.exec(select(EventRow.id).where(EventRow.name == key).order_by(EventRow.id.desc())
                                 .offset(EVENTS_PER_JOB - 1).limit(1)).first()
            if oldest_kept is not None:
                s.exec(EventRow.__table__.delete().where(EventRow.name == key, EventRow.id < oldest_kept))
            s.commit()
        self._mark(key)
