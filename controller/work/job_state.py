"""What the work core keeps in memory per job: its spec's scheduling settings and its wake-up events.

Read by every part (`queue`, `attempts`, `nodes`, `policy`); the jobs themselves live in `..store`.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass

from rolloutd.crds.rolloutjob import RolloutJob

from ..errors import NotFound
from ..store import Store
from .backends import BackendPool


def closed(job: RolloutJob) -> bool:
    """The job is being deleted or has finished: it takes no more nodes, leases or batches."""
    return job.metadata.deletion_timestamp is not None or job.status.phase.terminal


@dataclass
class JobCache:
    uid: str  # a job deleted and created again under its name is another job: nothing of the old one carries over
    generation: int
    backends: list[str]
    max_attempts: int
    lease_seconds: float


class Jobs:
    """The store's jobs with their scheduling settings cached per generation (a lease or a beat
    must not parse the spec again); a job's backends join the pool when it is first seen."""

    def __init__(self, store: Store, pool: BackendPool) -> None:
        self.store, self.pool = store, pool
        self._cache: dict[str, JobCache] = {}

    def get(self, name: str) -> RolloutJob:
        """The job (NotFound when it does not exist), its cache brought up to date."""
        job = self.store.get(name)
        self.sync(job)
        return job

    def sync(self, job: RolloutJob) -> JobCache:
        key, uid = job.metadata.key, job.metadata.uid or ""
        cache = self._cache.get(key)
        if cache is None or cache.uid != uid or cache.generation != job.metadata.generation:
            urls = [b.url.rstrip("/") for b in job.spec.llm.backends]
            for u in urls:
                self.pool.add(u)
            # keyed by (namespace, name): team-a's `train` never sets default's `train` cap or weight
            self.pool.admission.set_job(key, urls, job.spec.llm.max_episodes_per_backend, job.spec.priority)
            old = self._cache.get(key)
            cache = JobCache(uid, job.metadata.generation or 0, urls, job.spec.pipeline.max_attempts,
                             job.spec.pipeline.lease_seconds)
            self._cache[key] = cache
            if old is not None:
                self._unlist(old.backends)
        return cache

    def find(self, name: str | None) -> RolloutJob | None:
        """`get`, None for a deleted job (or no name)."""
        if name is None:
            return None
        try:
            return self.get(name)
        except NotFound:
            return None

    def cached(self, name: str) -> JobCache | None:
        return self._cache.get(name)

    def names(self) -> list[str]:
        return list(self._cache)

    def forget(self, name: str) -> None:
        """The job is gone (or going): nothing of it stays in memory, and a backend no other job lists is no
        longer probed (a deleted job's URL must not keep the controller calling it)."""
        old = self._cache.pop(name, None)
        self.pool.admission.forget_job(name)
        if old is not None:
            self._unlist(old.backends)

    def _unlist(self, urls: list[str]) -> None:
        listed = {u for c in self._cache.values() for u in c.backends}
        for url in set(urls) - listed:
            self.pool.discard(url)


class Wakeups:
    """One asyncio.Event per job: waiters clear it, read, then wait; writers set it."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def event(self, job: str) -> asyncio.Event:
        return self._events[job]

    def set(self, job: str) -> None:
        self._events[job].set()

    def set_all(self) -> None:
        for ev in list(self._events.values()):
            ev.set()
