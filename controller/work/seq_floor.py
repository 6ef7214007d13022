"""Trajectory `seq` numbers stay above every one handed out, across a restore of the store from a backup.

A trajectory's seq is SQLite's rowid (the largest + 1). A restored backup would hand the numbers issued after it out
again, and a trainer resuming a job's stream from a cursor it saved later would skip the rollouts run again.
`SeqFloor` (the scheduler's) records the largest seq in a file beside the store (`SEQ_FILE`: at start, every
RECORD_SECONDS and at stop) and, at start, `raise_floor` puts a placeholder row (job '', never listed) above it when the store's own
largest is lower: the next seq follows it (on PostgreSQL the column's sequence is set past it too: a row inserted
with its own seq does not move it). Next step: none planned."""
from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from pathlib import Path

from sqlalchemy.engine import Engine

from ..dialects import PgRaw, raw

log = logging.getLogger("rolloutd.feed")
SEQ_FILE = "trajectory-seq"
RECORD_SECONDS = 10.0
PLACEHOLDER_JOB = ""  # the job of the placeholder row: no job has this key, so no listing shows it
MARGIN = 100_000  # seqs issued after the file was last written (a crash between records) stay below the floor


def _largest(db: sqlite3.Connection) -> int:
    return db.execute("SELECT max(seq) FROM trajectories").fetchone()[0] or 0


def raise_floor(db: sqlite3.Connection, path: Path) -> int | None:
    """At start: the store's largest seq is below the one recorded (restored from a backup, or writes lost), so the
    next ones start above it (the floor returned); None when nothing was rewound."""
    try:
        recorded = int(path.read_text())
    except (OSError, ValueError):
        return None
    if recorded <= _largest(db):
        return None
    floor = recorded + MARGIN
    db.execute("INSERT INTO trajectories (seq, job, item, prompt, sample, failure, reason, data) "
               "VALUES (?, ?, ?, 0, 0, 'none', '', '{}')", (floor, PLACEHOLDER_JOB, -floor))
    if isinstance(db, PgRaw):
        db.execute("SELECT setval(pg_get_serial_sequence('trajectories', 'seq'), ?)", (floor,))
    log.warning("the store's trajectories end below seq %d handed out before (restored from a backup?): new ones "
                "are numbered from %d, so a trainer resuming from a later cursor skips none", recorded, floor + 1)
    return floor


def record(engine: Engine, path: Path) -> None:
    """Write the largest seq issued so far (atomically: a crash leaves the previous record); a disk that cannot take
    it (full, read-only) is logged, and the next record tries again."""
    with engine.connect() as conn:
        largest = _largest(raw(conn))
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(f"{largest}\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot record the trajectory seq in %s: %s", path, e)


class SeqFloor:
    """The seq record of one store, kept by the scheduler: `raise_floor` at start, `tick` from its background pass,
    `record` at start and stop."""

    def __init__(self, engine: Engine, home: str | Path | None):
        """`home`: the folder the record goes in (the store's `home`: the SQLite file's, or the data dir; None:
        a store with no folder keeps no record)."""
        self.engine, self.path = engine, None if home is None else Path(home) / SEQ_FILE
        self.recorded = time.monotonic()

    def raise_floor(self, db: sqlite3.Connection) -> int | None:
        return None if self.path is None else raise_floor(db, self.path)

    def record(self) -> None:
        if self.path is not None:
            record(self.engine, self.path)

    async def tick(self) -> None:
        if time.monotonic() - self.recorded >= RECORD_SECONDS:
            self.recorded = time.monotonic()
            await asyncio.to_thread(self.record)
