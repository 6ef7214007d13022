"""Staleness as a bound (`spec.policy.maxStaleness` = S): after each announce, nothing admitted more than S versions
before the current one keeps running or stays in the batch being filled.

`Scheduler.announce_policy` calls `StaleGroups.sweep` once the version is in place: leases that carried a version more
than S behind go back to the queue (the daemon holding one is told its attempt is no longer leased to it and cancels it:
sandbox killed, LLM request aborted) and run again with the current version; in batch jobs, groups counted in the
running batch whose samples were admitted more than S versions ago are taken out of it and the batch is refilled
(batches of prompts the trainer named are left whole: they replace nothing). The per-sample check when a result arrives
(`attempts`) stays as it was.
"""
from __future__ import annotations

import collections
import json
from typing import Any

from sqlmodel import Session, select

from rolloutd.crds.rolloutjob import RolloutJob

from .batches import Batches
from .queue import ItemQueue
from .states import BatchState, GroupState, ItemState
from .tables import BatchRow, GroupRow, ItemRow, TrajectoryRow

ZERO = {"cancelledRollouts": 0, "sweptGroups": 0}


def behind(version: Any, history: list) -> int:
    """How many versions `version` is behind the newest of `history` (one more than all of it when unknown)."""
    return len(history) - 1 - (history.index(version) if version in history else -1)


class StaleGroups:
    def __init__(self) -> None:
        self.counters: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.totals: collections.Counter[str] = collections.Counter(ZERO)  # every job's, for /metrics

    def forget(self, job: str) -> None:
        self.counters.pop(job, None)

    def sweep(self, s: Session, job: RolloutJob, history: list, queue: ItemQueue, batches: Batches) -> dict[str, int]:
        """Requeue the leases older than the bound and take stale groups out of the running batch; returns what
        this sweep did."""
        bound = job.spec.policy.max_staleness
        if bound is None:
            return dict(ZERO)
        name = job.metadata.key
        done = collections.Counter(ZERO)
        for item in s.exec(select(ItemRow).where(ItemRow.job == name, ItemRow.state == ItemState.leased)).all():
            held = queue.live.get(item.attempt_id) if item.attempt_id else None
            if held is not None and behind(held.version, history) > bound:
                queue.requeue(item, f"stale: leased with policy {held.version!r}, more than {bound} versions ago",
                              keep_attempt=True)
                s.add(item)
                done["cancelledRollouts"] += 1
        if job.spec.batch_mode:
            for batch in s.exec(select(BatchRow).where(BatchRow.job == name, BatchRow.state == BatchState.running)):
                if batches.named_prompts(s, name, batch.k) is not None:
                    continue
                for g in s.exec(select(GroupRow).where(GroupRow.job == name, GroupRow.batch == batch.k,
                                                       GroupRow.state == GroupState.counted)).all():
                    admitted = [json.loads(d).get("admittedVersion") for d in s.exec(
                        select(TrajectoryRow.data).where(TrajectoryRow.group_id == g.id)).all()]
                    if any(behind(v, history) > bound for v in admitted):
                        g.state, g.settled = GroupState.cancelled, queue.clock()
                        batch.counted -= 1
                        s.add(g)
                        done["sweptGroups"] += 1
                s.add(batch)
                batches.fill(s, job, batch)
        queue.wake(name)
        self.counters[name].update(done)
        self.totals.update(done)
        return dict(done)

    def describe(self, job: str) -> dict[str, Any]:
        return dict(self.counters.get(job) or {})
