"""Leasing: a daemon takes queued items (its fair share, each pinned to a backend) and keeps them by beating.

Called by the node routes through the scheduler (`lease`, `heartbeat`, `give_back`); `results` ends the attempts.
"""
from __future__ import annotations

import json
import sqlite3
import time
import uuid
from typing import Any, Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from rolloutd.crds.aiokit import wait_event
from rolloutd.crds.node import BEAT_RESULTS, Heartbeat, HeartbeatResponse, Lease, LeaseResponse, Result, ResultAck
from rolloutd.crds.rolloutjob import RolloutJob

from ..errors import NotFound
from . import hot_sql
from .backends import BackendPool
from .batches import Batches
from .expansion import Expansions
from .job_state import JobCache, Jobs, closed
from .held_leases import Live
from .node_registry import NodeRegistry
from .policy_versions import PolicyVersions
from .queue import ItemQueue
from .states import DaemonState, ItemState
from .tables import ItemRow, NodeRow


class Leases:
    def __init__(self, engine: Engine, queue: ItemQueue, jobs: Jobs, nodes: NodeRegistry, policy: PolicyVersions,
                 expansions: Expansions, batches: Batches, clock: Callable[[], float], *,
                 intake: Callable[[hot_sql.Tx, str, RolloutJob, Any, list[Result]],
                                  tuple[ResultAck, Callable[[], None]]] | None = None) -> None:
        self.engine, self.queue, self.jobs, self.nodes, self.policy = engine, queue, jobs, nodes, policy
        self.expansions, self.batches, self.clock = expansions, batches, clock
        self.pool: BackendPool = queue.pool
        # results riding on a beat (beat-results), applied in the beat's transaction: `results.ResultIntake.apply`
        self.intake = intake

    def _fair_share(self, db: sqlite3.Connection, node_id: str, job_name: str, job: RolloutJob,
                    asked: int) -> tuple[int, int | None]:
        """How many of the `asked` items (its free slots) a node may lease, and the job's live items
        if they were counted: its share of the job's live work, ⌈live ÷ executor.nodes⌉, minus what
        it holds. The first daemon up must not take a small job whole before the others registered;
        with a long queue the share exceeds any node's free slots, and the count stops there."""
        nodes = job.spec.executor.nodes
        if nodes <= 1 or asked <= 0:
            return asked, None
        held = self.queue.live.held(node_id)
        enough = nodes * (asked + held - 1) + 1  # this many live items give a share of asked + held
        live = self.queue.count_live(db, job_name, enough)
        if live >= enough:
            return asked, live
        return max(0, min(asked, -(-live // nodes) - held)), live

    def lease_now(self, node_id: str, max_items: int, tx: hot_sql.Tx | None = None,
                  job: RolloutJob | None = None) -> LeaseResponse:
        """What a lease call without a long-poll answers (also what rides on a beat's or results' reply, then
        in that call's transaction `tx`, with the `job` it read before writing: reading it after may wait on
        the store's lock, held by a thread that waits on our write lock — a 30 s stall)."""
        with hot_sql.joined(self.engine, tx) as tx:
            db = tx.db
            job_name, state = self.nodes.caller(db, node_id)
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
            version = json.loads(self.policy.plain(db, job_name)[0])
            max_items, live = self._fair_share(db, node_id, job_name, job, max_items)
            refused: list[str] = []
            if max_items > 0:
                # plain rows, one query for their tasks, one executemany for the updates: per item,
                # ORM objects and a task lookup (which autoflushed every item before it) cost ~0.5 ms
                queued = db.execute("SELECT id, prompt, sample, attempt, queued_at FROM items WHERE job = ? AND state = ?"
                                    " ORDER BY id LIMIT ?", (job_name, ItemState.queued.value, max_items)).fetchall()
                prompts = sorted({row[1] for row in queued})
                tasks = dict(db.execute(f"SELECT prompt, data FROM tasks WHERE job = ? AND prompt IN "
                                        f"{hot_sql.in_list(len(prompts))}", (job_name, *prompts))) if prompts else {}
                changes: list[tuple[Any, ...]] = []
                for item, prompt, sample, attempt, queued_at in queued:
                    backend = self.pool.acquire(cache.backends, job_name) if cache.backends else None
                    if cache.backends and backend is None:
                        refused = cache.backends  # no healthy backend admits it: the rest waits queued
                        break
                    attempt += 1
                    attempt_id = f"{item}.{attempt}.{uuid.uuid4().hex[:6]}"
                    changes.append((node_id, attempt, attempt_id, now + cache.lease_seconds, backend,
                                    backend is not None, item))
                    self.queue.live.add(attempt_id, Live(item, job_name, node_id, "leased", backend,
                                                         backend is not None, now + cache.lease_seconds))
                    leases.append(Lease(attempt_id=attempt_id, item=item, prompt=prompt, sample=sample,
                                        attempt=attempt, task=json.loads(tasks[prompt]), backend=backend,
                                        policy_version=version, queued_seconds=max(now - queued_at, 0.0)))
                if changes:
                    db.executemany("UPDATE items SET state = 'leased', stage = 'leased', node_id = ?, attempt = ?, "
                                   "attempt_id = ?, deadline = ?, backend = ?, holds_backend = ? WHERE id = ?", changes)
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

    def heartbeat(self, node_id: str, hb: Heartbeat, lease: int | None = None) -> HeartbeatResponse:
        """A beat in a transaction of its own (`heartbeat_in` says what it does)."""
        job = self.jobs.find(self.nodes.job_of(node_id))
        return hot_sql.run_alone(self.engine, lambda tx: self.heartbeat_in(tx, node_id, hb, lease, job))

    def heartbeat_in(self, tx: hot_sql.Tx, node_id: str, hb: Heartbeat, lease: int | None,
                     job: RolloutJob | None) -> tuple[HeartbeatResponse, Callable[[], None]]:
        """A beat in the caller's transaction `tx`, with its node's `job` read before (None: deleted) — reading
        it inside may wait on the store's lock, held by a thread that waits on our write lock. With `lease` (the
        node's free slots) the next leases ride on the reply. A beat may carry the node's finished results
        (beat-results: applied first) and may name only the stages that changed (`hb.full` false, beat-deltas):
        only a full beat renews the leases it names. Returns the reply and what to do once committed."""
        resp = HeartbeatResponse()
        after: Callable[[], None] = hot_sql.nothing
        job_name, state = self.nodes.caller(tx.db, node_id)
        paced = BEAT_RESULTS in self.nodes.features.get(node_id, ()) or bool(hb.results) or not hb.full
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
        if hb.results and self.intake is not None:
            ack, after = self.intake(tx, node_id, job, cache, hb.results)
            resp.accepted, resp.dropped = ack.accepted, ack.dropped
            ended = set(ack.accepted) | set(ack.dropped)
        elif paced:
            resp.accepted, resp.dropped = [], {}
        self.policy.note_beat(node_id, hb.llm_inflight, hb.llm_held)
        version, _, resp.llm_paused = self.policy.plain(tx.db, job_name)
        resp.policy_version = json.loads(version)
        self._beat(tx.db, node_id, job_name, cache, hb, ended, now, resp)
        if lease is not None:
            resp.lease = LeaseResponse(drain=True) if resp.drain else self.lease_now(node_id, lease, tx, job)
        return resp, after

    def _beat(self, db: sqlite3.Connection, node_id: str, job_name: str, cache: JobCache, hb: Heartbeat,
              ended: set[str], now: float, resp: HeartbeatResponse) -> None:
        """The beat's stages, against the leases held in memory (`live`), where a stage changes and a full beat
        renews what it names; a released or re-pinned backend is also written to the database. An attempt not held in memory is
        no lease of this node's any more: cancelled (its job or group was) or unknown (it expired, or is not
        this node's)."""
        live = self.queue.live
        changed: dict[int, Live] = {}
        until = now + cache.lease_seconds

        def release(held: Live) -> None:
            if held.holds_backend:
                self.queue.release(held)
                changed[held.item] = held

        for aid in hb.left_run:
            held = live.get(aid)
            if held is not None and held.node_id == node_id:
                release(held)
        gone = []
        for aid, stage in hb.stages.items():
            if aid in ended:
                continue
            held = live.get(aid)
            if held is None or held.node_id != node_id:
                gone.append(aid)
                continue
            if stage != held.stage:  # in memory only: the database keeps the stage of the grant
                live.set_stage(held, stage)
            backend = held.backend
            if stage in ("leased", "init") and backend \
                    and (not self.pool.healthy(backend) or backend not in cache.backends):
                new = self.pool.acquire(cache.backends, job_name)
                if new is not None:
                    release(held)
                    held.backend, held.holds_backend = new, True
                    changed[held.item] = held
                    resp.repin[aid] = new
            # Only the leases a full beat names are extended. One granted but not yet in a beat is
            # covered by its own deadline (lease_seconds from the grant); one whose lease answer
            # never reached the daemon (the controller died while sending it) is named by nobody
            # and goes back to the queue when that deadline passes.
            if hb.full:
                live.renew(aid, held, until)
        if gone:
            cancelled = {aid for (aid,) in db.execute(
                f"SELECT attempt_id FROM items WHERE attempt_id IN {hot_sql.in_list(len(gone))} AND state = ?",
                (*gone, ItemState.cancelled.value))}
            for aid in gone:
                (resp.cancel if aid in cancelled else resp.unknown).append(aid)
        if changed:  # a backend released or re-pinned: admission is restored from these after a restart
            db.executemany("UPDATE items SET backend = ?, holds_backend = ? WHERE id = ?",
                           [(h.backend, h.holds_backend, h.item) for h in changed.values()])

    def give_back(self, node_id: str, attempt_ids: list[str], reason: str) -> int:
        """Unstarted (or abandoned) leases handed back: re-queued without using up an attempt."""
        n = 0
        with Session(self.engine, expire_on_commit=False) as s:
            node = s.get(NodeRow, node_id)
            if node is None:
                return 0
            for item in s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(attempt_ids))):
                if item.node_id == node.id and item.state == ItemState.leased:
                    self.queue.requeue(item, reason, keep_attempt=True)
                    s.add(item)
                    n += 1
            s.commit()
            self.queue.wake(node.job)
        return n
