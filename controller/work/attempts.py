"""An attempt's life, in one place: granted (a lease), kept (beats), ended (its result, or its lease runs out).

Called by the scheduler's node methods (`lease`, `beat`, `results`, `give_back`) and its background loop
(`expire`). The leases held now are `held_leases.HeldLeases` (in memory); every state change goes through
`queue.ItemQueue`, the statements through `hot_sql`, what is final to `feed`. Next step: `queue.py`.

A daemon takes queued items (its fair share, each pinned to a backend) and keeps them by beating. A result
is accepted only from the attempt that currently holds the lease, so a late duplicate from an expired
attempt is dropped and every rollout reaches the trainer exactly once. Infrastructure failures are retried
up to `pipeline.maxAttempts`, then delivered as `failure.kind = infra` with no reward — never as a reward
of 0; one that happens while every backend of the job is down uses no attempt (leasing pauses until a
backend is healthy). A `failure.kind = config` result fails the job with its reason (which names the spec
field) and cancels the job's other rollouts.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import time
import uuid
from typing import Any, Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from rolloutd.crds.kit.aiokit import wait_event
from rolloutd.crds.node import (BEAT_RESULTS, Heartbeat, HeartbeatResponse, Lease, LeaseResponse, Result, ResultAck,
                                ResultBatch)
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory

from ..dialects import raw
from ..errors import NotFound
from . import beat_stages, hot_sql
from . import tracing as attempt_traces
from .batches import Batches
from .expansion import Expansions
from .feed import Feed
from .job_state import JobCache, Jobs, closed
from .held_leases import HeldLease, unheard
from .node_registry import NodeRegistry
from .node_share import NodeShares
from .hot_sql import Done, Item
from .policy_versions import PolicyVersions
from .queue import ItemQueue
from .staleness import staleness
from .states import DaemonState, ItemState
from .tables import ItemRow
from . import tokenshare, workshare

log = logging.getLogger("rolloutd.scheduler")
BeatReads = tuple[Any, Any, Any, Any]  # a beat's reads sent ahead: node, policy, results' items, queued (`beat_reads`)


class Attempts:
    """The attempts of every job: `lease`, `beat`, `results`, `give_back`, `expire`. `on_idle` is called with a
    job's name when it may be finished now (its last rollout ended, or it failed)."""

    def __init__(self, engine: Engine, queue: ItemQueue, jobs: Jobs, nodes: NodeRegistry, policy: PolicyVersions,
                 expansions: Expansions, batches: Batches, feed: Feed, clock: Callable[[], float],
                 on_idle: Callable[[str], None] | None = None, on_stale: Callable[[str], None] | None = None) -> None:
        self.engine, self.queue, self.jobs, self.nodes, self.policy = engine, queue, jobs, nodes, policy
        self.expansions, self.batches, self.feed, self.clock, self.on_idle = expansions, batches, feed, clock, on_idle
        self.pool, self.held, self.on_stale = queue.pool, queue.leases, on_stale or (lambda job: None)
        self.shares = NodeShares(queue, self.held, clock)

    # ------------------------------------------------------------ lease: queued items granted to a node

    def lease_now(self, node_id: str, max_items: int, tx: hot_sql.Tx | None = None, job: RolloutJob | None = None,
                  caller: tuple[str, str] | None = None, version: str | None = None,
                  waiting: Callable[[int], hot_sql.Queued] | None = None) -> LeaseResponse:
        """What a lease call without a long-poll answers (also what rides on a beat's or results' reply, then
        in that call's transaction `tx`, with the `job` it read before writing — reading it after may wait on
        the store's lock, held by a thread that waits on our write lock: a 30 s stall — the node's (job, state) it
        looked up, `caller`, the policy version JSON it read, `version`, and its `hot_sql.queued_ahead`, `waiting`)."""
        with hot_sql.joined(self.engine, tx) as tx:
            db = tx.db
            job_name, state = caller if caller is not None else self.nodes.caller(db, node_id)
            try:
                job = job if job is not None else self.jobs.get(job_name)
            except NotFound:
                return LeaseResponse(done=True)
            cache = self.jobs.sync(job)
            if closed(job):
                return LeaseResponse(done=True)
            if state == DaemonState.draining:
                return LeaseResponse(drain=True)
            leases: list[Lease] = []
            now = self.clock()
            version = json.loads(version if version is not None else self.policy.raw_row(db, job_name)[0])
            max_items, live = self.shares.share(db, node_id, job_name, job.spec.executor.nodes, max_items)
            refused: list[str] = []
            if max_items > 0:
                # plain rows (per item, ORM objects and a task lookup cost ~0.5 ms); `waiting` was read before this
                # call's writes: stale if the ORM ran since (it may have cancelled queued items)
                fresh = waiting is None or tx._session is not None
                queued, tasks = hot_sql.queued(db, job_name, max_items) if fresh else waiting(max_items)
                grants: list[tuple[Any, ...]] = []
                for item, prompt, sample, attempt, queued_at in queued:
                    backend = self.pool.acquire(cache.backends, job_name) if cache.backends else None
                    if cache.backends and backend is None:
                        refused = cache.backends  # no healthy backend admits it: the rest waits queued
                        break
                    attempt += 1
                    attempt_id = f"{item}.{attempt}.{uuid.uuid4().hex[:6]}"
                    until = now + cache.lease_seconds
                    grants.append((node_id, attempt, attempt_id, until, backend, backend is not None, item))
                    self.held.add(attempt_id, HeldLease(item, job_name, node_id, "leased", backend, backend is not None,
                                                   until, version, since=now, beat=now))
                    grant = dict(attempt_id=attempt_id, item=item, prompt=prompt, sample=sample, attempt=attempt,
                                 backend=backend, queued_seconds=max(now - queued_at, 0.0))
                    leases.append(Lease(**grant, task=json.loads(tasks[prompt]), policy_version=version,
                                        traceparent=attempt_traces.granted(grant, job_name, node_id)))
                if grants:
                    if tx.group is not None:  # a PostgreSQL group's later beats must not be dealt these
                        tx.group.granted(job_name, [g[-1] for g in grants])
                    hot_sql.grant(db, grants)
                    self.shares.granted(job_name, len(grants))
                    # rolled back before its commit (the node answered an error): forgotten, their slots back now
                    tx.undo.append(lambda: (self.queue.forget_held(g[2] for g in grants),
                                            self.shares.granted(job_name, -len(grants))))
            self.pool.admission.note(node_id, job_name, refused)  # in memory: who waits for a slot
            # nothing left to run: no lease granted now, and no item queued or leased (counted or not)
            idle = not leases and (live == 0 if live is not None else not hot_sql.has_live(db, job_name))
        exp = self.expansions.row(job)  # a read: the expansion is the reconcile's step (`Scheduler.admit`)
        if job.spec.batch_mode:  # a batch server has more work whenever the trainer asks
            with Session(self.engine, expire_on_commit=False) as s:
                done = idle and self.batches.finished(s, job)
            return LeaseResponse(leases=leases, done=done)
        return LeaseResponse(leases=leases, done=exp is not None and not exp.pending and exp.total > 0 and idle)

    async def lease(self, node_id: str, max_items: int, wait: float = 0.0) -> LeaseResponse:
        """`lease_now`, waiting up to `wait` seconds for work (a long-poll) while it grants nothing."""
        deadline = time.monotonic() + wait
        while True:
            job_name = self.nodes.job_of(node_id)
            if job_name is None:
                with hot_sql.transaction(self.engine) as tx:
                    job_name = self.nodes.caller(tx.db, node_id)[0]
            ev = self.queue.changed.event(job_name)
            ev.clear()
            resp = self.lease_now(node_id, max_items)
            left = deadline - time.monotonic()
            if resp.leases or resp.done or resp.drain or max_items == 0 or left <= 0 or self.queue.stopped:
                return resp
            await wait_event(ev, left)

    def give_back(self, node_id: str, attempt_ids: list[str], reason: str) -> int:
        """Unstarted (or abandoned) leases handed back: re-queued without using up an attempt."""
        n = 0
        with Session(self.engine, expire_on_commit=False) as s:
            node = self.nodes.lookup(raw(s.connection()), node_id)  # (job, state); with node shards, fenced
            if node is None:
                return 0
            for item in s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(attempt_ids))):
                if item.node_id == node_id and item.state == ItemState.leased:
                    self.queue.requeue(item, reason, keep_attempt=True)
                    s.add(item)
                    n += 1
            s.commit()
            self.queue.wake(node[0])
        return n

    # ------------------------------------------------------------ beat: the held leases kept, their stages

    def beat_reads(self, tx: hot_sql.Tx, node_id: str, hb: Heartbeat, lease: int | None,
                   job: RolloutJob | None) -> BeatReads:
        """A beat's reads, sent together (PostgreSQL: one round trip, `hot_sql.ahead`), after the node's fence
        (node shards): the node's row, the policy's, its results' items and the queued items for the lease riding
        on its reply (in a PostgreSQL group, with the group's other beats': `group_reads.GroupReads`)."""
        node, key = self.nodes.lookup_ahead(tx.db, node_id), job.metadata.key if job is not None else ""
        policy = hot_sql.policy_ahead(tx.db, key) if job is not None else None
        items = hot_sql.items_ahead(tx.db, [r.attempt_id for r in hb.results]) if hb.results and job else None
        if job is None or not 0 < (lease or 0) <= hot_sql.AHEAD_ITEMS:
            return node, policy, items, None
        return node, policy, items, tx.group.ask(key, lease) if tx.group else hot_sql.queued_ahead(tx.db, key, lease)

    def beat(self, tx: hot_sql.Tx, node_id: str, hb: Heartbeat, lease: int | None, job: RolloutJob | None,
             sent: BeatReads | None = None) -> tuple[HeartbeatResponse, Done]:
        """A beat in the caller's transaction `tx`, with its node's `job` read before (None: deleted) — reading
        it inside may wait on the store's lock, held by a thread that waits on our write lock. With `lease` (the
        node's free slots) the next leases ride on the reply. A beat may carry the node's finished results
        (beat-results: applied first) and may name only the stages that changed (`hb.full` false, beat-deltas):
        only a full beat renews the leases it names. `sent`: its `beat_reads`, sent earlier. Returns the reply and
        what to do once committed."""
        resp, after = HeartbeatResponse(), hot_sql.nothing
        node, policy, items, waiting = sent or self.beat_reads(tx, node_id, hb, lease, job)
        caller = self.nodes.caller(tx.db, node_id, node)
        job_name, state = caller
        paced = BEAT_RESULTS in self.nodes.features_of(node_id) or bool(hb.results) or not hb.full
        if paced:
            resp.beat_gap = self.nodes.beat_gap()
        if job is None or job.metadata.key != job_name:  # deleted: everything still running is to be cancelled
            resp.cancel, resp.drain = list(hb.stages), True
            if hb.results:
                resp.accepted, resp.dropped = [], {r.attempt_id: "job deleted" for r in hb.results}
            return resp, after
        cache = self.jobs.sync(job)
        resp.lease_seconds = cache.lease_seconds
        resp.drain = state == DaemonState.draining
        now = self.clock()
        ended: set[str] = set()
        if hb.results:
            ack, after = self._end(tx, node_id, job, cache, hb.results, items)
            resp.accepted, resp.dropped = ack.accepted, ack.dropped
            ended = set(ack.accepted) | set(ack.dropped)
        elif paced:
            resp.accepted, resp.dropped = [], {}
        self.policy.note_beat(node_id, hb.llm_inflight, hb.llm_held, hb.llm_fence)
        version, _, resp.llm_paused = self.policy.raw_row(tx.db, job_name, policy)
        resp.llm_fence, resp.backend_versions = self.policy.fence(job_name)
        resp.llm_tokens = tokenshare.beat(self.pool.admission, node_id, job_name, hb.llm_tokens)  # token-share
        resp.llm_rates = workshare.beat(self.pool.admission, node_id, job_name, hb.llm_processed, hb.llm_rate_held)
        resp.policy_version = json.loads(version)
        beat_stages.apply(self.queue, tx.db, node_id, job_name, cache, hb, ended, now, resp)
        if lease is not None:
            resp.lease = LeaseResponse(drain=True) if resp.drain else \
                self.lease_now(node_id, lease, tx, job, caller, version, waiting)
        return resp, after

    # ------------------------------------------------------------ result: an attempt ends, exactly once

    def results(self, tx: hot_sql.Tx, node_id: str, batch: ResultBatch, job: RolloutJob | None,
                lease: int | None = None) -> tuple[ResultAck, Done]:
        """Apply a batch of results in the caller's transaction `tx`, with the node's `job` read before (None:
        deleted); with `lease` (the node's free slots) the next leases ride on the reply. Returns the ack and
        what to do once committed."""
        node = self.nodes.lookup(tx.db, node_id)
        if node is None:
            raise NotFound(f"node {node_id} is not registered")
        job_name, node_state = node
        if node_state == DaemonState.gone:  # declared lost: its leases went back to the queue (its lease: 404)
            ack = ResultAck(dropped={r.attempt_id: "stale attempt: node was declared lost" for r in batch.results})
        elif job is None or job.metadata.key != job_name:
            ack = ResultAck(dropped={r.attempt_id: "job deleted" for r in batch.results})
        else:
            ack, after = self._end(tx, node_id, job, self.jobs.sync(job), batch.results)
            if lease is not None:
                ack.lease = self.lease_now(node_id, lease, tx, job, node)
            return ack, after
        if lease is not None:  # refused whole
            ack.lease = LeaseResponse(done=job is None)
        return ack, hot_sql.nothing

    def _end(self, tx: hot_sql.Tx, node_id: str, job: RolloutJob, cache: JobCache, results: list[Result],
             sent: Callable[[], dict[str, hot_sql.Item]] | None = None) -> tuple[ResultAck, Done]:
        """`results` of node `node_id` (of `job`) applied in the caller's transaction `tx`: the ack, and what to
        do once it is committed (wake the job's waiting leases, tell `on_idle` the job may be over). `sent`: their
        items' read, sent earlier (`hot_sql.items_ahead`)."""
        ack = ResultAck()
        woke: set[str] = set()
        job_name = job.metadata.key
        max_stale = job.spec.policy.max_staleness
        history = json.loads(self.policy.raw_row(tx.db, job_name)[1]) if max_stale is not None else []
        settled: list[int] = []
        config_error = ""
        delivered: list[dict[str, Any]] = []  # trajectory rows, inserted together below
        items = (sent or hot_sql.items_ahead(tx.db, [r.attempt_id for r in results]))()
        changed: dict[int, Item] = {}
        for res in results:
            item = items.get(res.attempt_id)
            if item is None or item.state != ItemState.leased or item.node_id != node_id:
                why = "stale attempt: the lease expired or the item was re-leased"
                if item is not None and item.state == ItemState.cancelled:
                    why = "cancelled"
                ack.dropped[res.attempt_id] = why
                attempt_traces.ended(res.attempt_id, "dropped", res.trajectory)
                continue
            t = res.trajectory.model_copy(update={"job": item.job, "prompt": item.prompt, "sample": item.sample,
                                                   "attempt": item.attempt, **attempt_traces.ids(res.attempt_id)})
            if t.failure.kind == FailureKind.config:  # the job cannot work as configured: fail it
                self.queue.finish(item, ItemState.failed)
                self.feed.deliver(None, item, t, delivered)
                config_error = config_error or t.failure.reason or "configuration error"
            elif t.failure.kind == FailureKind.infra:
                state = self.queue.requeue(item, t.failure.reason or "infrastructure failure", cache.max_attempts,
                                           keep_attempt=self.pool.outage(item.backend, cache.backends))
                if state == ItemState.failed:
                    self.feed.deliver(None, item, t, delivered)
                    settled.append(item.group_id)
                woke.add(item.job)
            elif max_stale is not None and staleness(t, history) > max_stale:
                self.on_stale(item.job)  # too old for the trainer: run it again (counted), with the current policy
                self.queue.requeue(item, f"stale: generated by policy {t.policy_versions or t.policy_version}")
                woke.add(item.job)
            else:
                self.queue.finish(item, ItemState.done)
                self.feed.deliver(None, item, t, delivered)
                settled.append(item.group_id)
            changed[item.id] = item
            ack.accepted.append(res.attempt_id)
            attempt_traces.ended(res.attempt_id, str(item.state), t)
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
        # read after the commit: on PostgreSQL the read then waits for no round trip of its own (`hot_sql.live_later`)
        live = hot_sql.live_later(tx.db, job_name) if settled and self.on_idle is not None else None

        def after() -> None:
            if config_error and self.on_idle is not None:
                self.on_idle(job_name)  # the reconciler marks it Failed now
            if live is not None and not live():
                self.on_idle(job_name)  # its last rollout: the job may be complete now
            for name in woke:
                self.queue.wake(name)

        return ack, after

    # ------------------------------------------------------------ expire: a lease no full beat renewed in time

    def expire(self) -> int:
        """Leases no full beat renewed in time (held in memory) go back to the queue (node killed, network lost)."""
        now, n = self.clock(), 0
        with Session(self.engine, expire_on_commit=False) as s:
            late = dict(self.held.expired(now))
            expired = []
            if late and self.nodes.owning is not None:  # node shards: the leases of nodes ours now (fenced)
                late = self.nodes.owning.ours(raw(s.connection()), late)
            if late:
                # locked (PG): a replica its node moved to may end one now (`shards.py`); the later sees it ended
                rows = s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(list(late))).with_for_update()).all()
                expired = [r for r in rows if r.state == ItemState.leased]
                self.queue.forget_held(late.keys() - {r.attempt_id for r in expired})  # its grant was rolled back
            for item in expired:
                attempt_traces.ended(item.attempt_id, "expired")
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
        if n:  # a daemon whose beats came late logs whose time it was
            log.info("requeued %d expired lease(s): %s", n, unheard(late.values(), now))
        return n
