"""A job's rollouts in flight right now, for `rolloutctl inflight` and the web UI:

    GET /apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs/{name}/inflight?stalledAfterSeconds=S&limit=N

JSON: `total`, `stalled`, `stages` (counts), `stalledAfterSeconds`, `truncated` and `items`, one row per leased
rollout (stage, time in stage, last heartbeat, node, backend, attempt, `stalled`), stalled first, at most `limit`
(`work/inflight.py` says what stalled means; the controller's default is `$ROLLOUTD_STALLED_AFTER_SECONDS`).
Authorised like every per-job route (a namespace token reaches its namespaces' jobs only: `access.py`); read
from memory on the event loop, no SQL but the job's lookup. Mounted by `api.create_app` with the work core's held leases.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import APIRouter, Query

from rolloutd.crds.names import job_key

from ..store import Store
from ..work import inflight as work_inflight
from ..work.held_leases import HeldLeases
from .trainer import JOBS


def inflight_router(store: Store, leases: HeldLeases, clock: Callable[[], float]) -> APIRouter:
    r = APIRouter()

    @r.get(f"{JOBS}/{{name}}/inflight")
    async def inflight(namespace: str, name: str,
                       stalledAfterSeconds: float | None = Query(None, ge=0, le=10 ** 9, allow_inf_nan=False),
                       limit: int = Query(work_inflight.DEFAULT_LIMIT, ge=1, le=work_inflight.MAX_LIMIT)):
        key = job_key(namespace, name)
        await asyncio.to_thread(store.get, key)  # 404 for an unknown job
        after = leases.stall_seconds if stalledAfterSeconds is None else stalledAfterSeconds
        return await work_inflight.inflight(leases, key, clock(), after, limit)

    return r
