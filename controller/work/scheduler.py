"""The scheduler: the work core's own logic — admit a job, read its progress, forget it, serve batches, announce
policy versions — and the background loop; the reconciler's `WorkTracker` (`ports.py`).

The parts it composes (`core.Work`: expansion, queue, attempts, nodes, policy versions, feed, batches, backends)
are built once by `core.build_work` and held by the composition root (`root.py`); the node and trainer routes call
those parts directly. All state lives in SQLite (`tables`, beside the jobs), so a restarted controller resumes
with every lease, result and backend pin where it was.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Any

from sqlmodel import Session

from rolloutd.crds.kit.aiokit import wait_event
from rolloutd.crds.job_status import StageCounts
from rolloutd.crds.rolloutjob import RolloutJob

from ..errors import BadRequest, Conflict, ServiceUnavailable
from ..ports import Progress
from . import background, group_commit
from .core import Work
from .job_state import closed
from .states import BatchState, ItemState
from .tables import ExpansionRow

FILL_PAUSE = 0.01  # between two steps of opening a batch: the loop's group commits take the database lock meanwhile


class Scheduler:
    def __init__(self, work: Work) -> None:
        self.work = work
        self._admitting: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    # ------------------------------------------------------------ results, policy (trainer routes)

    def policy(self, job: str) -> dict[str, Any]:
        """The job's policy versions and what the staleness bound did (the trainer API, the web UI)."""
        return {**self.work.policies.describe(job), "staleness": self.work.stale.describe(job)}

    async def announce_policy(self, name: str, version: int | str, weights_path: str | None = None,
                              pause: bool | None = None, drain_timeout: float = 120.0) -> dict[str, Any]:
        """The route's answer needs no sync of its own (`middleware._unsynced`): the announce synced its commit, and a
        sweep is synced here."""
        out = await self.work.policies.announce(name, version, weights_path, pause, drain_timeout)
        job = self.work.jobs.get(name)
        if job.spec.policy.max_staleness is not None:
            out["staleness"] = self._sweep(job)  # on the loop, as request_batch: it wakes leasing
            await self.work.policies.settle()
        return out

    def _sweep(self, job: RolloutJob) -> dict[str, int]:
        history = self.work.policies.describe(job.metadata.key)["history"]
        with Session(self.work.store.engine, expire_on_commit=False) as s:
            done = self.work.stale.sweep(s, job, history, self.work.queue, self.work.batches)
            s.commit()
        return done

    # ------------------------------------------------------------ WorkTracker (reconciler)

    async def admit(self, job: RolloutJob) -> ExpansionRow:
        """The step "admit": the job's dataset into queued items, at most `expansion.CHUNK` rows per
        transaction, each in a worker thread (the event loop serves other tenants' calls meanwhile), one
        admission of a job at a time; its leases are woken after each step."""
        key = job.metadata.key
        row = self.work.expansions.row(job)
        if row is not None and (not row.pending or row.error):
            return row  # admitted already: a read
        async with self._admitting[key]:
            while True:
                row = await asyncio.to_thread(self.work.expansions.admit, job, False)
                self.work.queue.wake(key)
                if not row.pending or row.error:
                    return row

    def backends_down(self, job: RolloutJob) -> str:
        """Why no rollout of the job can call its model ("" while a backend of it is healthy or none is known)."""
        urls = [b.url.rstrip("/") for b in job.spec.llm.backends]
        if not urls or any(u not in self.work.pool.unhealthy for u in urls):
            return ""
        return "every LLM backend is down: " + "; ".join(f"{u}: {self.work.pool.unhealthy[u]}" for u in urls)

    async def progress(self, job: RolloutJob) -> Progress:
        """The job's counts and whether it is done or failed; reads only (the expansion is `admit`'s)."""
        exp = self.work.expansions.row(job)
        self.work.jobs.sync(job)
        counts = StageCounts(total=exp.total if exp is not None else 0)
        # the reads below walk the job's index and trajectories (tens of ms at a thousand nodes): in a thread,
        # on a connection of their own (WAL readers do not wait on the writer), not on the event loop
        states = await asyncio.to_thread(self.work.queue.counts, job.metadata.key)
        # the stages of leased items live in memory (`leases`); the database says how many are leased: those no
        # beat has placed in a stage yet (or held in memory a moment longer) count as queued, as before a lease
        stages = self.work.queue.leases.stages(job.metadata.key)
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
        kinds, reward_mean = await asyncio.to_thread(self.work.feed.outcomes, job.metadata.key)
        counts.scored, counts.agent_failed, counts.infra_failed = (kinds.get(k, 0) for k in ("none", "agent", "infra"))
        progress = Progress(counts, policy_version=self.work.policies.version(job.metadata.key),
                            reward_mean=reward_mean, backends_down=self.backends_down(job))
        if counts.infra_failed and live == 0:  # the reconciler names it if the job fails for it
            progress.infra_reason = await asyncio.to_thread(self.work.feed.last_reason, job.metadata.key, "infra")
        if job.spec.batch_mode:
            with Session(self.work.store.engine, expire_on_commit=False) as s:
                counts.total = live + counts.succeeded + counts.failed + counts.cancelled
                progress.batch = self.work.batches.status(s, job.metadata.key)
                progress.done = self.work.batches.finished(s, job) and live == 0
                progress.failed = self.work.batches.failure(s, job.metadata.key)
            if progress.failed:
                progress.done = False
            return progress
        progress.done = expanded and exp.total > 0 and live == 0
        return progress

    async def registered(self, job: RolloutJob) -> int:
        return await asyncio.to_thread(self.work.registry.count_active, job.metadata.key)

    async def released(self, job: RolloutJob) -> None:
        await asyncio.to_thread(self.work.registry.release_job, job.metadata.key)

    async def forget(self, job: RolloutJob) -> None:
        """The job is being deleted: cancel its live items (daemons learn it at their next beat)."""
        name = job.metadata.key
        with Session(self.work.store.engine, expire_on_commit=False) as s:
            self.work.queue.cancel_live(s, name)
            s.commit()
        self.work.queue.wake(name)
        self.work.drop(name)  # nothing the job kept in memory outlives it (a re-created job starts clean)
        self._admitting.pop(name, None)

    # ------------------------------------------------------------ batches (trainer API)

    def request_batch(self, name: str, k: int | None = None, prompts: list[int] | None = None) -> dict[str, Any]:
        job = self.work.jobs.get(name)
        if not job.spec.batch_mode:
            raise BadRequest(f'rolloutjobs "{name}" is not a batch job: set spec.dapo.enabled or spec.batches')
        if closed(job):
            raise Conflict(f'rolloutjobs "{name}" is {job.status.phase.value}; it serves no more batches')
        self.work.expansions.expand(job)
        with Session(self.work.store.engine, expire_on_commit=False) as s:
            row = self.work.batches.request(s, job, k, prompts)
            s.commit()
            out = self.work.batches.snapshot(s, name, row.k)
        out.pop("groups")
        return out

    async def fill_batch(self, name: str, k: int) -> int:
        """Open the rest of batch `k`'s groups, a step (`Batches.fill`) at a time in a worker thread, FILL_PAUSE
        seconds between steps: the SQL and its commits are off the event loop, which wakes the job's leases after
        each step (issue 36: 3000 groups held the loop ~4 s in commits alone). Returns the steps that opened any."""
        job = self.work.jobs.get(name)
        steps = 0
        while True:
            t0 = time.monotonic()
            if not await asyncio.to_thread(self._fill_step, job, k):
                return steps
            steps += 1
            self.work.queue.wake(name)
            # the worker holds the GIL the loop needs while it runs (the loop gets it back every switch interval,
            # 5 ms): it rests at least as long as it worked, so the loop has the GIL to itself half the time or more
            await asyncio.sleep(max(FILL_PAUSE, time.monotonic() - t0))

    def _fill_step(self, job: RolloutJob, k: int) -> int:
        """One step, in a worker thread: the batch's write lock first, then `Batches.lock` (`Batches.hold`); the
        loop's group commits wait on the loop meanwhile (`group_commit.worker_writing`), not inside SQLite."""
        engine = self.work.store.engine
        with group_commit.worker_writing(engine) if engine.dialect.name == "sqlite" else contextlib.nullcontext(), \
                Session(engine, expire_on_commit=False) as s:
            opened = self.work.batches.fill_step(s, job, k)
            s.commit()
        return opened

    async def batch(self, name: str, k: int, wait: bool = False, timeout: float | None = None,
                    include_all: bool = False) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self.work.feed.arrived.event(name)
            ev.clear()
            with Session(self.work.store.engine, expire_on_commit=False) as s:
                snap = self.work.batches.snapshot(s, name, k, include_all)
            if not wait or snap["state"] in (BatchState.complete, BatchState.failed):
                return snap
            if self.work.feed.stopped:  # a restart: the client asks again, of the controller that comes back
                raise ServiceUnavailable(f"the controller is stopping; batch {k} of rolloutjobs \"{name}\" is not complete "
                                  "yet: retry")
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return snap
            await wait_event(ev, min(left, 30.0))

    async def run(self) -> None:
        """The background loop (`background.run`) until `stop`."""
        await background.run(self.work)

    def stop(self) -> None:
        w = self.work
        w.seqs.record()
        w.health.close()
        w.queue.stopped = True
        w.queue.changed.set_all()
        w.feed.stop()

