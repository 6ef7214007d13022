"""An attempt's end: its result arrives (exactly once, from the attempt holding the lease) or its lease runs out.

Called by the node routes (`results`) and the scheduler's background loop (`expire`); `feed` stores what is final.

A result is accepted only from the attempt that currently holds the lease, so a late duplicate
from an expired attempt is dropped and every rollout reaches the trainer exactly once.
Infrastructure failures are retried up to `pipeline.maxAttempts`, then delivered as
`failure.kind = infra` with no reward — never as a reward of 0; one that happens while every
backend of the job is down uses no attempt (leasing pauses until a backend is healthy). A
`failure.kind = config` result fails the job with its reason (which names the spec field) and
cancels the job's other rollouts.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from rolloutd.crds.node import LeaseResponse, Result, ResultAck, ResultBatch
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory

from ..errors import NotFound
from . import hot_sql
from .batches import Batches
from .expansion import Expansions
from .feed import Feed
from .job_state import JobCache, Jobs
from .node_registry import NodeRegistry
from .hot_sql import Item
from .policy_versions import PolicyVersions, staleness
from .queue import ItemQueue
from .states import DaemonState, ItemState
from .tables import ItemRow

log = logging.getLogger("rolloutd.scheduler")


class ResultIntake:
    def __init__(self, engine: Engine, queue: ItemQueue, jobs: Jobs, nodes: NodeRegistry, policy: PolicyVersions,
                 expansions: Expansions, batches: Batches, feed: Feed, clock: Callable[[], float]) -> None:
        self.engine, self.queue, self.jobs, self.nodes, self.policy = engine, queue, jobs, nodes, policy
        self.expansions, self.batches, self.feed, self.clock = expansions, batches, feed, clock
        self.on_idle: Callable[[str], None] | None = None  # the job may be finished now (last rollout, or failed)

    def _outage(self, item: Item, cache: JobCache) -> bool:
        """The item's backend is down and so is every other backend of its job: its failure is the
        outage's, and it waits in the queue (leasing pauses) until a backend is healthy again."""
        pool = self.queue.pool
        return bool(item.backend) and not pool.healthy(item.backend) \
            and not any(pool.healthy(u) for u in cache.backends)

    def results_in(self, tx: hot_sql.Tx, node_id: str, batch: ResultBatch, job: RolloutJob | None,
                   also: Callable[[hot_sql.Tx, RolloutJob], LeaseResponse] | None = None,
                   ) -> tuple[ResultAck, Callable[[], None]]:
        """Apply a batch of results in the caller's transaction `tx`, with the node's `job` read before (None:
        deleted); `also` (the lease riding on the reply) runs once they are, not when the batch is refused whole.
        Returns the ack and what to do once committed."""
        node = self.nodes.lookup(tx.db, node_id)
        if node is None:
            raise NotFound(f"node {node_id} is not registered")
        job_name, node_state = node
        if node_state == DaemonState.gone:  # declared lost: its leases went back to the queue
            return ResultAck(dropped={r.attempt_id: "stale attempt: node was declared lost"
                                      for r in batch.results}), hot_sql.nothing
        if job is None or job.metadata.key != job_name:
            return ResultAck(dropped={r.attempt_id: "job deleted" for r in batch.results}), hot_sql.nothing
        ack, after = self.apply(tx, node_id, job, self.jobs.sync(job), batch.results)
        if also is not None:
            ack.lease = also(tx, job)
        return ack, after

    def apply(self, tx: hot_sql.Tx, node_id: str, job: RolloutJob, cache: JobCache,
              results: list[Result]) -> tuple[ResultAck, Callable[[], None]]:
        """`results` of node `node_id` (of `job`) applied in the caller's transaction `tx`: the ack, and what to
        do once it is committed (wake the job's waiting leases, tell the reconciler the job may be over)."""
        ack = ResultAck()
        woke: set[str] = set()
        job_name = job.metadata.key
        max_stale = job.spec.policy.max_staleness
        history = json.loads(self.policy.plain(tx.db, job_name)[1]) if max_stale is not None else []
        settled: list[int] = []
        config_error = ""
        delivered: list[dict[str, Any]] = []  # trajectory rows, inserted together below
        items = hot_sql.items_by_attempt(tx.db, [r.attempt_id for r in results])
        changed: dict[int, Item] = {}
        for res in results:
            item = items.get(res.attempt_id)
            if item is None or item.state != ItemState.leased or item.node_id != node_id:
                why = "stale attempt: the lease expired or the item was re-leased"
                if item is not None and item.state == ItemState.cancelled:
                    why = "cancelled"
                ack.dropped[res.attempt_id] = why
                continue
            t = res.trajectory.model_copy(update={"job": item.job, "prompt": item.prompt, "sample": item.sample,
                                                   "attempt": item.attempt})
            if t.failure.kind == FailureKind.config:  # the job cannot work as configured: fail it
                self.queue.finish(item, ItemState.failed)
                self.feed.deliver(None, item, t, delivered)
                config_error = config_error or t.failure.reason or "configuration error"
            elif t.failure.kind == FailureKind.infra:
                state = self.queue.requeue(item, t.failure.reason or "infrastructure failure", cache.max_attempts,
                                           keep_attempt=self._outage(item, cache))
                if state == ItemState.failed:
                    self.feed.deliver(None, item, t, delivered)
                    settled.append(item.group_id)
                woke.add(item.job)
            elif max_stale is not None and staleness(t, history) > max_stale:
                # too old for the trainer: run it again, with the current policy
                self.queue.requeue(item, f"stale: generated by policy {t.policy_versions or t.policy_version}")
                woke.add(item.job)
            else:
                self.queue.finish(item, ItemState.done)
                self.feed.deliver(None, item, t, delivered)
                settled.append(item.group_id)
            changed[item.id] = item
            ack.accepted.append(res.attempt_id)
        if changed:
            hot_sql.save(tx.db, changed.values())
        if delivered:  # in order: their seqs follow the batch
            self.feed.insert(tx.db, delivered)
        for gid in settled:
            if gid is not None:
                self.batches.group_settled(tx.session(), job, gid)
        if config_error:
            self.expansions.fail(tx.session(), job_name, config_error)
            self.queue.cancel_live(tx.session(), job_name)  # they would fail the same way
        idle = bool(settled) and self.on_idle is not None and not hot_sql.has_live(tx.db, job_name)

        def after() -> None:
            if config_error and self.on_idle is not None:
                self.on_idle(job_name)  # the reconciler marks it Failed now
            if idle:
                self.on_idle(job_name)  # its last rollout: the job may be complete now
            for name in woke:
                self.queue.wake(name)

        return ack, after

    def expire(self) -> int:
        """Leases past their deadline go back to the queue (node killed, network lost): those no full beat
        renewed in time (`live`, in memory)."""
        now = self.clock()
        n = 0
        with Session(self.engine, expire_on_commit=False) as s:
            late = dict(self.queue.live.expired(now))
            expired = []
            if late:
                rows = s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(list(late)))).all()
                expired = [r for r in rows if r.state == ItemState.leased]
                for aid in late.keys() - {r.attempt_id for r in expired}:
                    self.queue.live.forget(aid)  # not leased in the database (its grant was rolled back)
            for item in expired:
                cache = self.jobs.cached(item.job)
                state = self.queue.requeue(item, f"lease expired on node {item.node_id}",
                                           cache.max_attempts if cache else 3)
                if state == ItemState.failed:
                    t = Trajectory(job=item.job, prompt=item.prompt, sample=item.sample, attempt=item.attempt,
                                   failure=Failure(kind=FailureKind.infra, reason=item.last_error))
                    self.feed.deliver(s, item, t)
                    if item.group_id is not None:
                        s.add(item)
                        s.flush()
                        try:
                            self.batches.group_settled(s, self.jobs.get(item.job), item.group_id)
                        except NotFound:
                            pass
                s.add(item)
                self.queue.wake(item.job)
                n += 1
            self.nodes.retire_silent(s, now)
            s.commit()
        if n:
            log.info("requeued %d expired lease(s)", n)
        return n
