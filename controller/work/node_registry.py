"""The registry of node daemons: registration, liveness (kept in memory), draining, retiring the silent.

`attempts` looks a caller up with `node`; `policy` waits on the active daemons; `..executors.slurm` drains.
"""
from __future__ import annotations

import logging
import sqlite3
import uuid
from typing import Any, Callable

from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from rolloutd.crds.node import (FEATURES, MIN_NODE_PROTOCOL, NODE_CALLS_PER_SECOND, NODE_PROTOCOL, RegisterRequest,
                                RegisterResponse, WEIGHT_STAMPS, beat_gap, heartbeat_seconds)

from ..dialects import raw, update_by_id
from ..errors import BadRequest, Conflict, NotFound
from .hot_sql import ahead
from .job_state import Jobs, closed
from .states import DaemonState
from .tables import NodeRow

log = logging.getLogger("rolloutd.scheduler")

NODE_SILENCE_SECONDS = 60.0
FULL_PASS_SECONDS = 5.0  # the silent-node pass reads the nodes table at least this often (`live` for the pacing)


class NodeRegistry:
    def __init__(self, engine: Engine, jobs: Jobs, clock: Callable[[], float],
                 calls_per_second: float = NODE_CALLS_PER_SECOND,
                 policy_named: Callable[[Any], tuple[Any, str | None]] = lambda job: (None, None)) -> None:
        """`policy_named`: a job's effective TenantPolicy and its name (`tenancy.Policies.effective_named`)."""
        self.engine, self.jobs, self.clock, self.policy_named = engine, jobs, clock, policy_named
        self._seen: dict[str, float] = {}  # node id → last call (a restarted controller starts the clock anew)
        self._job: dict[str, str] = {}  # node id → its job's key: a node never changes job
        self.features: dict[str, frozenset[str]] = {}  # node id → the protocol features it registered with
        self.budget = calls_per_second  # beats a second the beat-results daemons served here send together
        self.live = 0  # daemons not gone, counted by the silent-node pass (every FULL_PASS_SECONDS at most)
        self._next_pass = 0.0  # the silent-node pass reads the nodes table again from then on
        self.serves: Callable[[str], bool] | None = None  # node shards (`..shards`): the nodes this replica serves
        self.served: Callable[[], list[str]] | None = None  # node shards: those nodes (the silent-node pass reads them)
        self.owning: Any = None  # node shards: `..ha.serving.Serving`: its `check_ahead` fences each node call

    def seen(self, node_id: str, now: float) -> None:
        """The node's silence counts from `now` (it moved here from another replica)."""
        self._seen[node_id] = now

    def beat_gap(self) -> float:
        """The least gap between two beats of one beat-results daemon: the controller's pacing."""
        return beat_gap(self.live, self.budget)

    def register(self, req: RegisterRequest, features: list[str] | None = None) -> RegisterResponse:
        """`features`: those the daemon asked for (`crds.node.FEATURES_PARAM`); the answer names the ones served."""
        if req.protocol is None or not MIN_NODE_PROTOCOL <= req.protocol <= NODE_PROTOCOL:
            raise BadRequest(f"node {req.name!r} speaks node protocol {req.protocol}, this controller "
                             f"{MIN_NODE_PROTOCOL} to {NODE_PROTOCOL}: run a rolloutd on the nodes no newer than the "
                             "controller's")
        job = self.jobs.get(req.job)
        if closed(job):
            raise Conflict(f'rolloutjobs "{req.job}" is {job.status.phase.value}; it takes no more nodes', name=req.job)
        now = self.clock()
        served = None if features is None else [f for f in features if f in FEATURES]
        node = NodeRow(id=f"{req.name}-{uuid.uuid4().hex[:8]}", job=req.job, name=req.name, host=req.host,
                       pid=req.pid, slot=req.slot, slurm_job_id=req.slurm_job_id, slurm_node_id=req.slurm_node_id,
                       registered=now, last_seen=now, features=",".join(served or ()))
        with Session(self.engine, expire_on_commit=False) as s:
            s.add(node)
            s.commit()
            active = s.exec(select(func.count()).where(NodeRow.job == req.job,
                                                       NodeRow.state == DaemonState.active)).one()
        self._seen[node.id] = now
        self._job[node.id] = req.job
        self.features[node.id] = frozenset(served or ())
        self.live += 1
        lease = job.spec.pipeline.lease_seconds
        policy, policy_name = self.policy_named(job)  # the policy stored now
        log.info("node %s registered for job %s", node.id, req.job)
        return RegisterResponse(node_id=node.id, job=req.job, spec=job.spec.wire(), generation=job.metadata.generation,
                                lease_seconds=lease,
                                heartbeat_seconds=heartbeat_seconds(max(job.spec.executor.nodes, active), lease),
                                features=served, policy=policy, policy_name=policy_name,
                                job_uid=job.metadata.uid if WEIGHT_STAMPS in (served or ()) else None)

    def features_of(self, node_id: str) -> frozenset[str]:
        """The protocol features `node_id` registered with (stored with it: a restarted controller answers each
        daemon as it registered); none for a node never registered."""
        if node_id not in self.features:
            with self.engine.connect() as c:
                row = raw(c).execute("SELECT features FROM nodes WHERE id = ?", (node_id,)).fetchone()
            if row is None:
                return frozenset()
            self.features[node_id] = frozenset(f for f in (row[0] or "").split(",") if f)
        return self.features[node_id]

    def node(self, s: Session, node_id: str) -> NodeRow:
        """The calling daemon's record (NotFound when it is not registered or was declared lost)."""
        node = s.get(NodeRow, node_id)
        if node is None or node.state == DaemonState.gone:
            raise NotFound(f"node {node_id} is not registered (or was declared lost); register again")
        self._seen[node_id] = self.clock()  # liveness is kept in memory: no write per call
        return node

    def lookup(self, db: sqlite3.Connection, node_id: str) -> tuple[str, str] | None:
        """(job, state) of a node as plain values, None when unknown; the call counts as a sign of life. With node
        shards, first the fence: the node's calls are this replica's to answer (`..ha.serving.Serving.check_ahead`)."""
        return self.lookup_ahead(db, node_id)()

    def lookup_ahead(self, db: sqlite3.Connection, node_id: str) -> Callable[[], tuple[str, str] | None]:
        """`lookup` with the fence and the node's read sent now (the fence's lock first), both read by the function
        returned, the fence first (the reads sent after them share their round trip: `hot_sql.ahead`)."""
        fence = self.owning.check_ahead(db, node_id) if self.owning is not None else None
        sent = ahead(db, "SELECT job, state FROM nodes WHERE id = ?", (node_id,))

        def read() -> tuple[str, str] | None:
            if fence is not None:
                fence()
            row = sent()
            if row is not None and row[1] != DaemonState.gone:
                self._seen[node_id] = self.clock()
                self._job[node_id] = row[0]
            return row
        return read

    def job_of(self, node_id: str) -> str | None:
        """The key of the job `node_id` registered for (a node's job never changes); None for one never registered."""
        if node_id not in self._job:
            with Session(self.engine) as s:
                node = s.get(NodeRow, node_id)
                if node is None:
                    return None
                self._job[node_id] = node.job
        return self._job[node_id]

    def caller(self, db: sqlite3.Connection, node_id: str,
               sent: Callable[[], tuple[str, str] | None] | None = None) -> tuple[str, str]:
        """`node` as plain (job, state) (`sent`: its `lookup_ahead`)."""
        row = (sent or self.lookup_ahead(db, node_id))()
        if row is None or row[1] == DaemonState.gone:
            raise NotFound(f"node {node_id} is not registered (or was declared lost); register again")
        return row

    def nodes(self, job: str) -> list[NodeRow]:
        with Session(self.engine, expire_on_commit=False) as s:
            return list(s.exec(select(NodeRow).where(NodeRow.job == job, NodeRow.state != DaemonState.gone)))

    def listing(self, job: str) -> list[tuple[str, str, str, str, int | None, float]]:
        """(id, name, host, state, slot, last call) of the job's daemons not gone: plain rows (1000 ORM objects
        cost a dashboard's build ~20 ms), the last call from memory (the table keeps the registration's)."""
        with self.engine.connect() as c:
            rows = raw(c).execute("SELECT id, name, host, state, slot, last_seen FROM nodes WHERE job = ? AND "
                                  "state != ?", (job, DaemonState.gone.value)).fetchall()
        seen = self._seen
        return [(i, name, host, state, slot, seen.get(i, last)) for i, name, host, state, slot, last in rows]

    def count_active(self, job: str) -> int:
        with Session(self.engine) as s:
            return s.exec(select(func.count()).where(NodeRow.job == job, NodeRow.state == DaemonState.active)).one()

    def active(self, job: str) -> list[str]:
        return [n.id for n in self.nodes(job) if n.state == DaemonState.active]

    def deregister(self, node_id: str) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            node = s.get(NodeRow, node_id)
            if node is not None:
                node.state = DaemonState.gone
                s.add(node)
                if self.owning is not None:  # node shards: the replicas' views drop it
                    s.flush()
                    self.owning.gone(raw(s.connection()), [node_id])
                s.commit()

    def release_job(self, job: str) -> None:
        """The job's daemons were stopped (SIGTERM: they drain; their node credential revoked, so none can deregister):
        its active nodes are draining, still listed (the job's page, their logs) but no longer active (an update
        waiting for the active nodes' beats must not wait for them, `policy_versions`)."""
        with Session(self.engine, expire_on_commit=False) as s:
            nodes = list(s.exec(select(NodeRow).where(NodeRow.job == job, NodeRow.state == DaemonState.active)))
            for node in nodes:
                node.state = DaemonState.draining
                s.add(node)
            if nodes:
                s.commit()

    def drain(self, job: str, node_ids: list[str]) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            for node in s.exec(select(NodeRow).where(NodeRow.job == job, NodeRow.id.in_(node_ids))):
                node.state = DaemonState.draining
                s.add(node)
            s.commit()

    def heard_all(self, now: float) -> None:
        """The controller stalled: no node's silence meanwhile counts against it."""
        for node_id in self._seen:
            self._seen[node_id] = max(self._seen[node_id], now)

    def retire_silent(self, s: Session, now: float) -> None:
        """Nodes silent for long are gone. Their leases expire on their own deadlines; this only
        retires the node record, so it can wait out a daemon's start-up (imports and the tokenizer
        take several seconds on a busy node, before its first beat). Plain rows: this runs over every node (a
        thousand ORM objects each time, at a thousand nodes). It reads the table every FULL_PASS_SECONDS, or sooner
        when a node it saw live could be silent by then: the scheduler's pass is every half second on the event
        loop, and the read waited there on SQLite's locks while a batch opened in a worker thread (issue 36)."""
        if now < self._next_pass:
            return
        db = raw(s.connection())
        silent = []
        live = 0
        due = now + FULL_PASS_SECONDS  # a node registered meanwhile is counted live by then
        if self.served is not None:  # node shards: the nodes this replica serves, not every replica's
            rows = db.execute("SELECT id, job FROM nodes WHERE id = ANY(?) AND state != ?",
                              (sorted(self.served()), DaemonState.gone.value))
        else:
            rows = db.execute("SELECT id, job FROM nodes WHERE state != ?", (DaemonState.gone.value,))
        for node_id, job in rows:
            if self.serves is not None and not self.serves(node_id):
                continue  # another replica's: it hears that node
            live += 1
            cache = self.jobs.cached(job)
            seen = self._seen.setdefault(node_id, now)
            if now - seen > max(cache.lease_seconds if cache else 30.0, NODE_SILENCE_SECONDS):
                silent.append((DaemonState.gone.value, seen, node_id))
            else:  # silent at the earliest NODE_SILENCE_SECONDS after it was last heard
                due = min(due, seen + NODE_SILENCE_SECONDS)
        self._next_pass = due
        self.live = live - len(silent)
        if silent:
            update_by_id(db, NodeRow.__table__, ("state", "last_seen"), silent)
            if self.owning is not None:
                self.owning.gone(db, [node_id for _, _, node_id in silent])
