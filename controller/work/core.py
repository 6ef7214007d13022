"""The work core's parts, built once: expansion, queue, attempts, nodes, policy versions, feed, batches, backends.

`build_work` makes each part with the collaborators it names; the composition root (`controller/root.py`) holds
the result, the routes take the parts they use from it, and `scheduler.Scheduler` keeps the logic of its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from sqlmodel import Session

from rolloutd.crds.node import NODE_CALLS_PER_SECOND

from ..errors import NotFound
from ..store import Store
from ..access.tenancy import Policies
from . import hot_sql, seq_floor, tables
from .admission import Admission
from .attempts import Attempts
from .backend_health import HealthProbe
from .backend_http import BackendHttp
from .backends import BackendPool
from .batches import Batches
from .expansion import Expansions
from .feed import Feed
from .first_tokens import FirstTokens
from .job_state import Jobs, Wakeups
from .node_calls import NodeCalls
from .node_registry import NodeRegistry
from .policy_versions import PolicyVersions
from .queue import ItemQueue
from .retention import DEFAULT_RETENTION_SECONDS, Retention, stored
from .staleness import StaleGroups
from .stats import JobStats

DEFAULT_LEASE_SECONDS = 30.0  # a lease's length when its job is gone (`Work.lease_seconds`)


@dataclass(frozen=True)
class Work:
    """Every part of the work core, each made once (`build_work`); none forwards to another."""
    store: Store
    clock: Callable[[], float]
    health_interval: float
    pool: BackendPool
    health: HealthProbe
    jobs: Jobs
    queue: ItemQueue
    expansions: Expansions
    feed: Feed
    stats: JobStats
    registry: NodeRegistry
    policies: PolicyVersions
    stale: StaleGroups
    batches: Batches
    attempts: Attempts
    calls: NodeCalls
    first_tokens: FirstTokens  # the model calls' time to first token, as reported (a metric)
    seqs: seq_floor.SeqFloor
    retention: Retention

    def lease_seconds(self, name: str) -> float:
        try:
            return self.jobs.get(name).spec.pipeline.lease_seconds
        except NotFound:
            return DEFAULT_LEASE_SECONDS

    def drop(self, name: str) -> None:
        """Nothing a job kept in memory outlives it (a re-created job starts clean)."""
        self.expansions.forget(name)
        self.stats.forget(name)
        self.policies.forget(name)
        self.stale.forget(name)
        self.jobs.forget(name)

    def purge(self, name: str) -> None:
        """Every row of a deleted job goes (its retention ran out, or `rolloutctl delete --purge`)."""
        with Session(self.store.engine, expire_on_commit=False) as s:
            tables.purge(s, name)
            s.commit()
        self.drop(name)


def build_work(store: Store, *, policies: Policies | None = None, stats: JobStats | None = None,
               health_interval: float = 2.0, health_check: Callable[[str], Awaitable[Any]] | None = None,
               clock: Callable[[], float] = time.time, health_timeout: float = 3.0, slow_grace: float = 20.0,
               max_episodes: int | None = None, backend_tokens: int | None = None, on_idle: Callable[[str], None] | None = None,
               node_calls_per_second: float = NODE_CALLS_PER_SECOND,
               result_retention: float = DEFAULT_RETENTION_SECONDS, stall_seconds: float | None = None) -> Work:
    """`policies`: the tenancy policies (quotas and data roots; the root's, else one of this store's);
    `stats`: the trajectories' running sums (the root's, else new ones); `on_idle`: called with a job's name when it
    may be finished now (its last rollout ended, or it failed), from any thread; `max_episodes` (the default of
    llm.maxEpisodesPerBackend), `backend_tokens` (the tokens in flight jobs share on a backend; None: the engine's KV cache), `node_calls_per_second` (the node protocol's budget), `result_retention` (how long a
    deleted job's results stay) and `stall_seconds` (a rollout in one stage this long is stalled): the controller's
    settings (`ControllerSettings`)."""
    engine = store.engine
    tables.create(engine)
    policies = policies if policies is not None else Policies(store)
    # a job's queue changed, or a backend slot its leases wait for is free: its waiting lease calls look again
    changed = Wakeups()
    # backend_tokens None: each engine's KV cache is its budget of tokens in flight (`tokenshare.budget`)
    pool = BackendPool(Admission(clock, max_episodes, on_free=lambda jobs: [changed.set(job) for job in jobs],
                                 tokens=backend_tokens))
    http = BackendHttp()
    # the probes have an HTTP client of their own: they run on a loop of their own (`HealthProbe.check`)
    health = HealthProbe(pool, BackendHttp(), clock, check=health_check, timeout=health_timeout,
                         slow_grace=slow_grace)
    jobs = Jobs(store, pool)
    queue = ItemQueue(engine, pool, clock, changed, stall_seconds=stall_seconds)
    expansions = Expansions(engine, clock, queue.wake, policies.effective)  # the job's policy: its item quota
    feed = Feed(engine)
    registry = NodeRegistry(engine, jobs, clock, node_calls_per_second, policies.effective_named)
    versions = PolicyVersions(engine, jobs, registry, http, queue.wake, store.durable.settle)
    stale = StaleGroups(lambda job: versions.describe(job)["history"])
    batches = Batches(queue, expansions.prompts, lambda job: _items_per_job(policies.effective(job)), gate=stale.gate)
    attempts = Attempts(engine, queue, jobs, registry, versions, expansions, batches, feed, clock, on_idle,
                        on_stale=stale.rerun)
    first_tokens = FirstTokens()
    made: list[Work] = []  # the retention purges through the finished record
    retention = Retention(engine, stored(store), lambda name: made[0].purge(name), result_retention, clock)
    work = Work(store=store, clock=clock, health_interval=health_interval, pool=pool, health=health, jobs=jobs,
                queue=queue, expansions=expansions, feed=feed, stats=stats if stats is not None else JobStats(engine),
                registry=registry, policies=versions, stale=stale, batches=batches, attempts=attempts,
                calls=NodeCalls(engine, jobs, registry, attempts, first_tokens), first_tokens=first_tokens,
                seqs=seq_floor.SeqFloor(engine, store.home), retention=retention)
    made.append(work)
    with hot_sql.transaction(engine) as tx:  # a restart: the leases held when the controller stopped
        queue.leases.load(tx.db, clock(), work.lease_seconds)
        work.seqs.raise_floor(tx.db)  # restored from a backup: seqs go on above those issued
    work.seqs.record()
    return work


def _items_per_job(policy) -> int | None:
    return None if policy is None else policy.quotas.items_per_job
