"""Staleness as a bound for batch-mode jobs (`spec.policy.maxStaleness` = S): no group admitted more than S versions
before the current one stays in the batch being filled.

`Scheduler.announce_policy` calls `StaleGroups.sweep` once a version is in place: running groups that are now too old
are cancelled on the daemons (the DAPO cancellation path: sandboxes killed, LLM requests aborted), counted groups of
the running batch that are too old are taken out of it, and the batch is refilled with fresh groups. A group's
admission is the moment it opened; the announce times are kept in memory (after a controller restart the sweep starts
again from the next announce). The per-sample check when a result arrives (`attempts`) stays as it was.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

from sqlmodel import Session, select

from rolloutd.crds.rolloutjob import RolloutJob

from .batches import Batches
from .states import BatchState, GroupState
from .tables import BatchRow, GroupRow


class StaleGroups:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._announced: dict[str, list[float]] = collections.defaultdict(list)  # job → when each version came
        self.counters: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def announced(self, job: str) -> None:
        self._announced[job].append(self.clock())

    def forget(self, job: str) -> None:
        self._announced.pop(job, None)
        self.counters.pop(job, None)

    def cutoff(self, job: str, bound: int) -> float | None:
        """Groups opened before this moment are more than `bound` versions old (None: none can be)."""
        times = self._announced.get(job) or []
        return times[len(times) - bound - 1] if len(times) > bound else None

    def sweep(self, s: Session, job: RolloutJob, batches: Batches) -> dict[str, int]:
        """Take the groups older than the bound out of the running batch (cancelled on the daemons if running) and
        refill it; returns what this sweep did."""
        bound = job.spec.policy.max_staleness
        name = job.metadata.key
        cut = self.cutoff(name, bound) if bound is not None and job.spec.batch_mode else None
        if cut is None:
            return {"cancelledGroups": 0, "sweptGroups": 0, "cancelledRollouts": 0}
        running_batches = {b.k: b for b in s.exec(select(BatchRow).where(BatchRow.job == name,
                                                                         BatchRow.state == BatchState.running))}
        cancelled = swept = rollouts = 0
        for g in s.exec(select(GroupRow).where(GroupRow.job == name, GroupRow.opened < cut,
                                               GroupRow.state.in_([GroupState.running, GroupState.counted]))).all():
            batch = running_batches.get(g.batch)
            if g.state == GroupState.running:
                n, _ = batches.cancel_group(s, g)
                cancelled, rollouts = cancelled + 1, rollouts + n
            elif batch is not None:  # counted in the batch being filled: out of it
                g.state, g.settled = GroupState.cancelled, self.clock()
                s.add(g)
                batch.counted -= 1
                s.add(batch)
                swept += 1
        for batch in running_batches.values():
            batches.fill(s, job, batch)
        done = {"cancelledGroups": cancelled, "sweptGroups": swept, "cancelledRollouts": rollouts}
        self.counters[name].update(done)
        return done

    def describe(self, job: str) -> dict[str, Any]:
        return dict(self.counters.get(job) or {})
