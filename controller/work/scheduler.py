"""The central scheduler: one façade over the work core, for the routes, the reconciler and the server.

It wires `expansion`, `queue`, `attempts`, `nodes`, `policy`, `feed`, `batches`, `backends`: they do the work
(`attempts` owns an attempt's life: lease, beat, result, expiry). Every collaborator is passed at construction.

All state lives in SQLite (`tables`, beside the jobs), so a restarted controller resumes with every
lease, result and backend pin where it was. The reconciler calls `progress`/`registered`/`forget`
(the scheduler is its `WorkTracker`); the node routes call `register`, `lease`, `heartbeat`,
`results`, `give_back`, `deregister`; the trainer routes read `trajectories`/`follow`/`groups`,
take batches and announce policy versions.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any, AsyncIterator, Awaitable, Callable

from sqlmodel import Session

from rolloutd.crds.aiokit import wait_event
from rolloutd.crds.node import (
    Heartbeat,
    HeartbeatResponse,
    LeaseResponse,
    NODE_CALLS_PER_SECOND,
    RegisterRequest,
    RegisterResponse,
    ResultAck,
    ResultBatch,
)
from rolloutd.crds.rolloutjob import RolloutJob, StageCounts

from ..errors import BadRequest, Conflict, NotFound, ServiceUnavailable
from ..ports import Progress
from ..store import Store
from . import background, hot_sql, seq_floor, tables
from .admission import Admission
from .attempts import Attempts
from .backends import BackendHttp, BackendPool, HealthProbe
from .batches import Batches
from .expansion import Expansions, PolicyFor
from .feed import Feed
from .job_state import Jobs, Wakeups, closed
from .node_registry import NodeRegistry
from .policy_versions import PolicyVersions
from .queue import ItemQueue
from .retention import DEFAULT_RETENTION_SECONDS, Retention, stored
from .staleness import StaleGroups
from .states import BatchState, ItemState
from .stats import JobStats
from .tables import BatchRow, ExpansionRow, NodeRow

log = logging.getLogger("rolloutd.scheduler")


class Scheduler:
    def __init__(self, store: Store, *, health_interval: float = 2.0,
                 health_check: Callable[[str], Awaitable[Any]] | None = None, clock: Callable[[], float] = time.time,
                 health_timeout: float = 3.0, slow_grace: float = 20.0, max_episodes: int | None = None,
                 policy_for: PolicyFor = lambda job: None, on_idle: Callable[[str], None] | None = None,
                 node_calls_per_second: float = NODE_CALLS_PER_SECOND,
                 result_retention: float = DEFAULT_RETENTION_SECONDS):
        """`on_idle`: called with a job's name when it may be finished now (its last rollout ended, or it
        failed), from any thread; `policy_for`: the job's effective TenantPolicy (None: unrestricted);
        `max_episodes` (the default of llm.maxEpisodesPerBackend) and `node_calls_per_second` (the node
        protocol's budget), `result_retention` (how long a deleted job's results stay): the controller's settings
        (`ControllerSettings`)."""
        self.store, self.engine, self.clock = store, store.engine, clock
        tables.create(self.engine)
        self.retention = Retention(self.engine, stored(store), self.purge, result_retention, clock)
        # a job's queue changed, or a backend slot its leases wait for is free: its waiting lease calls look again
        changed = Wakeups()
        self.pool = BackendPool(Admission(clock, max_episodes,
                                          on_free=lambda jobs: [changed.set(job) for job in jobs]))
        self.health_interval = health_interval
        http = BackendHttp()
        # the probes have an HTTP client of their own: they run on a loop of their own (`HealthProbe.check`)
        self.health = HealthProbe(self.pool, BackendHttp(), clock, check=health_check, timeout=health_timeout,
                                  slow_grace=slow_grace)
        self.jobs = Jobs(store, self.pool)
        self.queue = ItemQueue(self.engine, self.pool, clock, changed)
        # policy_for: the job's effective TenantPolicy (None: unrestricted), for its item quota
        self.expansions = Expansions(self.engine, clock, self.queue.wake, policy_for)
        self._admitting: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.feed = Feed(self.engine)
        self.stats = JobStats(self.engine)  # the trajectories' running sums: the web UI's and the API's `…/stats`
        self.registry = NodeRegistry(self.engine, self.jobs, clock, node_calls_per_second)
        self.policies = PolicyVersions(self.engine, self.jobs, self.registry, http, self.queue.wake)
        self.stale = StaleGroups(lambda job: self.policies.describe(job)["history"])
        self.batches = Batches(self.queue, self.expansions.prompts, lambda job: _items_per_job(policy_for(job)),
                               gate=self.stale.gate)
        self.attempts = Attempts(self.engine, self.queue, self.jobs, self.registry, self.policies, self.expansions,
                                 self.batches, self.feed, clock, on_idle)
        self.group = hot_sql.GroupCommit(self.engine)  # node calls committed together
        self.seqs = seq_floor.SeqFloor(self.engine, store.home)
        with hot_sql.transaction(self.engine) as tx:  # a restart: the leases held when the controller stopped
            self.queue.live.load(tx.db, clock(), self.lease_seconds)
            self.seqs.raise_floor(tx.db)  # restored from a backup: seqs go on above those issued
        self.seqs.record()

    def lease_seconds(self, name: str) -> float:
        try:
            return self.jobs.get(name).spec.pipeline.lease_seconds
        except NotFound:
            return 30.0

    # ------------------------------------------------------------ node protocol (node routes)

    def register(self, req: RegisterRequest, features: list[str] | None = None) -> RegisterResponse:
        return self.registry.register(req, features)

    async def lease(self, node_id: str, max_items: int, wait: float = 0.0) -> LeaseResponse:
        return await self.attempts.lease(node_id, max_items, wait)

    def heartbeat(self, node_id: str, hb: Heartbeat, lease: int | None = None) -> HeartbeatResponse:
        """A beat in a transaction of its own; with `lease` (the node's free slots) the next leases ride on it."""
        return hot_sql.run_alone(self.engine, self._beat(node_id, hb, lease))

    async def heartbeat_grouped(self, node_id: str, hb: Heartbeat, lease: int | None = None) -> HeartbeatResponse:
        """`heartbeat`, its transaction committed with the other calls of this turn of the loop (`hot_sql.GroupCommit`)."""
        return await self.group.submit(self._beat(node_id, hb, lease))

    def _beat(self, node_id: str, hb: Heartbeat, lease: int | None) -> hot_sql.Work:
        job = self.jobs.find(self.registry.job_of(node_id))  # read before: the group must not wait on the store
        return lambda tx: self.attempts.beat(tx, node_id, hb, lease, job)

    async def results_grouped(self, node_id: str, batch: ResultBatch, lease: int | None = None) -> ResultAck:
        """`results`, committed with the other calls of this turn of the loop."""
        return await self.group.submit(self._results(node_id, batch, lease))

    def results(self, node_id: str, batch: ResultBatch, lease: int | None = None) -> ResultAck:
        """A batch of results; with `lease` (the node's free slots) the next leases ride on the reply."""
        return hot_sql.run_alone(self.engine, self._results(node_id, batch, lease))

    def _results(self, node_id: str, batch: ResultBatch, lease: int | None) -> hot_sql.Work:
        job = self.jobs.find(self.registry.job_of(node_id))  # read before: the group must not wait on the store
        return lambda tx: self.attempts.results(tx, node_id, batch, job, lease)

    def give_back(self, node_id: str, attempt_ids: list[str], reason: str) -> int:
        return self.attempts.give_back(node_id, attempt_ids, reason)

    def deregister(self, node_id: str) -> None:
        self.registry.deregister(node_id)

    def node_job(self, node_id: str) -> str | None:
        return self.registry.job_of(node_id)

    def nodes(self, job: str) -> list[NodeRow]:
        return self.registry.nodes(job)

    def node_listing(self, job: str) -> list[tuple[str, str, str, str, int | None, float]]:
        return self.registry.listing(job)

    def leases_held(self, node_id: str) -> int:
        """The rollouts node `node_id` holds leased now (in flight on it), from memory."""
        return self.queue.live.held(node_id)

    def drain(self, job: str, node_ids: list[str]) -> None:
        self.registry.drain(job, node_ids)

    # ------------------------------------------------------------ results, policy (trainer routes)

    def trajectories(self, job: str, cursor: int = 0, limit: int = 1000) -> list[tuple[int, str]]:
        return self.feed.trajectories(job, cursor, limit)

    def follow(self, job: str, cursor: int, finished: Callable[[], bool],
               timeout: float | None = None) -> AsyncIterator[tuple[int, str]]:
        return self.feed.follow(job, cursor, finished, timeout)

    def groups(self, job: str, samples: int) -> list[dict[str, Any]]:
        return self.feed.groups(job, samples)

    def pinned(self, job: str) -> dict[str, int]:
        """Backend URL → the job's tasks pinned to it now, from admission's counts in memory (the database's
        GROUP BY over every item of the job took a dashboard's build ~50 ms at 1000 nodes)."""
        return {url: n for url, jobs in list(self.pool.admission.admitted.items()) if (n := jobs.get(job, 0)) > 0}

    def policy(self, job: str) -> dict[str, Any]:
        return {**self.policies.describe(job), "staleness": self.stale.describe(job)}

    def policy_version(self, job: str) -> int | str | None:
        return self.policies.version(job)

    async def announce_policy(self, name: str, version: int | str, weights_path: str | None = None,
                              pause: bool | None = None, drain_timeout: float = 120.0) -> dict[str, Any]:
        out = await self.policies.announce(name, version, weights_path, pause, drain_timeout)
        job = self.jobs.get(name)
        if job.spec.policy.max_staleness is not None:
            out["staleness"] = self._sweep(job)  # on the loop, as request_batch: it wakes leasing
        return out

    def _sweep(self, job: RolloutJob) -> dict[str, int]:
        history = self.policies.describe(job.metadata.key)["history"]
        with Session(self.engine, expire_on_commit=False) as s:
            done = self.stale.sweep(s, job, history, self.queue, self.batches)
            s.commit()
        return done

    # ------------------------------------------------------------ WorkTracker (reconciler)

    def expand(self, job: RolloutJob) -> ExpansionRow:
        """The whole expansion at once (tests, tools); the reconcile's step is `admit`."""
        return self.expansions.expand(job)

    async def admit(self, job: RolloutJob) -> ExpansionRow:
        """The step "admit": the job's dataset into queued items, at most `expansion.CHUNK` rows per
        transaction, each in a worker thread (the event loop serves other tenants' calls meanwhile), one
        admission of a job at a time; its leases are woken after each step."""
        key = job.metadata.key
        row = self.expansions.row(job)
        if row is not None and (not row.pending or row.error):
            return row  # admitted already: a read
        async with self._admitting[key]:
            while True:
                row = await asyncio.to_thread(self.expansions.admit, job, False)
                self.queue.wake(key)
                if not row.pending or row.error:
                    return row

    def backends_down(self, job: RolloutJob) -> str:
        """Why no rollout of the job can call its model ("" while a backend of it is healthy or none is known)."""
        urls = [b.url.rstrip("/") for b in job.spec.llm.backends]
        if not urls or any(u not in self.pool.unhealthy for u in urls):
            return ""
        return "every LLM backend is down: " + "; ".join(f"{u}: {self.pool.unhealthy[u]}" for u in urls)

    async def progress(self, job: RolloutJob) -> Progress:
        """The job's counts and whether it is done or failed; reads only (the expansion is `admit`'s)."""
        exp = self.expansions.row(job)
        self.jobs.sync(job)
        counts = StageCounts(total=exp.total if exp is not None else 0)
        # the reads below walk the job's index and trajectories (tens of ms at a thousand nodes): in a thread,
        # on a connection of their own (WAL readers do not wait on the writer), not on the event loop
        states = await asyncio.to_thread(self.queue.counts, job.metadata.key)
        # the stages of leased items live in memory (`live`); the database says how many are leased: those no
        # beat has placed in a stage yet (or held in memory a moment longer) count as queued, as before a lease
        stages = self.queue.live.stages(job.metadata.key)
        counts.init, counts.run, counts.eval = (stages.get(stage, 0) for stage in ("init", "run", "eval"))
        started = counts.init + counts.run + counts.eval
        counts.queued = states.get(ItemState.queued, 0) + max(states.get(ItemState.leased, 0) - started, 0)
        counts.succeeded = states.get(ItemState.done, 0)
        counts.failed = states.get(ItemState.failed, 0)
        counts.cancelled = states.get(ItemState.cancelled, 0)
        if exp is not None and exp.error:
            return Progress(counts, failed=exp.error, reason=exp.reason or "WorkFailed")
        expanded = exp is not None and not exp.pending
        live = counts.queued + counts.init + counts.run + counts.eval
        kinds, reward_mean = await asyncio.to_thread(self.feed.outcomes, job.metadata.key)
        counts.scored, counts.agent_failed, counts.infra_failed = (kinds.get(k, 0) for k in ("none", "agent", "infra"))
        extra: dict[str, Any] = {"policyVersion": self.policy_version(job.metadata.key), "rewardMean": reward_mean}
        if down := self.backends_down(job):
            extra["backendsDown"] = down
        if counts.infra_failed and live == 0:  # the reconciler names it if the job fails for it
            extra["infraReason"] = await asyncio.to_thread(self.feed.last_reason, job.metadata.key, "infra")
        if job.spec.batch_mode:
            with Session(self.engine, expire_on_commit=False) as s:
                counts.total = live + counts.succeeded + counts.failed + counts.cancelled
                extra["batch"] = self.batches.status(s, job.metadata.key)
                done = self.batches.finished(s, job) and live == 0
                failed = self.batches.failure(s, job.metadata.key)
            if failed:
                return Progress(counts, failed=failed, extra=extra)
            return Progress(counts, done=done, extra=extra)
        return Progress(counts, done=expanded and exp.total > 0 and live == 0, extra=extra)

    async def registered(self, job: RolloutJob) -> int:
        return await asyncio.to_thread(self.registry.count_active, job.metadata.key)

    async def forget(self, job: RolloutJob) -> None:
        """The job is being deleted: cancel its live items (daemons learn it at their next beat)."""
        name = job.metadata.key
        with Session(self.engine, expire_on_commit=False) as s:
            self.queue.cancel_live(s, name)
            s.commit()
        self.queue.wake(name)
        self.expansions.forget(name)  # nothing the job kept in memory outlives it (a re-created job starts clean)
        self._admitting.pop(name, None)
        self.stats.forget(name)
        self.policies.forget(name)
        self.stale.forget(name)
        self.jobs.forget(name)

    def purge(self, name: str) -> None:
        self.expansions.forget(name)
        self.stats.forget(name)
        with Session(self.engine, expire_on_commit=False) as s:
            tables.purge(s, name)
            s.commit()
        self.policies.forget(name)
        self.stale.forget(name)
        self.jobs.forget(name)

    # ------------------------------------------------------------ batches (trainer API)

    def request_batch(self, name: str, k: int | None = None, prompts: list[int] | None = None) -> dict[str, Any]:
        job = self.jobs.get(name)
        if not job.spec.batch_mode:
            raise BadRequest(f'rolloutjobs "{name}" is not a batch job: set spec.dapo.enabled or spec.batches')
        if closed(job):
            raise Conflict(f'rolloutjobs "{name}" is {job.status.phase.value}; it serves no more batches')
        self.expand(job)
        with Session(self.engine, expire_on_commit=False) as s:
            row = self.batches.request(s, job, k, prompts)
            s.commit()
            out = self.batches.snapshot(s, name, row.k)
        out.pop("groups")
        return out

    def fill_batch(self, name: str, k: int) -> int:
        """One more step of opening batch `k`'s groups (`Batches.fill`): how many it opened (0: done)."""
        job = self.jobs.get(name)
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(BatchRow, (name, k))
            opened = 0 if row is None else self.batches.fill(s, job, row)
            s.commit()
        return opened

    async def batch(self, name: str, k: int, wait: bool = False, timeout: float | None = None,
                    include_all: bool = False) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self.feed.arrived.event(name)
            ev.clear()
            with Session(self.engine, expire_on_commit=False) as s:
                snap = self.batches.snapshot(s, name, k, include_all)
            if not wait or snap["state"] in (BatchState.complete, BatchState.failed):
                return snap
            if self.feed.stopped:  # a restart: the client asks again, of the controller that comes back
                raise ServiceUnavailable(f"the controller is stopping; batch {k} of rolloutjobs \"{name}\" is not complete "
                                  "yet: retry")
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return snap
            await wait_event(ev, min(left, 30.0))

    # ------------------------------------------------------------ background duties

    def expire(self) -> int:
        return self.attempts.expire()

    async def check_health(self) -> None:
        await background.check_health(self)

    def stalled(self, seconds: float) -> None:
        background.stalled(self, seconds)

    async def run(self) -> None:
        await background.run(self)

    def stop(self) -> None:
        self.seqs.record()
        self.health.close()
        self.queue.stopped = True
        self.queue.changed.set_all()
        self.feed.stop()


def _items_per_job(policy) -> int | None:
    return None if policy is None else policy.quotas.items_per_job
