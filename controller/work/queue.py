"""The central scheduler: work items with leases, exactly-once results, backend pinning.

Where it sits: inside the controller process. The reconciler calls `progress`/`forget` (it is
the reconciler's `WorkTracker`); the node API (`nodeapi.py`) calls `register`, `lease`,
`heartbeat`, `results`, `give_back`; the trajectories API reads `trajectories`/`groups`.
All state lives in SQLite (tables below, beside the jobs), so a restarted controller resumes
with every lease, result and backend pin where it was.

Work items = prompt × samplesPerPrompt (a prompt's samples form one GRPO group). An item is
`queued` → `leased` (to one attempt of one node daemon, with a deadline that heartbeats extend)
→ `done` | `failed` | `cancelled`. A lease that expires goes back to the queue with attempt+1.
A result is accepted only from the attempt that currently holds the lease, so a late duplicate
from an expired attempt is dropped and every rollout reaches the trainer exactly once.
Infrastructure failures are retried up to `pipeline.maxAttempts`, then delivered as
`failure.kind = infra` with no reward — never as a reward of 0; one that happens while every
backend of the job is down uses no attempt (leasing pauses until a backend is healthy). A
`failure.kind = config` result fails the job with its reason (which names the spec field) and
cancels the job's other rollouts. A lease answer is capped at the node's fair share of the work.

All methods run on the event loop; each is one short SQLite transaction, so there is no
locking between them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
from sqlalchemy import func, insert, update
from sqlmodel import Field, Session, SQLModel, select

from rolloutd.crds.node import (
    NODE_PROTOCOL,
    Heartbeat,
    HeartbeatResponse,
    Lease,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ResultAck,
    ResultBatch,
    heartbeat_seconds,
)
from rolloutd.crds.rolloutjob import RolloutJob, StageCounts
from rolloutd.crds.trajectory import FailureKind

from .backends import BackendPool
from .batches import Batches
from .errors import BadRequest, Conflict, NotFound
from .reconciler import Progress
from .store import Store

log = logging.getLogger("rolloutd.scheduler")

LIVE = ("queued", "leased")
NODE_SILENCE_SECONDS = 60.0


class TaskRow(SQLModel, table=True):
    __tablename__ = "tasks"
    job: str = Field(primary_key=True)
    prompt: int = Field(primary_key=True)
    data: str  # JSON: the dataset row


class ItemRow(SQLModel, table=True):
    __tablename__ = "items"
    id: int | None = Field(default=None, primary_key=True)
    job: str = Field(index=True)
    prompt: int
    sample: int
    state: str = Field(default="queued", index=True)  # queued | leased | done | failed | cancelled
    stage: str | None = None  # leased | init | run | eval (while leased)
    attempt: int = 0
    attempt_id: str | None = Field(default=None, index=True)
    node_id: str | None = Field(default=None, index=True)
    deadline: float | None = None
    backend: str | None = None
    holds_backend: bool = False  # counted in the backend min-heap (pinned, RUN not over)
    queued_at: float = 0.0
    last_error: str = ""
    group_id: int | None = Field(default=None, index=True)  # batch mode: the group (batches.GroupRow)


class TrajectoryRow(SQLModel, table=True):
    __tablename__ = "trajectories"
    seq: int | None = Field(default=None, primary_key=True)
    job: str = Field(index=True)
    item: int = Field(unique=True)
    prompt: int
    sample: int
    reward: float | None = None
    failure: str = "none"
    data: str  # JSON, wire form of the Trajectory
    group_id: int | None = Field(default=None, index=True)


class PolicyRow(SQLModel, table=True):
    __tablename__ = "policies"
    job: str = Field(primary_key=True)
    version: str = "null"  # JSON: the current policy version
    history: str = "[]"  # JSON: every version announced, in order (staleness is measured in this list)
    paused: bool = False


class NodeRow(SQLModel, table=True):
    __tablename__ = "nodes"
    id: str = Field(primary_key=True)
    job: str = Field(index=True)
    name: str
    host: str = ""
    pid: int = 0
    slot: int | None = None
    slurm_job_id: str | None = None
    slurm_node_id: int | None = None
    registered: float
    last_seen: float
    state: str = "active"  # active | draining | gone


class ExpansionRow(SQLModel, table=True):
    __tablename__ = "expansions"
    job: str = Field(primary_key=True)
    uid: str
    prompts: int
    total: int
    error: str = ""


@dataclass
class _JobCache:
    generation: int
    backends: list[str]
    max_attempts: int
    lease_seconds: float


class Scheduler:
    def __init__(self, store: Store, *, health_interval: float = 2.0,
                 health_check: Callable[[str], Any] | None = None, clock: Callable[[], float] = time.time,
                 health_timeout: float = 3.0, slow_grace: float = 20.0):
        self.store = store
        self.engine = store.engine
        SQLModel.metadata.create_all(self.engine)
        with self.engine.begin() as c:  # "a job's live items": leases, completion (also in older databases)
            c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_items_job_state ON items (job, state)")
            # expire() every 0.5 s finds the overdue leases, not every live one (64 000 at 1000 nodes)
            c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_items_state_deadline ON items (state, deadline)")
        self.pool = BackendPool()
        self.health_interval = health_interval
        self._health_check = health_check
        # a backend that refuses or errors is unhealthy at once; one that only answers /health too
        # slowly is busy, not dead (vLLM's API server can stall while it streams a fast generation),
        # and is declared unhealthy only once it has been unanswering for `slow_grace` seconds
        self.health_timeout, self.slow_grace = health_timeout, slow_grace
        self._slow_since: dict[str, float] = {}
        self.clock = clock
        self._wake: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._traj_wake: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._jobs: dict[str, _JobCache] = {}
        self._expansions: dict[str, ExpansionRow] = {}
        self._seen: dict[str, float] = {}  # node id → last call (a restarted controller starts the clock anew)
        self._http: httpx.AsyncClient | None = None
        self._node_llm: dict[str, tuple[float, int, bool]] = {}  # node id → (beat time, LLM calls in flight, held)
        self._policy_lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.batches = Batches(self)
        self.on_idle: Callable[[str], None] | None = None  # a job has no queued or leased item left
        self._stopped = False
        with Session(self.engine, expire_on_commit=False) as s:  # restore backend pins after a restart
            for item in s.exec(select(ItemRow).where(ItemRow.holds_backend == True)):  # noqa: E712
                self.pool.take(item.backend)

    # ------------------------------------------------------------ job bookkeeping

    def _job(self, name: str) -> RolloutJob:
        job = self.store.get(name)
        self._sync(job)
        return job

    def _sync(self, job: RolloutJob) -> _JobCache:
        cache = self._jobs.get(job.metadata.name)
        if cache is None or cache.generation != job.metadata.generation:
            urls = [b.url.rstrip("/") for b in job.spec.llm.backends]
            for u in urls:
                self.pool.add(u)
            cache = _JobCache(job.metadata.generation or 0, urls, job.spec.pipeline.max_attempts,
                              job.spec.pipeline.lease_seconds)
            self._jobs[job.metadata.name] = cache
        return cache

    def expand(self, job: RolloutJob) -> ExpansionRow:
        """Load the dataset once and create prompt × samples items (idempotent, restart-safe)."""
        name = job.metadata.name
        cached = self._expansions.get(name)
        if cached is not None and cached.uid == job.metadata.uid:
            return cached
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(ExpansionRow, name)
            if row is not None and row.uid == job.metadata.uid:
                self._expansions[name] = row
                return row
            if row is not None:  # a job re-created under the same name: start clean
                self._purge(s, name)
                self._expansions.pop(name, None)
            try:
                from rolloutd.agents.tasks import get_handler

                rows = get_handler(job.spec.tasks.kind).load(job.spec.tasks.source, job.spec.tasks.limit)
                error = "" if rows else f"dataset {job.spec.tasks.source} has no rows"
            except Exception as e:  # noqa: BLE001 - a bad dataset fails the job with its message
                rows, error = [], f"{type(e).__name__}: {e}"
            n = job.spec.samples_per_prompt
            now = self.clock()
            batch_mode = job.spec.batch_mode  # groups are opened batch by batch, on request
            # plain executemany INSERTs: an ORM object per item took minutes (and 800 MB) for 200k items
            if rows:
                s.exec(insert(TaskRow), params=[{"job": name, "prompt": p, "data": json.dumps(data)}
                                                for p, data in enumerate(rows)])
            if rows and not batch_mode:
                s.exec(insert(ItemRow), params=[{"job": name, "prompt": p, "sample": k, "queued_at": now}
                                                for p in range(len(rows)) for k in range(n)])
            row = ExpansionRow(job=name, uid=job.metadata.uid or "", prompts=len(rows),
                               total=0 if batch_mode else len(rows) * n, error=error)
            s.add(row)
            s.commit()
            s.refresh(row)
        self._expansions[name] = row
        self._wake[name].set()
        return row

    def _purge(self, s: Session, name: str) -> None:
        from .batches import BatchRow, CursorRow, GroupRow

        for model in (TaskRow, ItemRow, TrajectoryRow, NodeRow, ExpansionRow, GroupRow, BatchRow, CursorRow, PolicyRow):
            s.exec(model.__table__.delete().where(model.job == name))

    # ------------------------------------------------------------ hooks used by batches.py

    def add_items(self, s: Session, job: str, prompt: int, group_id: int, samples: int, now: float) -> None:
        for k in range(samples):
            s.add(ItemRow(job=job, prompt=prompt, sample=k, queued_at=now, group_id=group_id))

    def cancel_item(self, item: ItemRow) -> None:
        self._release_backend(item)
        item.state, item.deadline = "cancelled", None

    def wake(self, job: str) -> None:
        self._wake[job].set()

    # ------------------------------------------------------------ WorkTracker (reconciler)

    async def progress(self, job: RolloutJob) -> Progress:
        exp = self.expand(job)
        self._sync(job)
        counts = StageCounts(total=exp.total)
        with Session(self.engine, expire_on_commit=False) as s:
            q = select(ItemRow.state, ItemRow.stage, func.count()).where(ItemRow.job == job.metadata.name)
            for state, stage, n in s.exec(q.group_by(ItemRow.state, ItemRow.stage)):
                if state == "queued" or (state == "leased" and stage == "leased"):
                    counts.queued += n
                elif state == "leased":
                    setattr(counts, stage, getattr(counts, stage) + n)
                elif state == "done":
                    counts.succeeded += n
                elif state == "failed":
                    counts.failed += n
                elif state == "cancelled":
                    counts.cancelled += n
        if exp.error:
            return Progress(counts, failed=exp.error)
        live = counts.queued + counts.init + counts.run + counts.eval
        extra: dict[str, Any] = {"policyVersion": self.policy_version(job.metadata.name)}
        if job.spec.batch_mode:
            with Session(self.engine, expire_on_commit=False) as s:
                counts.total = counts.queued + counts.init + counts.run + counts.eval + counts.succeeded \
                    + counts.failed + counts.cancelled
                extra["batch"] = self.batches.status(s, job.metadata.name)
                done = self.batches.finished(s, job) and live == 0
                failed = self.batches.failure(s, job.metadata.name)
            if failed:
                return Progress(counts, failed=failed, extra=extra)
            return Progress(counts, done=done, extra=extra)
        return Progress(counts, done=exp.total > 0 and live == 0, extra=extra)

    async def registered(self, job: RolloutJob) -> int:
        return len([n for n in self.nodes(job.metadata.name) if n.state == "active"])

    def nodes(self, job: str) -> list[NodeRow]:
        with Session(self.engine, expire_on_commit=False) as s:
            return list(s.exec(select(NodeRow).where(NodeRow.job == job, NodeRow.state != "gone")))

    async def forget(self, job: RolloutJob) -> None:
        """The job is being deleted: cancel its live items (daemons learn it at their next beat)."""
        name = job.metadata.name
        with Session(self.engine, expire_on_commit=False) as s:
            self._cancel_live(s, name)
            s.commit()
        self._wake[name].set()

    def _cancel_live(self, s: Session, name: str) -> None:
        """Cancel every live item of job `name` (daemons learn it at their next beat)."""
        for item in s.exec(select(ItemRow).where(ItemRow.job == name, ItemRow.state.in_(LIVE))):
            self.cancel_item(item)
            s.add(item)

    def purge(self, name: str) -> None:
        self._expansions.pop(name, None)
        with Session(self.engine, expire_on_commit=False) as s:
            self._purge(s, name)
            s.commit()
        self._jobs.pop(name, None)

    # ------------------------------------------------------------ node protocol

    def register(self, req: RegisterRequest) -> RegisterResponse:
        if req.protocol != NODE_PROTOCOL:
            raise BadRequest(f"node {req.name!r} speaks node protocol {req.protocol}, this controller "
                             f"{NODE_PROTOCOL}: run the same rolloutd version on the controller and the nodes")
        job = self._job(req.job)
        if job.metadata.deletion_timestamp is not None or job.status.phase.terminal:
            raise Conflict(f'rolloutjobs "{req.job}" is {job.status.phase.value}; it takes no more nodes', name=req.job)
        now = self.clock()
        node = NodeRow(id=f"{req.name}-{uuid.uuid4().hex[:8]}", job=req.job, name=req.name, host=req.host,
                       pid=req.pid, slot=req.slot, slurm_job_id=req.slurm_job_id, slurm_node_id=req.slurm_node_id,
                       registered=now, last_seen=now)
        with Session(self.engine, expire_on_commit=False) as s:
            s.add(node)
            s.commit()
            active = s.exec(select(func.count()).where(NodeRow.job == req.job, NodeRow.state == "active")).one()
        self._seen[node.id] = now
        lease = job.spec.pipeline.lease_seconds
        log.info("node %s registered for job %s", node.id, req.job)
        return RegisterResponse(node_id=node.id, job=req.job, spec=job.spec.wire(), generation=job.metadata.generation,
                                lease_seconds=lease,
                                heartbeat_seconds=heartbeat_seconds(max(job.spec.executor.nodes, active), lease))

    def _node(self, s: Session, node_id: str) -> NodeRow:
        node = s.get(NodeRow, node_id)
        if node is None or node.state == "gone":
            raise NotFound(f"node {node_id} is not registered (or was declared lost); register again")
        self._seen[node_id] = self.clock()  # liveness is kept in memory: no write per call
        return node

    def _release_backend(self, item: ItemRow) -> None:
        if item.holds_backend:
            self.pool.release(item.backend)
            item.holds_backend = False

    def _requeue(self, item: ItemRow, error: str, max_attempts: int, keep_attempt: bool = False) -> str:
        """Back to the queue, or failed-infra when the attempts are used up. Returns the new state.
        `keep_attempt`: the failure was the backend's outage, not the rollout's: no attempt is used."""
        self._release_backend(item)
        item.last_error = error
        item.node_id, item.deadline, item.stage = None, None, None
        if keep_attempt:
            item.attempt = max(item.attempt - 1, 0)
        if item.attempt >= max_attempts:
            item.state = "failed"
        else:
            item.state, item.attempt_id, item.backend = "queued", None, None
            item.queued_at = self.clock()
        return item.state

    def _outage(self, item: ItemRow, cache: _JobCache) -> bool:
        """The item's backend is down and so is every other backend of its job: its failure is the
        outage's, and it waits in the queue (leasing pauses) until a backend is healthy again."""
        return bool(item.backend) and not self.pool.healthy(item.backend) \
            and not any(self.pool.healthy(u) for u in cache.backends)

    def _fail_job(self, s: Session, name: str, reason: str) -> None:
        """A configuration error: the job fails with `reason` (which names the spec field) and its
        other rollouts are cancelled (they would fail the same way; daemons learn it at their next beat)."""
        row = s.get(ExpansionRow, name)
        if row is not None and not row.error:
            row.error = reason
            s.add(row)
            self._expansions[name] = row
        self._cancel_live(s, name)
        log.error("job %s fails: %s", name, reason)

    @staticmethod
    def _fair_share(s: Session, node: NodeRow, job: RolloutJob, live: int, leased: int, asked: int) -> int:
        """How many of the `asked` items (its free slots) a node may lease: its share of the job's
        live work, ⌈live ÷ executor.nodes⌉, minus what it holds. The first daemon up must not take
        a small job whole before the others registered; with a long queue the share exceeds any
        node's free slots and nothing more is read."""
        nodes = job.spec.executor.nodes
        share = -(-live // nodes)
        if nodes <= 1 or asked <= 0 or share >= asked + leased:  # it holds at most `leased`: no cap
            return asked
        held = s.exec(select(func.count()).where(ItemRow.job == node.job, ItemRow.state == "leased",
                                                 ItemRow.node_id == node.id)).one()
        return max(0, min(asked, share - held))

    def _lease_now(self, node_id: str, max_items: int) -> LeaseResponse:
        with Session(self.engine, expire_on_commit=False) as s:
            node = self._node(s, node_id)
            try:
                job = self._job(node.job)
            except NotFound:
                s.commit()
                return LeaseResponse(done=True)
            cache = self._sync(job)
            if job.metadata.deletion_timestamp is not None or job.status.phase.terminal:
                s.commit()
                return LeaseResponse(done=True)
            if node.state == "draining":
                s.commit()
                return LeaseResponse(drain=True)
            leases: list[Lease] = []
            now = self.clock()
            pol = s.get(PolicyRow, node.job)
            version = json.loads(pol.version) if pol else None
            by_state = dict(s.exec(select(ItemRow.state, func.count()).where(
                ItemRow.job == node.job, ItemRow.state.in_(LIVE)).group_by(ItemRow.state)).all())
            live = sum(by_state.values())
            max_items = self._fair_share(s, node, job, live, by_state.get("leased", 0), max_items)
            if max_items > 0:
                # plain rows, one query for their tasks, one executemany for the updates: per item,
                # ORM objects and a task lookup (which autoflushed every item before it) cost ~0.5 ms
                q = (select(ItemRow.id, ItemRow.prompt, ItemRow.sample, ItemRow.attempt, ItemRow.queued_at)
                     .where(ItemRow.job == node.job, ItemRow.state == "queued").order_by(ItemRow.id).limit(max_items))
                queued = s.exec(q).all()
                prompts = {row.prompt for row in queued}
                tasks = dict(s.exec(select(TaskRow.prompt, TaskRow.data).where(
                    TaskRow.job == node.job, TaskRow.prompt.in_(prompts))).all()) if prompts else {}
                changes: list[dict[str, Any]] = []
                for row in queued:
                    backend = self.pool.acquire(cache.backends) if cache.backends else None
                    if cache.backends and backend is None:
                        break  # no healthy backend: leave the work queued
                    attempt = row.attempt + 1
                    attempt_id = f"{row.id}.{attempt}.{uuid.uuid4().hex[:6]}"
                    changes.append({"id": row.id, "state": "leased", "stage": "leased", "node_id": node.id,
                                    "attempt": attempt, "attempt_id": attempt_id,
                                    "deadline": now + cache.lease_seconds,
                                    "backend": backend, "holds_backend": backend is not None})
                    leases.append(Lease(attempt_id=attempt_id, item=row.id, prompt=row.prompt,
                                        sample=row.sample, attempt=attempt, task=json.loads(tasks[row.prompt]),
                                        backend=backend, policy_version=version,
                                        queued_seconds=max(now - row.queued_at, 0.0)))
                if changes:
                    s.exec(update(ItemRow), params=changes)  # ORM bulk UPDATE by primary key
            s.commit()
        exp = self.expand(job)
        if job.spec.batch_mode:  # a batch server has more work whenever the trainer asks
            with Session(self.engine, expire_on_commit=False) as s:
                done = self.batches.finished(s, job) and live == 0 and not leases
            return LeaseResponse(leases=leases, done=done)
        return LeaseResponse(leases=leases, done=exp.total > 0 and live == 0 and not leases)

    async def lease(self, node_id: str, max_items: int, wait: float = 0.0) -> LeaseResponse:
        deadline = time.monotonic() + wait
        while True:
            with Session(self.engine, expire_on_commit=False) as s:
                job_name = self._node(s, node_id).job
                s.commit()
            ev = self._wake[job_name]
            ev.clear()
            resp = self._lease_now(node_id, max_items)
            left = deadline - time.monotonic()
            if resp.leases or resp.done or resp.drain or max_items == 0 or left <= 0 or self._stopped:
                return resp
            try:
                await asyncio.wait_for(ev.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    def heartbeat(self, node_id: str, hb: Heartbeat) -> HeartbeatResponse:
        resp = HeartbeatResponse()
        with Session(self.engine, expire_on_commit=False) as s:
            node = self._node(s, node_id)
            try:
                job = self._job(node.job)
            except NotFound:  # the job was deleted: everything still running is to be cancelled
                s.commit()
                return HeartbeatResponse(cancel=list(hb.stages), drain=True)
            cache = self._sync(job)
            resp.lease_seconds = cache.lease_seconds
            resp.drain = node.state == "draining"
            now = self.clock()
            self._node_llm[node.id] = (time.monotonic(), hb.llm_inflight, hb.llm_held)
            pol = self._policy_row(s, node.job)
            resp.policy_version, resp.llm_paused = json.loads(pol.version), pol.paused
            # A beat names every live lease of the node, several times a second: read them as plain
            # rows and write only what changed (a stage, a released or re-pinned backend); the
            # deadlines of the named leases move with them below, once half used.
            ids = set(hb.stages) | set(hb.left_run)
            items: dict[str, dict[str, Any]] = {}
            if ids:
                q = select(ItemRow.id, ItemRow.attempt_id, ItemRow.node_id, ItemRow.state, ItemRow.stage,
                           ItemRow.backend, ItemRow.holds_backend, ItemRow.deadline).where(ItemRow.attempt_id.in_(ids))
                items = {r.attempt_id: r._asdict() for r in s.exec(q)}
            changes: dict[int, dict[str, Any]] = {}

            def change(item: dict[str, Any], **values: Any) -> None:
                item.update(values)
                changes.setdefault(item["id"], {"id": item["id"]}).update(values)

            def release(item: dict[str, Any]) -> None:  # _release_backend on a plain row
                if item["holds_backend"]:
                    self.pool.release(item["backend"])
                    change(item, holds_backend=False)

            for aid in hb.left_run:
                item = items.get(aid)
                if item is not None and item["node_id"] == node.id:
                    release(item)
            alive: list[str] = []
            for aid, stage in hb.stages.items():
                item = items.get(aid)
                if item is None or item["node_id"] != node.id or item["state"] != "leased":
                    if item is not None and item["state"] == "cancelled":
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
                    new = self.pool.acquire(cache.backends)
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

    def results(self, node_id: str, batch: ResultBatch) -> ResultAck:
        ack = ResultAck()
        woke: set[str] = set()
        with Session(self.engine, expire_on_commit=False) as s:
            node = s.get(NodeRow, node_id)
            if node is None:
                raise NotFound(f"node {node_id} is not registered")
            if node.state == "gone":  # declared lost: its leases went back to the queue
                return ResultAck(dropped={r.attempt_id: "stale attempt: node was declared lost" for r in batch.results})
            node.last_seen = self.clock()
            try:
                job = self._job(node.job)
                cache = self._sync(job)
            except NotFound:
                s.commit()
                return ResultAck(dropped={r.attempt_id: "job deleted" for r in batch.results})
            pol = self._policy_row(s, node.job)
            history = json.loads(pol.history)
            max_stale = job.spec.policy.max_staleness
            settled: list[int] = []
            config_error = ""
            delivered: list[dict[str, Any]] = []  # trajectory rows, inserted together below
            ids = [r.attempt_id for r in batch.results]
            items = {i.attempt_id: i for i in s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(ids)))}
            for res in batch.results:
                item = items.get(res.attempt_id)
                if item is None or item.state != "leased" or item.node_id != node.id:
                    why = "stale attempt: the lease expired or the item was re-leased"
                    if item is not None and item.state == "cancelled":
                        why = "cancelled"
                    ack.dropped[res.attempt_id] = why
                    continue
                t = res.trajectory.model_copy(update={"job": item.job, "prompt": item.prompt, "sample": item.sample,
                                                       "attempt": item.attempt})
                if t.failure.kind == FailureKind.config:  # the job cannot work as configured: fail it
                    self._release_backend(item)
                    item.state, item.stage, item.deadline = "failed", None, None
                    self._deliver(s, item, t, delivered)
                    config_error = config_error or t.failure.reason or "configuration error"
                elif t.failure.kind == FailureKind.infra:
                    state = self._requeue(item, t.failure.reason or "infrastructure failure", cache.max_attempts,
                                          keep_attempt=self._outage(item, cache))
                    if state == "failed":
                        self._deliver(s, item, t, delivered)
                        settled.append(item.group_id)
                    woke.add(item.job)
                elif max_stale is not None and self._staleness(t, history) > max_stale:
                    self._release_backend(item)  # too old for the trainer: run it again, with the current policy
                    item.state, item.stage, item.node_id, item.deadline = "queued", None, None, None
                    item.attempt_id, item.backend, item.queued_at = None, None, self.clock()
                    item.last_error = f"stale: generated by policy {t.policy_versions or t.policy_version}"
                    woke.add(item.job)
                else:
                    self._release_backend(item)
                    item.state, item.stage, item.deadline = "done", None, None
                    self._deliver(s, item, t, delivered)
                    settled.append(item.group_id)
                s.add(item)
                ack.accepted.append(res.attempt_id)
            if delivered:
                s.exec(insert(TrajectoryRow), params=delivered)  # in order: their seqs follow the batch
            s.flush()
            for gid in settled:
                if gid is not None:
                    self.batches.group_settled(s, job, gid)
            if config_error:
                self._fail_job(s, job.metadata.name, config_error)
            s.commit()
            if config_error and self.on_idle is not None:
                self.on_idle(job.metadata.name)  # the reconciler marks it Failed now
            if settled and self.on_idle is not None and s.exec(
                    select(ItemRow.id).where(ItemRow.job == job.metadata.name, ItemRow.state.in_(LIVE)).limit(1)
            ).first() is None:
                self.on_idle(job.metadata.name)  # its last rollout: the job may be complete now
        for name in woke:
            self._wake[name].set()
        return ack

    def _deliver(self, s: Session, item: ItemRow, t, into: list[dict[str, Any]] | None = None) -> None:
        """Store `t` as the item's trajectory; with `into`, only append the row (the caller inserts
        a batch of them in one statement: an ORM object per row cost more than the JSON)."""
        if item.group_id is not None:
            t.group = item.group_id
        row = {"job": item.job, "item": item.id, "prompt": item.prompt, "sample": item.sample, "reward": t.reward,
               "failure": t.failure.kind.value, "data": json.dumps(t.wire(), separators=(",", ":")),
               "group_id": item.group_id}
        if into is None:
            s.add(TrajectoryRow(**row))
        else:
            into.append(row)
        self._traj_wake[item.job].set()

    @staticmethod
    def _staleness(t, history: list) -> int:
        """How many announced versions ago the oldest turn of `t` was generated (0 = current)."""
        versions = t.policy_versions or ([t.policy_version] if t.policy_version is not None else [])
        if not history or not versions:
            return 0
        idx = [history.index(v) for v in versions if v in history]
        return len(history) - 1 - min(idx) if idx else len(history)

    def give_back(self, node_id: str, attempt_ids: list[str], reason: str) -> int:
        """Unstarted (or abandoned) leases handed back: re-queued without using up an attempt."""
        n = 0
        with Session(self.engine, expire_on_commit=False) as s:
            node = s.get(NodeRow, node_id)
            if node is None:
                return 0
            for item in s.exec(select(ItemRow).where(ItemRow.attempt_id.in_(attempt_ids))):
                if item.node_id == node.id and item.state == "leased":
                    self._release_backend(item)
                    item.state, item.stage, item.node_id, item.deadline = "queued", None, None, None
                    item.attempt_id, item.backend, item.queued_at = None, None, self.clock()
                    item.attempt = max(item.attempt - 1, 0)
                    item.last_error = reason
                    s.add(item)
                    n += 1
            s.commit()
            self._wake[node.job].set()
        return n

    def deregister(self, node_id: str) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            node = s.get(NodeRow, node_id)
            if node is not None:
                node.state = "gone"
                s.add(node)
                s.commit()

    def drain(self, job: str, node_ids: list[str]) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            for node in s.exec(select(NodeRow).where(NodeRow.job == job, NodeRow.id.in_(node_ids))):
                node.state = "draining"
                s.add(node)
            s.commit()

    # ------------------------------------------------------------ batches (trainer API)

    def request_batch(self, name: str, k: int | None = None, prompts: list[int] | None = None) -> dict[str, Any]:
        job = self._job(name)
        if not job.spec.batch_mode:
            raise BadRequest(f'rolloutjobs "{name}" is not a batch job: set spec.dapo.enabled or spec.batches')
        if job.metadata.deletion_timestamp is not None or job.status.phase.terminal:
            raise Conflict(f'rolloutjobs "{name}" is {job.status.phase.value}; it serves no more batches')
        self.expand(job)
        with Session(self.engine, expire_on_commit=False) as s:
            row = self.batches.request(s, job, k, prompts)
            s.commit()
            out = self.batches.snapshot(s, name, row.k)
        out.pop("groups")
        return out

    async def batch(self, name: str, k: int, wait: bool = False, timeout: float | None = None,
                    include_all: bool = False) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self._traj_wake[name]
            ev.clear()
            with Session(self.engine, expire_on_commit=False) as s:
                snap = self.batches.snapshot(s, name, k, include_all)
            if not wait or snap["state"] in ("complete", "failed") or self._stopped:
                return snap
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return snap
            try:
                await asyncio.wait_for(ev.wait(), timeout=min(left, 30.0))
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ policy versions

    def _policy_row(self, s: Session, job: str) -> PolicyRow:
        row = s.get(PolicyRow, job)
        if row is None:
            row = PolicyRow(job=job)
            s.add(row)
            s.flush()
        return row

    def policy_version(self, job: str) -> int | str | None:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(PolicyRow, job)
            return json.loads(row.version) if row else None

    def policy(self, job: str) -> dict[str, Any]:
        self.store.get(job)  # 404 for unknown jobs
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(PolicyRow, job) or PolicyRow(job=job)
            return {"version": json.loads(row.version), "history": json.loads(row.history), "paused": row.paused}

    def _set_policy(self, job: str, **changes: Any) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            row = self._policy_row(s, job)
            for k, v in changes.items():
                setattr(row, k, v)
            s.add(row)
            s.commit()

    async def announce_policy(self, name: str, version: int | str, weights_path: str | None = None,
                              pause: bool | None = None, drain_timeout: float = 120.0) -> dict[str, Any]:
        """Switch the job to policy `version`: hold new LLM calls on every daemon, wait for the
        in-flight ones to finish, then on every backend pause → reload weights → reset the prefix
        cache → resume, and release the daemons with the new version. No request spans two versions."""
        job = self._job(name)
        pause = job.spec.policy.pause_on_update if pause is None else pause
        async with self._policy_lock[name]:
            t0 = time.monotonic()
            drained = True
            if pause:
                self._set_policy(name, paused=True)
                asked = time.monotonic()
                drained = await self._wait_llm_drained(name, asked, drain_timeout)
            report = []
            for url in self._jobs[name].backends:
                report.append(await self._update_backend(url, weights_path, pause))
            with Session(self.engine, expire_on_commit=False) as s:
                row = self._policy_row(s, name)
                history = json.loads(row.history)
                if version not in history:
                    history.append(version)
                row.version, row.history, row.paused = json.dumps(version), json.dumps(history), False
                s.add(row)
                s.commit()
            self._wake[name].set()
        errors = [b for b in report if b.get("error")]
        if errors:
            log.warning("policy %s of %s: %d backend(s) failed: %s", version, name, len(errors), errors)
        return {"version": version, "pausedSeconds": round(time.monotonic() - t0, 3), "drained": drained,
                "backends": report}

    async def _wait_llm_drained(self, name: str, since: float, timeout: float) -> bool:
        """True once every active daemon of the job reported, after `since`, that it holds new LLM
        calls (it saw the pause) and has none in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = [n.id for n in self.nodes(name) if n.state == "active"]
            beats = [self._node_llm.get(n) for n in nodes]
            if all(b is not None and b[0] > since and b[2] and b[1] == 0 for b in beats):
                return True
            await asyncio.sleep(0.05)
        log.warning("policy update of %s: daemons still had LLM calls in flight after %.0f s", name, timeout)
        return False

    async def _update_backend(self, url: str, weights_path: str | None, pause: bool) -> dict[str, Any]:
        if self._http is None:
            self._http = httpx.AsyncClient()
        out: dict[str, Any] = {"url": url, "reloaded": False, "error": None}
        try:
            if pause:
                await self._http.post(f"{url}/pause", params={"mode": "wait"}, timeout=120)
            if weights_path:
                t = time.monotonic()
                r = await self._http.post(f"{url}/collective_rpc", timeout=300, json={
                    "method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})
                if r.status_code != 200:
                    raise RuntimeError(f"reload_weights: HTTP {r.status_code}: {r.text[:300]}")
                out["reloaded"], out["reloadSeconds"] = True, round(time.monotonic() - t, 3)
            for _ in range(20):  # false while blocks are still held by requests finishing
                r = await self._http.post(f"{url}/reset_prefix_cache", timeout=30)
                if r.status_code != 200 or "false" not in r.text.lower():
                    break
                await asyncio.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - reported per backend; the others still update
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            if pause:
                try:
                    await self._http.post(f"{url}/resume", timeout=30)
                except httpx.HTTPError as e:
                    out["error"] = out["error"] or f"resume: {e}"
        return out

    # ------------------------------------------------------------ background duties

    def expire(self) -> int:
        """Leases past their deadline go back to the queue (node killed, network lost)."""
        now = self.clock()
        n = 0
        with Session(self.engine, expire_on_commit=False) as s:
            expired = s.exec(select(ItemRow).where(ItemRow.state == "leased", ItemRow.deadline < now)).all()
            for item in expired:
                cache = self._jobs.get(item.job)
                node = item.node_id
                state = self._requeue(item, f"lease expired on node {node}", cache.max_attempts if cache else 3)
                if state == "failed":
                    from rolloutd.crds.trajectory import Failure, Trajectory

                    t = Trajectory(job=item.job, prompt=item.prompt, sample=item.sample, attempt=item.attempt,
                                   failure=Failure(kind=FailureKind.infra, reason=item.last_error))
                    self._deliver(s, item, t)
                    if item.group_id is not None:
                        s.add(item)
                        s.flush()
                        try:
                            self.batches.group_settled(s, self._job(item.job), item.group_id)
                        except NotFound:
                            pass
                s.add(item)
                self._wake[item.job].set()
                n += 1
            # nodes silent for long are gone. Their leases expire on their own deadlines above; this
            # only retires the node record, so it can wait out a daemon's start-up (imports and the
            # tokenizer take several seconds on a busy node, before its first beat)
            for node in s.exec(select(NodeRow).where(NodeRow.state != "gone")):
                cache = self._jobs.get(node.job)
                seen = self._seen.setdefault(node.id, now)
                if now - seen > max(cache.lease_seconds if cache else 30.0, NODE_SILENCE_SECONDS):
                    node.state, node.last_seen = "gone", seen
                    s.add(node)
            s.commit()
        if n:
            log.info("requeued %d expired lease(s)", n)
        return n

    async def check_health(self) -> None:
        urls = self.pool.known()
        if not urls:
            return

        async def probe(client: httpx.AsyncClient, url: str) -> tuple[str, bool, str]:
            if self._health_check is not None:
                ok = await self._health_check(url)
                return url, bool(ok), "" if ok else "health check failed"
            try:
                r = await client.get(url + "/health", timeout=self.health_timeout)
            except httpx.TimeoutException:
                now = self.clock()
                since = self._slow_since.setdefault(url, now)
                if now - since < self.slow_grace:
                    return url, self.pool.healthy(url), ""  # busy: keep its state for now
                return url, False, f"/health unanswered for {now - since:.0f}s"
            except httpx.HTTPError as e:
                self._slow_since.pop(url, None)
                return url, False, f"{type(e).__name__}: {e}"
            self._slow_since.pop(url, None)
            return url, r.status_code == 200, f"HTTP {r.status_code}"

        if self._http is None:
            self._http = httpx.AsyncClient()
        client = self._http
        for url, ok, why in await asyncio.gather(*(probe(client, u) for u in urls)):
            if self.pool.set_health(url, ok, why):
                log.warning("backend %s is %s%s", url, "healthy" if ok else "unhealthy", "" if ok else f": {why}")
                for job in list(self._jobs):
                    self._wake[job].set()

    async def run(self) -> None:
        last_health = 0.0
        while not self._stopped:
            try:
                self.expire()
                if time.monotonic() - last_health >= self.health_interval:
                    last_health = time.monotonic()
                    await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must survive a bad pass
                log.exception("scheduler background pass failed")
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        self._stopped = True
        for ev in list(self._wake.values()) + list(self._traj_wake.values()):
            ev.set()

    # ------------------------------------------------------------ results for trainers

    def trajectories(self, job: str, cursor: int = 0, limit: int = 1000) -> list[tuple[int, str]]:
        with Session(self.engine, expire_on_commit=False) as s:
            q = (select(TrajectoryRow.seq, TrajectoryRow.data).where(TrajectoryRow.job == job, TrajectoryRow.seq > cursor)
                 .order_by(TrajectoryRow.seq).limit(limit))
            return list(s.exec(q).all())

    async def follow(self, job: str, cursor: int, finished: Callable[[], bool],
                     timeout: float | None = None) -> AsyncIterator[tuple[int, str]]:
        """Every trajectory after `cursor`, as it arrives, until the job is finished and all are sent."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self._traj_wake[job]
            ev.clear()
            rows = self.trajectories(job, cursor)
            for seq, data in rows:
                cursor = seq
                yield seq, data
            if rows:
                continue
            if finished() or self._stopped:
                if not self.trajectories(job, cursor, 1):
                    return
                continue
            wait = 5.0 if deadline is None else min(5.0, deadline - time.monotonic())
            if wait <= 0:
                return
            try:
                await asyncio.wait_for(ev.wait(), timeout=wait)
            except asyncio.TimeoutError:
                yield 0, ""  # keep-alive tick

    def groups(self, job: str, samples: int) -> list[dict[str, Any]]:
        with Session(self.engine, expire_on_commit=False) as s:
            rows = s.exec(select(TrajectoryRow).where(TrajectoryRow.job == job)
                          .order_by(TrajectoryRow.prompt, TrajectoryRow.sample)).all()
        out: dict[int, dict[str, Any]] = {}
        for r in rows:
            g = out.setdefault(r.prompt, {"prompt": r.prompt, "samples": [], "rewards": [], "complete": False})
            g["samples"].append(json.loads(r.data))
            g["rewards"].append(r.reward)
        for g in out.values():
            g["complete"] = len(g["samples"]) == samples
        return [out[k] for k in sorted(out)]

    def pinned(self, job: str) -> dict[str, int]:
        """Backend URL → tasks of this job currently pinned to it (for status and tests)."""
        with Session(self.engine, expire_on_commit=False) as s:
            q = (select(ItemRow.backend, func.count()).where(ItemRow.job == job, ItemRow.holds_backend == True)  # noqa: E712
                 .group_by(ItemRow.backend))
            return {b: n for b, n in s.exec(q)}

