"""The kopf handlers that reconcile RolloutJobs: create/update/resume ensure the job's daemons at once, a
daemon per job observes it (progress, nodes, phase, conditions) until it is finished, delete releases.

Registered on a fresh `kopf.OperatorRegistry` by `build_registry`; run by `embedded.py` against the
controller's own API or any Kubernetes API server. Each pass is `reconcile.py`'s; its status goes through
the status subresource and its events as core/v1 Events (`kubeapi.JobApi`). Next step: `reconcile.py`.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, Callable, Mapping

import httpx
import kopf

from rolloutd.crds.names import GROUP, VERSION, job_key
from rolloutd.crds.rolloutjob import RolloutJob

from ..executors.base import Executor
from ..ports import WorkTracker
from . import reconcile
from .kubeapi import JobApi

log = logging.getLogger("rolloutd.operator")
PLURAL = "rolloutjobs"
RETRY_SECONDS = 5.0  # a failed handler or the observe daemon runs again this soon (kopf's default: 60 s)


class Nudges:
    """One wake-up per observed job: its observer waits on `wake(key)`, `nudge(key)` ends that wait at once.
    Made before the work tracker and the reconciler and given to both (the tracker nudges a job whose last
    rollout ended), so neither is patched into the other after construction."""

    def __init__(self) -> None:
        self._wakes: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def nudge(self, key: str) -> None:
        """Observe this job (its key: `crds.names.job_key`) now rather than at the end of its wait (its last
        rollout just finished). Safe from any thread."""
        wake, loop = self._wakes.get(key), self._loop
        if wake is not None and loop is not None:
            loop.call_soon_threadsafe(wake.set)

    def wake(self, key: str) -> asyncio.Event:
        self._loop = asyncio.get_running_loop()
        return self._wakes.setdefault(key, asyncio.Event())

    def drop(self, key: str) -> None:
        self._wakes.pop(key, None)


class Reconciler:
    """What the handlers share (kopf's `memo`): executors, the work tracker, the API writer, the
    operator-mode mirror, and one wake-up per observed job (`nudges`) so that `nudge` ends its wait at once."""

    def __init__(self, api: JobApi, executors: dict[str, Executor], work: WorkTracker | None = None, *,
                 interval: float = 2.0, mirror: Callable[[RolloutJob], Any] | None = None,
                 forget: Callable[[RolloutJob], Any] | None = None, nudges: Nudges | None = None):
        self.api, self.executors, self.work, self.interval = api, executors, work, interval
        self.mirror, self.forget = mirror, forget   # operator mode: the local copy the scheduler reads
        self.nudges = nudges if nudges is not None else Nudges()
        self.nudge, self.wake = self.nudges.nudge, self.nudges.wake
        self._locks: dict[str, asyncio.Lock] = {}

    def __copy__(self) -> "Reconciler":  # kopf copies its memo per object: all of them share this one
        return self

    async def step(self, namespace: str, name: str, body: Mapping[str, Any] | None = None) -> RolloutJob | None:
        """One pass over the job as stored now, or as `body` (kopf's copy from the event that called the
        handler: no GET; a copy gone stale meanwhile makes the status write a 409, the next pass reads
        again); returns it (None once it is gone or being deleted)."""
        async with self._locks.setdefault(job_key(namespace, name), asyncio.Lock()):
            job = RolloutJob.model_validate(copy.deepcopy(dict(body))) if body else await self.api.get(namespace, name)
            if job is None or job.metadata.deletion_timestamp is not None:
                return None
            if self.mirror is not None:
                await asyncio.to_thread(self.mirror, job)
            try:
                result = await reconcile.reconcile(job, self.executors.get(job.spec.executor.kind), self.work)
                stored = await self._write(job, result)
            except httpx.HTTPStatusError as e:
                if e.response.status_code in (404, 409):  # changed or gone under us: the next pass reads again
                    return job
                raise
            except Exception as e:  # noqa: BLE001 - one job's trouble must not stop its observation
                log.exception("reconcile %s failed", name)
                await self.api.post_event(job, "ReconcileError", f"{type(e).__name__}: {e}", "Warning")
                return job
            return stored or job

    async def _write(self, job: RolloutJob, result: reconcile.Step) -> RolloutJob | None:
        wire = await self.api.patch_status(job, result.status)
        stored = RolloutJob.model_validate(wire) if wire is not None else None
        if stored is not None and self.mirror is not None:
            await asyncio.to_thread(self.mirror, stored)
        for reason, message, type_ in result.events:
            await self.api.post_event(job, reason, message, type_)
        return stored

    async def release(self, namespace: str, name: str) -> None:
        key = job_key(namespace, name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            job = await self.api.get(namespace, name)
            if job is None:
                return
            result = await reconcile.release(job, self.executors.get(job.spec.executor.kind), self.work)
            try:
                await self._write(job, result)
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 409:
                    raise
                latest = await self.api.get(namespace, name)  # a user's write came between: once more on it
                if latest is not None:
                    await self._write(latest, reconcile.Step(result.status))
            if self.forget is not None:
                await asyncio.to_thread(self.forget, job)
        self._locks.pop(key, None)


async def ensure(name: str, namespace: str, memo: Reconciler, body: Mapping[str, Any], **_: Any) -> None:
    """Created, changed, or found at start-up: take the first step now (apply → Provisioning), on the object
    kopf's event carried."""
    await memo.step(namespace, name, body)


async def observe(name: str, namespace: str, memo: Reconciler, stopped: Any, **_: Any) -> None:
    """While the job lives: a pass every `interval` seconds, or at once when nudged; ends when the job
    has finished (its executor released) or is being deleted (the delete handler takes over)."""
    key = job_key(namespace, name)
    wake = memo.wake(key)
    try:
        while not stopped:
            wake.clear()
            job = await memo.step(namespace, name)
            if job is None or job.status.phase.terminal:
                return
            waits = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(wake.wait())]
            try:
                await asyncio.wait(waits, timeout=memo.interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
    finally:
        memo.nudges.drop(key)


async def release(name: str, namespace: str, memo: Reconciler, **_: Any) -> None:
    """deletionTimestamp set: release the executor's daemons and the job's work, mark it Cancelled;
    kopf then drops the finalizer (`rolloutd.io/release`, see `embedded.settings`)."""
    await memo.release(namespace, name)


def build_registry() -> kopf.OperatorRegistry:
    """A registry holding the handlers (a fresh one each time: two operators in one process, as in tests,
    must not share handlers)."""
    registry = kopf.OperatorRegistry()
    # a handler that failed (the store's disk full, the API briefly away) retries in RETRY_SECONDS, not kopf's 60
    on = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry, backoff=RETRY_SECONDS)
    kopf.on.resume(**on, id="ensure-on-resume")(ensure)
    kopf.on.create(**on, id="ensure-on-create")(ensure)
    kopf.on.update(**on, id="ensure-on-update")(ensure)
    kopf.on.delete(**on, id="release")(release)
    kopf.daemon(**on, id="observe", cancellation_timeout=10.0)(observe)
    return registry
