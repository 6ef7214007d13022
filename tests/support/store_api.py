"""The operator's API writer (`operator.kubeapi.JobApi`) over a Store, for tests of the handlers' logic
without an HTTP server: same calls, same 409 on a stale resourceVersion, same 404 once a job is gone."""
from __future__ import annotations

import asyncio

import httpx

from rolloutd.controller.errors import Conflict, NotFound
from rolloutd.controller.operator.handlers import Reconciler
from rolloutd.controller.store import Store
from rolloutd.crds.names import job_key


class StoreApi:
    def __init__(self, store: Store):
        self.store = store

    async def get(self, namespace, name):
        try:
            return self.store.get(job_key(namespace, name))
        except NotFound:
            return None

    async def patch_status(self, job, status):
        if job.status.wire() == status.wire():
            return None
        try:
            return self.store.update_status(job.metadata.key, status, expect_rv=int(job.metadata.resource_version))
        except (Conflict, NotFound) as e:
            code = 409 if isinstance(e, Conflict) else 404
            raise httpx.HTTPStatusError(str(e), request=httpx.Request("PATCH", "http://store"),
                                        response=httpx.Response(code)) from None

    async def post_event(self, job, reason, message, type_="Normal"):
        self.store.add_event(job.metadata.key, reason, message, type_)


async def reconcile_all(rec: Reconciler) -> None:
    """What kopf does over every job: a pass (create/resume/daemon), or on deletion the release handler
    and then the finalizer dropped (`Store.remove`, as the API does when kopf patches it away)."""
    store = rec.api.store
    for job in store.list():
        name, ns = job.metadata.name, job.metadata.namespace
        if job.metadata.deletion_timestamp is None:
            await rec.step(ns, name)
        else:
            await rec.release(ns, name)
            await asyncio.to_thread(store.remove, job.metadata.key)


class Stopped:
    """kopf's `stopped` flag for a daemon run by hand: false until `set`, awaitable `wait()`."""

    def __init__(self):
        self.event = asyncio.Event()

    def __bool__(self):
        return self.event.is_set()

    def set(self):
        self.event.set()

    async def wait(self):
        await self.event.wait()
