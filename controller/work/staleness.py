"""Staleness as a bound (`spec.policy.maxStaleness` = S): after each announce, nothing admitted more than S versions
before the current one keeps running or stays in the batch being filled.

`Scheduler.announce_policy` calls `StaleGroups.sweep` once the version is in place: leases that carried a version more
than S behind go back to the queue (the daemon holding one is told its attempt is no longer leased to it and cancels it:
sandbox killed, LLM request aborted) and run again with the current version; in batch jobs, groups counted in the
running batch whose samples were admitted more than S versions ago are taken out of it and the batch is refilled
(batches of prompts the trainer named are left whole: they replace nothing). The per-sample check when a result arrives
(`attempts`, measured by `staleness`) runs a sample again when it came back more than S versions old, counted by
`rerun`.
"""
from __future__ import annotations

import collections
import json
from typing import Any, Callable

from sqlmodel import Session, select

from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Trajectory

from .batches import Batches, batch_target
from .queue import ItemQueue
from .states import BatchState, GroupState, ItemState
from .tables import BatchRow, GroupRow, ItemRow, TrajectoryRow

ZERO = {"cancelledRollouts": 0, "sweptGroups": 0}  # an announce's sweep; `gated` counts the capacity gate, `rerun` the
# results that arrived more than S versions old and were run again (`attempts`)


def behind(version: Any, history: list) -> int:
    """How many versions `version` is behind the newest of `history` (one more than all of it when unknown)."""
    return len(history) - 1 - (history.index(version) if version in history else -1)


def staleness(t: Trajectory, history: list) -> int:
    """How many announced versions ago the oldest turn of `t` was generated (0 = current)."""
    versions = t.policy_versions or ([t.policy_version] if t.policy_version is not None else [])
    if not history or not versions:
        return 0
    if any(v not in history for v in versions):  # another job's weights (a shared backend): older than any of ours
        return len(history)
    return len(history) - 1 - min(history.index(v) for v in versions)


class StaleGroups:
    def __init__(self, history: Callable[[str], list]) -> None:
        self.history = history  # job → the versions announced, oldest first
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
            held = queue.leases.get(item.attempt_id) if item.attempt_id else None
            if held is not None and behind(held.version, history) > bound:
                queue.requeue(item, f"stale: leased with policy {held.version!r}, more than {bound} versions ago",
                              keep_attempt=True)
                s.add(item)
                done["cancelledRollouts"] += 1
        if job.spec.batch_mode:
            for batch in s.exec(select(BatchRow).where(BatchRow.job == name, BatchRow.state == BatchState.running)).all():
                if batches.named_prompts(s, name, batch.k) is not None:
                    continue
                batches.hold(s, name, batch.k)  # a large batch may be opening in a worker thread (`Batches`)
                with batches.lock:
                    self._sweep_batch(s, job, batch, history, bound, queue, batches, done)
        queue.wake(name)
        self.counters[name].update(done)
        self.totals.update(done)
        return dict(done)

    @staticmethod
    def _sweep_batch(s: Session, job: RolloutJob, batch: BatchRow, history: list, bound: int, queue: ItemQueue,
                     batches: Batches, done: collections.Counter) -> None:
        name = job.metadata.key
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

    def gate(self, s: Session, job: RolloutJob, wanted: int) -> int:
        """The capacity gate (batch jobs), in groups: at most (S + v + 1)·B groups accepted or running, with v the
        versions announced and B the batch's groups: a trainer that announces no new version is served at most
        S + 1 batches ahead of its last one. Returns how many of `wanted` groups may open now."""
        bound = job.spec.policy.max_staleness
        if bound is None:
            return wanted
        name = job.metadata.key
        taken = len(s.exec(select(GroupRow.id).where(GroupRow.job == name, GroupRow.state.in_(
            [GroupState.running, GroupState.counted]))).all())
        room = max((bound + len(self.history(name)) + 1) * batch_target(job) - taken, 0)
        if room < wanted:
            self.counters[name]["gated"] += wanted - room
            self.totals["gated"] += wanted - room
        return min(wanted, room)

    def rerun(self, job: str) -> None:
        """A result of `job` came back more than S versions old: its sample runs again with the current policy."""
        self.counters[job]["rerun"] += 1
        self.totals["rerun"] += 1

    def describe(self, job: str) -> dict[str, Any]:
        return dict(self.counters.get(job) or {})
