"""Results outlive their job: a deleted job's trajectories stay readable for the retention period (counted from
its last result), then are purged; `rolloutctl delete --purge` (the purge route) removes them at once.

Held by the scheduler (`scheduler.py` runs `sweep` in its background loop); read by the trainer routes
(`http/trainer.py`: a deleted job's trajectories, the purge route). Next step: `Scheduler.purge`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from sqlalchemy import func
from sqlmodel import Session, select

from ..errors import NotFound
from .seq_floor import PLACEHOLDER_JOB
from .tables import TrajectoryRow

DEFAULT_RETENTION_SECONDS = 7 * 86400.0
log = logging.getLogger("rolloutd.retention")


class Retention:
    """`retained(job)`: whether results of `job` are still kept; `sweep()`: purge the deleted jobs' results whose
    retention ran out (`exists(job)`: the job is still in the store; `purge(job)`: every row of it goes)."""

    def __init__(self, engine, exists: Callable[[str], bool], purge: Callable[[str], None],
                 seconds: float = DEFAULT_RETENTION_SECONDS, clock: Callable[[], float] = time.time):
        self.engine, self.exists, self.purge, self.seconds, self.clock = engine, exists, purge, seconds, clock
        self.last_sweep = 0.0

    @property
    def interval(self) -> float:
        """How often `due` lets a sweep run: a tenth of the retention, between 1 s and 10 minutes."""
        return min(max(self.seconds / 10, 1.0), 600.0)

    def due(self) -> bool:
        return time.monotonic() - self.last_sweep >= self.interval

    def retained(self, job: str) -> bool:
        with Session(self.engine) as s:
            return s.exec(select(TrajectoryRow.seq).where(TrajectoryRow.job == job).limit(1)).first() is not None

    def sweep(self) -> list[str]:
        """Purge every deleted job whose newest result ended more than the retention ago; the jobs purged."""
        self.last_sweep = time.monotonic()
        cutoff = self.clock() - self.seconds
        with Session(self.engine) as s:
            rows = s.exec(select(TrajectoryRow.job, func.max(TrajectoryRow.t_end)).group_by(TrajectoryRow.job)).all()
        gone = [job for job, last in rows if (last is None or last < cutoff) and job != PLACEHOLDER_JOB
                and not self.exists(job)]  # the seq floor's placeholder row is no deleted job's result
        for job in gone:
            self.purge(job)
            log.info("purged the results of deleted job %s (retention %gs)", job, self.seconds)
        return gone


def stored(store) -> Callable[[str], bool]:
    """Whether the job (namespace/name key) is in `store` (a job being deleted still is, until its finalizer goes)."""
    def exists(key: str) -> bool:
        try:
            store.get(key)
        except NotFound:
            return False
        return True
    return exists
