"""The job page's running sums read the store in steps with the event loop's work between them; a step must not
leave a statement open across the pause: an open statement keeps its read snapshot, and SQLite cannot copy the WAL
frames written after it back into the database (a checkpoint stops at the oldest reader), so at a thousand nodes
the WAL grew until the nodes' own commits checkpointed it inline. Real SQLite in WAL mode, the real tables."""
from __future__ import annotations

import json
import sqlite3

from sqlalchemy import create_engine

from rolloutd.controller.work import stats, tables


def _add(db: sqlite3.Connection, first: int, n: int) -> None:
    doc = json.dumps({"failure": {"kind": "none", "reason": ""}})
    db.executemany("INSERT INTO trajectories (job, item, prompt, sample, reward, failure, data, t_queue, t_init, "
                   "t_run, t_eval, t_end, reason) VALUES ('j', ?, ?, 0, 1.0, 'none', ?, 0.1, 0.2, 0.3, 0.4, 1000.0, '')",
                   [(i, i, doc) for i in range(first, first + n)])
    db.commit()


def test_a_paused_catch_up_does_not_hold_the_wal_back(tmp_path):
    path = tmp_path / "store.db"
    engine = create_engine(f"sqlite:///{path}")
    tables.create(engine)
    writer = sqlite3.connect(path)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")  # only this test's checkpoints
    _add(writer, 0, 10)
    sums = stats.JobStats(engine)
    assert sums.counts("j", "uid")["delivered"] == 10  # the first read, done: later reads are the incremental ones
    _add(writer, 10, 3 * stats.CHUNK)

    acc = sums._acc_of("j", "uid")
    steps = sums._steps("j", acc)
    next(steps)  # one step summed; the caller pauses here (the event loop serves the nodes)
    _add(writer, 10 + 3 * stats.CHUNK, 50)  # the nodes' results meanwhile
    busy, log, copied = writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert copied == log, f"a paused step held the WAL back: {copied} of {log} frames copied"

    for _ in steps:
        pass
    assert sums.counts("j", "uid")["delivered"] == 10 + 3 * stats.CHUNK + 50
    writer.close()
