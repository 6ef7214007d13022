"""The reconcile loop: level-triggered, idempotent, one pass per job.

Runs inside the controller process (`server.py` starts it). On every store change and every
`resync` seconds it compares each RolloutJob's desired state (spec) with what is observed
(executor: node daemons; work: rollouts per stage) and takes the next idempotent step:

    Pending → Provisioning (executor.ensure) → Running (a daemon is up) → Succeeded/Failed
    deletionTimestamp set → Cancelling → executor.release → Cancelled → removed from the store

Its ports are in their own modules, so a different driver (kopf handlers) can replace this loop
whole: the executors (`executors/base.py`: `Executor`) and the work tracker and store calls
(`ports.py`: `WorkTracker`, `JobStore`). Next step: the executor's `ensure`/`observe`/`release`.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone

from rolloutd.crds.rolloutjob import Condition, Phase, RolloutJob, RolloutJobStatus

from .errors import ApiError, Conflict, NotFound
from .executors.base import Executor, ExecutorError
from .ports import JobStore, WorkTracker

log = logging.getLogger("rolloutd.reconciler")


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def set_condition(status: RolloutJobStatus, type_: str, value: bool | None, reason: str, message: str = "") -> None:
    state = "Unknown" if value is None else ("True" if value else "False")
    cur = status.condition(type_)
    if cur is not None and cur.status == state and cur.reason == reason and cur.message == message:
        return
    changed = cur is None or cur.status != state
    new = Condition(
        type=type_, status=state, reason=reason, message=message,
        last_transition_time=now() if changed else cur.last_transition_time,
    )
    status.conditions = [c for c in status.conditions if c.type != type_] + [new]


class Reconciler:
    def __init__(self, store: JobStore, executors: dict[str, Executor] | None = None,
                 work: WorkTracker | None = None, resync: float = 2.0):
        self.store = store
        self.executors = executors or {}
        self.work = work
        self.resync = resync
        self._stopped = asyncio.Event()
        self._nudged: set[str] = set()
        self._wake: asyncio.Event | None = None

    def nudge(self, name: str) -> None:
        """Reconcile this job now rather than at the next resync (e.g. its last rollout just
        finished). Call from the event loop's thread."""
        self._nudged.add(name)
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Reconcile the jobs that changed as soon as they change, and every job every `resync` s."""
        wake = self._wake = self.store.subscribe()
        cursor = await asyncio.to_thread(self.store.current_rv)
        next_full = 0.0
        loop = asyncio.get_running_loop()
        try:
            while not self._stopped.is_set():
                wake.clear()
                if loop.time() >= next_full:
                    cursor = await asyncio.to_thread(self.store.current_rv)
                    await self.reconcile_all()
                    next_full = loop.time() + self.resync
                else:
                    cursor = await self._reconcile_changed(cursor)
                try:
                    await asyncio.wait_for(wake.wait(), timeout=max(next_full - loop.time(), 0.01))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._wake = None
            self.store.unsubscribe(wake)

    async def _reconcile_changed(self, cursor: int) -> int:
        try:
            changes = await asyncio.to_thread(self.store.changes_since, cursor, None, 10_000)
        except ApiError:  # history trimmed under us: fall back to a full pass
            await self.reconcile_all()
            return await asyncio.to_thread(self.store.current_rv)
        names = dict.fromkeys(c.name for c in changes if c.type != "DELETED")
        names.update(dict.fromkeys(self._nudged))
        self._nudged.clear()
        for name in names:
            try:
                job = await asyncio.to_thread(self.store.get, name)
            except ApiError:  # gone, or a row it cannot read (logged by the store): the others go on
                continue
            await self._reconcile_one(job)
        return changes[-1].rv if changes else cursor

    def stop(self) -> None:
        self._stopped.set()

    async def reconcile_all(self) -> None:
        for job in await asyncio.to_thread(self.store.list):
            await self._reconcile_one(job)

    async def _reconcile_one(self, job: RolloutJob) -> None:
        try:
            await self.reconcile(job)
        except (Conflict, NotFound):
            pass  # changed or gone under us: the next pass sees the new state
        except Exception as e:  # noqa: BLE001 - one job's bug must not stop the others
            log.exception("reconcile %s failed", job.metadata.name)
            await self._event(job, "ReconcileError", f"{type(e).__name__}: {e}", "Warning")

    async def _event(self, job: RolloutJob, reason: str, message: str, type_: str = "Normal") -> None:
        await asyncio.to_thread(self.store.add_event, job.metadata.key, reason, message, type_)

    async def _save(self, job: RolloutJob, status: RolloutJobStatus) -> None:
        await asyncio.to_thread(
            self.store.update_status, job.metadata.key, status, expect_rv=int(job.metadata.resource_version)
        )

    async def reconcile(self, job: RolloutJob) -> None:
        name = job.metadata.key
        status = job.status.model_copy(deep=True)
        executor = self.executors.get(job.spec.executor.kind)

        if job.metadata.deletion_timestamp is not None:
            if executor is not None:
                await executor.release(job)
            if self.work is not None:
                await self.work.forget(job)
            if status.phase != Phase.cancelled and not (status.phase.terminal and status.phase != Phase.cancelling):
                status.phase = Phase.cancelled
                status.completion_time = status.completion_time or now()
                set_condition(status, "Complete", False, "Cancelled", "deleted by the user")
                await self._save(job, status)
            await asyncio.to_thread(self.store.remove, name)
            return

        if status.phase.terminal:
            if executor is not None:
                await executor.release(job)  # idempotent: makes sure nothing is left running
            return

        status.observed_generation = job.metadata.generation or 0
        if executor is None:
            set_condition(status, "ExecutorReady", False, "ExecutorUnavailable",
                          f"no {job.spec.executor.kind!r} executor is configured in this controller")
            await self._save(job, status)
            return
        set_condition(status, "ExecutorReady", True, "Configured")

        progress = await self.work.progress(job) if self.work is not None else None
        if progress is not None:
            status.counts = progress.counts
            if progress.extra:
                if "batch" in progress.extra:
                    status.batch = progress.extra["batch"]
                if "policyVersion" in progress.extra:
                    status.policy_version = progress.extra["policyVersion"]
            if progress.failed:
                await executor.release(job)
                await self._finish(job, status, Phase.failed, "WorkFailed", progress.failed)
                return
            if progress.done:
                await executor.release(job)
                await self._finish(job, status, Phase.succeeded, "AllRolloutsFinished",
                                   f"{progress.counts.succeeded} rollouts finished, {progress.counts.failed} failed")
                return

        try:
            await executor.ensure(job, job.spec.executor.nodes)
            nodes = await executor.observe(job)
        except ExecutorError as e:
            set_condition(status, "Provisioned", False, e.reason, str(e))
            if e.permanent:
                await self._finish(job, status, Phase.failed, e.reason, str(e))
            else:
                await self._save(job, status)
            return

        if self.work is not None and hasattr(self.work, "registered"):
            ready = await self.work.registered(job)
        else:
            ready = len([n for n in nodes if n.state == "running"])
        status.nodes = ready
        if status.phase == Phase.pending:
            status.phase = Phase.provisioning
            await self._event(job, "Provisioning", f"requested {job.spec.executor.nodes} node(s) from {job.spec.executor.kind}")
        if ready:
            set_condition(status, "Provisioned", True, "NodesRunning", f"{ready}/{job.spec.executor.nodes} node daemons registered")
            if status.phase == Phase.provisioning:
                status.phase = Phase.running
                status.start_time = status.start_time or now()
                await self._event(job, "Running", f"{ready} node daemon(s) registered")
        else:
            pending = [n.reason for n in nodes if n.reason]
            set_condition(status, "Provisioned", False, "Waiting", "; ".join(pending) or "waiting for node daemons")
        await self._save(job, status)

    async def _finish(self, job: RolloutJob, status: RolloutJobStatus, phase: Phase, reason: str, message: str) -> None:
        status.phase = phase
        status.completion_time = now()
        status.nodes = 0
        if phase == Phase.succeeded:
            set_condition(status, "Complete", True, reason, message)
        else:
            set_condition(status, "Complete", False, reason, message)
            set_condition(status, "Failed", True, reason, message)
        await self._save(job, status)
        await self._event(job, phase.value, message, "Normal" if phase == Phase.succeeded else "Warning")
