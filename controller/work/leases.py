"""Leasing: a daemon takes queued items (its fair share, each pinned to a backend) and keeps them by beating.

Called by the node routes through the scheduler (`lease`, `heartbeat`, `give_back`); `results` ends the attempts.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from rolloutd.agents.aiokit import wait_event
from rolloutd.crds.node import Heartbeat, HeartbeatResponse, Lease, LeaseResponse
from rolloutd.crds.rolloutjob import RolloutJob

from ..errors import NotFound
from .backends import BackendPool
from .batches import Batches
from .expansion import Expansions
from .jobs import Jobs, closed
from .nodes import NodeRegistry
from .policy import PolicyVersions
from .queue import ItemQueue
from .states import DaemonState, ItemState
from .tables import ItemRow, NodeRow, PolicyRow, TaskRow


class Leases:
    def __init__(self, engine: Engine, queue: ItemQueue, jobs: Jobs, nodes: NodeRegistry, policy: PolicyVersions,
                 expansions: Expansions, batches: Batches, clock: Callable[[], float]) -> None:
        self.engine, self.queue, self.jobs, self.nodes, self.policy = engine, queue, jobs, nodes, policy
        self.expansions, self.batches, self.clock = expansions, batches, clock
        self.pool: BackendPool = queue.pool

    def _fair_share(self, s: Session, node: NodeRow, job: RolloutJob, asked: int) -> tuple[int, int | None]:
        """How many of the `asked` items (its free slots) a node may lease, and the job's live items
        if they were counted: its share of the job's live work, ⌈live ÷ executor.nodes⌉, minus what
        it holds. The first daemon up must not take a small job whole before the others registered;
        with a long queue the share exceeds any node's free slots, and the count stops there."""
        nodes = job.spec.executor.nodes
        if nodes <= 1 or asked <= 0:
            return asked, None
        held = self.queue.held(s, node.job, node.id)
        enough = nodes * (asked + held - 1) + 1  # this many live items give a share of asked + held
        live = self.queue.count_live(s, node.job, enough)
        if live >= enough:
            return asked, live
        return max(0, min(asked, -(-live // nodes) - held)), live

    def _lease_now(self, node_id: str, max_items: int) -> LeaseResponse:
        with Session(self.engine, expire_on_commit=False) as s:
            node = self.nodes.node(s, node_id)
            try:
                job = self.jobs.get(node.job)
            except NotFound:
                s.commit()
                return LeaseResponse(done=True)
            cache = self.jobs.sync(job)
            if closed(job):
                s.commit()
                return LeaseResponse(done=True)
            if node.state == DaemonState.draining:
                s.commit()
                return LeaseResponse(drain=True)
            leases: list[Lease] = []
            now = self.clock()
            pol = s.get(PolicyRow, node.job)
            version = json.loads(pol.version) if pol else None
            max_items, live = self._fair_share(s, node, job, max_items)
            refused: list[str] = []
            if max_items > 0:
                # plain rows, one query for their tasks, one executemany for the updates: per item,
                # ORM objects and a task lookup (which autoflushed every item before it) cost ~0.5 ms
                q = (select(ItemRow.id, ItemRow.prompt, ItemRow.sample, ItemRow.attempt, ItemRow.queued_at)
                     .where(ItemRow.job == node.job, ItemRow.state == ItemState.queued)
                     .order_by(ItemRow.id).limit(max_items))
                queued = s.exec(q).all()
                prompts = {row.prompt for row in queued}
                tasks = dict(s.exec(select(TaskRow.prompt, TaskRow.data).where(
                    TaskRow.job == node.job, TaskRow.prompt.in_(prompts))).all()) if prompts else {}
                changes: list[dict[str, Any]] = []
                for row in queued:
                    backend = self.pool.acquire(cache.backends, node.job) if cache.backends else None
                    if cache.backends and backend is None:
                        refused = cache.backends  # no healthy backend admits it: the rest waits queued
                        break
                    attempt = row.attempt + 1
                    attempt_id = f"{row.id}.{attempt}.{uuid.uuid4().hex[:6]}"
                    changes.append({"id": row.id, "state": ItemState.leased, "stage": "leased", "node_id": node.id,
                                    "attempt": attempt, "attempt_id": attempt_id,
                                    "deadline": now + cache.lease_seconds,
                                    "backend": backend, "holds_backend": backend is not None})
                    leases.append(Lease(attempt_id=attempt_id, item=row.id, prompt=row.prompt,
                                        sample=row.sample, attempt=attempt, task=json.loads(tasks[row.prompt]),
                                        backend=backend, policy_version=version,
                                        queued_seconds=max(now - row.queued_at, 0.0)))
                if changes:
                    s.exec(update(ItemRow), params=changes)  # ORM bulk UPDATE by primary key
            self.pool.admission.note(node.id, node.job, refused)  # in memory: who waits for a slot
            # nothing left to run: no lease granted now, and no item queued or leased (counted or not)
            idle = not leases and (live == 0 if live is not None else not self.queue.has_live(s, node.job))
            s.commit()
        exp = self.expansions.expand(job)
        if job.spec.batch_mode:  # a batch server has more work whenever the trainer asks
            with Session(self.engine, expire_on_commit=False) as s:
                done = idle and self.batches.finished(s, job)
            return LeaseResponse(leases=leases, done=done)
        return LeaseResponse(leases=leases, done=exp.total > 0 and idle)

    async def lease(self, node_id: str, max_items: int, wait: float = 0.0) -> LeaseResponse:
        deadline = time.monotonic() + wait
        while True:
            with Session(self.engine, expire_on_commit=False) as s:
                job_name = self.nodes.node(s, node_id).job
                s.commit()
            ev = self.queue.changed.event(job_name)
            ev.clear()
            resp = self._lease_now(node_id, max_items)
            left = deadline - time.monotonic()
            if resp.leases or resp.done or resp.drain or max_items == 0 or left <= 0 or self.queue.stopped:
                return resp
            await wait_event(ev, left)

    def heartbeat(self, node_id: str, hb: Heartbeat) -> HeartbeatResponse:
        resp = HeartbeatResponse()
        with Session(self.engine, expire_on_commit=False) as s:
            node = self.nodes.node(s, node_id)
            try:
                job = self.jobs.get(node.job)
            except NotFound:  # the job was deleted: everything still running is to be cancelled
                s.commit()
                return HeartbeatResponse(cancel=list(hb.stages), drain=True)
            cache = self.jobs.sync(job)
            resp.lease_seconds = cache.lease_seconds
            resp.drain = node.state == DaemonState.draining
            now = self.clock()
            self.policy.note_beat(node.id, hb.llm_inflight, hb.llm_held)
            pol = self.policy.row(s, node.job)
            resp.policy_version, resp.llm_paused = json.loads(pol.version), pol.paused
            # A beat names every live lease of the node, several times a second: read them as plain
            # rows and write only what changed (a stage, a released or re-pinned backend); the
            # deadlines of the named leases move with them below, once half used.
            ids = set(hb.stages) | set(hb.left_run)
            items: dict[str, dict[str, Any]] = {}
            if ids:
                q = select(ItemRow.id, ItemRow.job, ItemRow.attempt_id, ItemRow.node_id, ItemRow.state, ItemRow.stage,
                           ItemRow.backend, ItemRow.holds_backend, ItemRow.deadline).where(ItemRow.attempt_id.in_(ids))
                items = {r.attempt_id: r._asdict() for r in s.exec(q)}
            changes: dict[int, dict[str, Any]] = {}

            def change(item: dict[str, Any], **values: Any) -> None:
                item.update(values)
                changes.setdefault(item["id"], {"id": item["id"]}).update(values)

            def release(item: dict[str, Any]) -> None:  # ItemQueue.release on a plain row
                if item["holds_backend"]:
                    self.pool.release(item["backend"], item["job"])
                    change(item, holds_backend=False)

            for aid in hb.left_run:
                item = items.get(aid)
                if item is not None and item["node_id"] == node.id:
                    release(item)
            alive: list[str] = []
            for aid, stage in hb.stages.items():
                item = items.get(aid)
                if item is None or item["node_id"] != node.id or item["state"] != ItemState.leased:
                    if item is not None and item["state"] == ItemState.cancelled:
                        resp.cancel.append(aid)
                    else:
                        resp.unknown.append(aid)
                    continue
                alive.append(aid)
                if stage != item["stage"]:
                    change(item, stage=stage)
                backend = item["backend"]
                if stage in ("leased", "init") and backend \
                        and (not self.pool.healthy(backend) or backend not in cache.backends):
                    new = self.pool.acquire(cache.backends, node.job)
                    if new is not None:
                        release(item)
                        change(item, backend=new, holds_backend=True)
                        resp.repin[aid] = new
            # Only the leases the daemon names are extended. One granted but not yet in a beat is
            # covered by its own deadline (lease_seconds from the grant); one whose lease answer
            # never reached the daemon (the controller died while sending it) is named by nobody
            # and goes back to the queue when that deadline passes.
            # A deadline is rewritten once half the lease is used, not at every beat (rewriting every
            # live row several times a second was most of the database's writes at scale): a named
            # lease always keeps at least half of leaseSeconds, and beats come every sixth or less.
            # By primary key, with the other changes (an UPDATE … WHERE attempt_id IN … AND state
            # = 'leased' lets SQLite walk the state index: every leased row of the database).
            for aid in alive:
                if (items[aid]["deadline"] or 0.0) < now + cache.lease_seconds / 2:
                    change(items[aid], deadline=now + cache.lease_seconds)
            if changes:
                s.exec(update(ItemRow), params=list(changes.values()))  # ORM bulk UPDATE by primary key
            s.commit()
        return resp

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
