"""The store's disk as a fault the API names: a full or read-only filesystem, the store file removed or replaced.

`api.py` asks `StorageWatch.problem()` for /readyz, `middleware.py` asks `lost()` before serving (a controller whose
store file was removed stops serving: it would write into an unlinked file and lose it at the next start); a request
that fails on the disk answers 503 with the reason and Retry-After (`storage_reason` tells such an error from a bug).
`opening_problem` words a store that cannot be opened at start. On PostgreSQL there is no file to watch: a server
that cannot be reached (refused, shut down, connection lost) is the fault named instead. Next step: none planned.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from pathlib import Path

log = logging.getLogger("rolloutd.storage")
MIN_FREE_BYTES = 1 << 20  # less free space than this in the data dir: not ready (SQLite's next page may not fit)
RECENT_SECONDS = 5.0      # a write failed on the disk this recently: not ready, even if a probe looks fine now
RETRY_AFTER_SECONDS = 5
PROBE_EVERY = 1.0         # the data dir's write probe runs at most this often (`StorageWatch.problem`)
_SQLITE_STORAGE = ("database or disk is full", "readonly database", "disk i/o error", "unable to open database file",
                   "locking protocol")
_OS_STORAGE = (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT)


def storage_reason(exc: BaseException) -> str | None:
    """Why `exc` is the disk's fault, not a bug (None: it is not a storage error)."""
    orig = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
    if isinstance(orig, sqlite3.OperationalError) and any(s in str(orig).lower() for s in _SQLITE_STORAGE):
        return f"the store cannot be written: {orig}"
    if _pg_unreachable(orig):
        return f"the database server cannot be reached: {str(orig).strip().splitlines()[0] if str(orig) else orig!r}"
    if isinstance(orig, OSError) and orig.errno in _OS_STORAGE:
        return f"the data dir cannot be written: {orig.strerror or orig}"
    return None


# libpq's refusals of a statement before it is sent: like a lost connection's, they carry no SQLSTATE, but the
# connection is fine (read as an outage, a request could make the controller not ready: /readyz, for every tenant)
_PG_STATEMENT_REFUSED = ("number of parameters must be between",)


def _pg_unreachable(exc: BaseException) -> bool:
    """psycopg's errors of a connection (not of a statement): the server is down, restarting or out of reach."""
    try:
        import psycopg
    except ImportError:  # the [postgresql] extra is not installed: no PostgreSQL store either
        return False
    if not isinstance(exc, psycopg.OperationalError) or any(s in str(exc) for s in _PG_STATEMENT_REFUSED):
        return False
    return (isinstance(exc, (psycopg.errors.AdminShutdown, psycopg.errors.CannotConnectNow)) or exc.sqlstate is None
            or exc.sqlstate.startswith("08"))


def opening_problem(path: Path | str, exc: BaseException) -> str:
    """The message for a store that cannot be opened at start: which file (or server), and what to do."""
    if isinstance(path, str) and "://" in path:
        return (f"cannot open the store {path}: {getattr(exc, 'orig', None) or exc}. Check the URL, that the server "
                "runs and that its user may create tables in the database (see Operations: PostgreSQL)")
    return (f"cannot open the store {path}: {getattr(exc, 'orig', None) or exc}. If the file is damaged, stop here "
            "and restore it from a backup (see Operations: Backups); do not delete it, the jobs and trajectories "
            "are in it")


class StorageWatch:
    """The store file as opened (device and inode) and the data dir's state; `failed(reason)` records a write that
    failed on the disk."""

    def __init__(self, db: Path | None) -> None:
        """`db`: the SQLite file; None for a server's store (only the writes that failed are watched)."""
        self.db = None if db is None else Path(db)
        st = None if db is None else os.stat(self.db)
        self._identity = st and (st.st_dev, st.st_ino)
        self._failed: tuple[float, str] | None = None
        self._checked, self._lost = 0.0, None
        self._probed: tuple[float, str | None] = (float("-inf"), None)

    def failed(self, reason: str) -> None:
        self._failed = (time.monotonic(), reason)

    def lost(self, every: float = 1.0) -> str | None:
        """The store file was removed or replaced since it was opened (checked at most every `every` s; once
        lost, lost for good)."""
        now = time.monotonic()
        if self.db is not None and self._lost is None and now - self._checked >= every:
            self._checked = now
            try:
                st = os.stat(self.db)
            except FileNotFoundError:
                self._lost = f"the store file {self.db.name} was removed while the controller ran"
            else:
                if (st.st_dev, st.st_ino) != self._identity:
                    self._lost = f"the store file {self.db.name} was replaced while the controller ran"
            if self._lost is not None:
                log.critical("%s (%s)", self._lost, self.db)
                self._lost += ("; nothing written since can be read back, so the controller stopped serving: put the "
                               "store back (or restore it from a backup) and restart the controller")
        return self._lost

    def problem(self) -> str | None:
        """Why the controller cannot take writes now (None: it can)."""
        if lost := self.lost(every=0.0):
            return lost
        if self.db is not None:
            folder = self.db.parent
            if not os.access(folder, os.W_OK):
                return "the data dir is not writable (a read-only filesystem?)"
            fs = os.statvfs(folder)
            if fs.f_bavail * fs.f_frsize < MIN_FREE_BYTES:
                return f"the data dir is full ({fs.f_bavail * fs.f_frsize} bytes free)"
            if probe := self._write_probe(folder):
                return probe
        if self._failed is not None and time.monotonic() - self._failed[0] < RECENT_SECONDS:
            return self._failed[1]
        return None

    def _write_probe(self, folder: Path) -> str | None:
        """A small file created, written, synced and removed in the data dir (at most every PROBE_EVERY s): a
        filesystem the kernel turned read-only after an error (ext4's emergency read-only) still passes
        `os.access` and `statvfs`, and a controller that takes no write meanwhile would look ready."""
        at, found = self._probed
        if time.monotonic() - at < PROBE_EVERY:
            return found
        path = folder / ".rolloutd-write-probe"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(path)
            found = None
        except OSError as e:
            found = f"the data dir cannot be written: {e.strerror or e}"
        self._probed = (time.monotonic(), found)
        return found
