"""The node daemons' logs of a job, for `rolloutctl logs` on any machine:

    GET /apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs/{name}/logs?node=K&tail=N&follow=true&timeoutSeconds=S

Plain text: each source's last `tail` lines (200 unless asked, at most `logs.TAIL_MAX`, at most `logs.MAX_BYTES`
each), lines prefixed `[nodeK] ` when several nodes answer; with `follow`, new lines until the job ends (then a
short grace for what the daemons write as they leave), the client goes or `timeoutSeconds` pass. Authorised like
every per-job route (a namespace token reaches its namespaces' jobs only: `access.py`). The job's executor
(`executors/*`: `logs`) finds the files or pods; nothing of the request names a file.
Mounted by `api.create_app` with the root's executors (`root.py`). Next step: `--since`.
"""
from __future__ import annotations

import asyncio
import time
from typing import Mapping

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from rolloutd.crds.names import job_key

from ..errors import Conflict, NotFound
from ..executors.base import Executor, ExecutorError
from ..executors.logs import TAIL_DEFAULT, TAIL_MAX, NoLogs
from ..store import Store
from . import streams
from .bodies import INT64_MAX
from .trainer import JOBS

LEAVING_GRACE_SECONDS = 3.0  # after the job ended: lines the daemons write as they exit


def logs_router(store: Store, executors: Mapping[str, Executor], slots: streams.Streams) -> APIRouter:
    r = APIRouter()

    def finished(key: str) -> bool:
        try:
            return store.get(key).status.phase.terminal
        except NotFound:
            return True

    @r.get(f"{JOBS}/{{name}}/logs")
    async def logs(request: Request, namespace: str, name: str, node: int | None = Query(None, ge=0, le=INT64_MAX),
                   tail: int = Query(TAIL_DEFAULT, ge=0, le=TAIL_MAX), follow: bool = False,
                   timeoutSeconds: float | None = Query(None, gt=0, allow_inf_nan=False)):
        key = job_key(namespace, name)
        job = await asyncio.to_thread(store.get, key)  # 404 for an unknown job
        kind = job.spec.executor.kind
        executor = executors.get(kind)
        if executor is None:
            raise Conflict(f"rolloutjob {key} runs on the {kind} executor, which this controller does not run: "
                           "its daemons' logs are not here")
        follow = follow and not job.status.phase.terminal
        slot = slots.take(request, namespace) if follow else None
        try:
            chunks = await executor.logs(job, node, tail, follow)
        except NoLogs as e:
            raise NotFound(str(e)) from None
        except ExecutorError as e:
            raise Conflict(f"cannot read the logs of rolloutjob {key}: {e}") from None

        async def stream():
            end = None if timeoutSeconds is None else time.monotonic() + timeoutSeconds
            ended_at = None
            try:
                async for chunk in chunks:
                    if chunk:
                        yield chunk.encode()
                    if not follow:
                        continue
                    now = time.monotonic()
                    if end is not None and now >= end or await request.is_disconnected():
                        return
                    if ended_at is None and await asyncio.to_thread(finished, key):
                        ended_at = now
                    if ended_at is not None and not chunk and now - ended_at >= LEAVING_GRACE_SECONDS:
                        return
            finally:
                await chunks.aclose()

        return streams.guard(slot, StreamingResponse(stream(), media_type="text/plain; charset=utf-8"))

    return r
