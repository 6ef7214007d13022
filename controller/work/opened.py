"""The rollouts a batch job has opened over its life, kept in a counter row (`tables.OpenedRow`) beside each write.

`batches.Batches` reads it for `quotas.itemsPerJob` before a request or a step of a fill opens anything (`items`)
and adds each step's rollouts in the same transaction (`add`). Counting the job's items instead cost every step
of a 100 000-group fill a scan of up to 800 000 rows under the write lock (issue 36). A job without a row yet (a
database from before the counter, a job that had no quota) is counted once from its items. The statements are
the same on SQLite and PostgreSQL (`dialects.raw`).
"""
from __future__ import annotations

from typing import Any


def items(db: Any, job: str) -> int:
    """The rollouts `job` has opened (its row, else its items counted once and the row written)."""
    row = db.execute("SELECT items FROM opened_items WHERE job = ?", (job,)).fetchone()
    if row is not None:
        return int(row[0])
    n = db.execute("SELECT count(*) FROM items WHERE job = ?", (job,)).fetchone()[0]
    db.execute("INSERT INTO opened_items (job, items) VALUES (?, ?) ON CONFLICT (job) DO NOTHING", (job, n))
    return int(n)


def add(db: Any, job: str, n: int) -> None:
    """`n` more rollouts opened by this transaction (nothing to do before the row exists: `items` counts them)."""
    db.execute("UPDATE opened_items SET items = items + ? WHERE job = ?", (n, job))
