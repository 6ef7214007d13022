"""The trainer's routes: trajectories, groups, batches, policy versions and the job's LLM backends.

Under /apis/rolloutd.io/v1alpha1/namespaces/{ns}/ (the per-job paths without a namespace are rewritten
to `default` by `api.py`, for clients of the previous version):
    GET  …/rolloutjobs/{name}/trajectories?cursor=N&follow=true&limit=N  JSON lines, resumable (a deleted job's
                                                                         while retained: `work/retention.py`)
    DELETE …/rolloutjobs/{name}/trajectories                             purge a deleted job's retained results
    GET  …/rolloutjobs/{name}/groups                                     per-prompt groups
    POST …/rolloutjobs/{name}/batches · GET …/batches/{k}                 batch server (DAPO)
    POST | GET …/rolloutjobs/{name}/policy                               policy versions (a job under a tenant
                                                                         policy pauses or reloads only its owned backends)
    GET | POST | DELETE …/rolloutjobs/{name}/backends                    list / add / remove
    GET  …/rolloutjobs/{name}/stats                                      reward mean, per-stage p50/p95 (`work/stats.py`)

Mounted by `api.create_app` when the root has a work core: the feed, the retention and the backend pool answer
directly, the scheduler serves batches and policy versions. The client
side is `rolloutd.client` (`core.Calls` builds these requests).
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Callable

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from rolloutd.crds.names import API_PREFIX, job_key
from rolloutd.crds.rolloutjob import MAX_BATCHES, BackendSpec, RolloutJob
from rolloutd.crds.tenancy import owns_backend, violations
from rolloutd.crds.trajectory import PolicyVersion
from rolloutd.crds.trainer_api import Batch, BatchOpened, BackendList, JobPolicy, PolicyAnnounce, PromptGroups

from ..errors import BadRequest, Conflict, Forbidden, Invalid, NotFound
from ..access.allowlists import AllowLists, backend_url_problem
from ..work.backends import BackendPool
from ..work.feed import Feed
from ..work.retention import Retention
from ..work.scheduler import Scheduler
from ..work.stats import JobStats
from ..store import Store
from ..access.auth import ScopedToken
from ..kube.admit import admit_and_write, scoped_token
from ..access.tenancy import Policies, describe
from . import streams
from .bodies import INT64_MAX, read_model

JOBS = f"{API_PREFIX}/namespaces/{{namespace}}/rolloutjobs"


def typed(model: type[BaseModel]) -> dict[str, Any]:
    """A route's answer model: FastAPI checks the answer against it (a drifted one is an error naming the field, not
    a document that lies) and writes the JSON in pydantic's core, keys as they came (a batch of 1024 long
    trajectories: well under a second, where FastAPI's generic encoder held the loop for tens: bench answers)."""
    return {"response_model": model, "response_model_exclude_unset": True}


class BatchRequest(BaseModel):
    batch: int | None = Field(default=None, ge=0, le=MAX_BATCHES, description="the batch to open (default: the next "
                              "one)")
    prompts: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        default=None, description="dataset indices the trainer picked, one group each (plain batches only)")
    model_config = {"extra": "forbid"}


class PolicyRequest(BaseModel):
    version: PolicyVersion
    weightsPath: str | None = None
    pause: bool | None = None
    model_config = {"extra": "forbid"}


def trainer_router(store: Store, policies: Policies, scheduler: Scheduler, *, feed: Feed, retention: Retention,
                   pool: BackendPool, purge: Callable[[str], None], job_stats: JobStats, allow: AllowLists,
                   slots: streams.Streams) -> APIRouter:
    """`purge`: every row of a deleted job (`work.core.Work.purge`)."""
    r = APIRouter()

    async def read_job(key: str) -> RolloutJob:
        """The job (NotFound): the store's parsed copy on the loop while it is cached, else read in a thread (a hop
        that cost the announce up to 44 ms on a loaded box, on its way in)."""
        return store.cached(key) or await asyncio.to_thread(store.get, key)

    def finished(name: str) -> bool:
        try:
            job = store.cached(name) or store.get(name)
        except NotFound:
            return True
        return job.status.phase.terminal

    @r.get(f"{JOBS}/{{name}}/trajectories")
    async def trajectories(request: Request, namespace: str, name: str, cursor: int = Query(0, ge=0, le=INT64_MAX),
                           follow: bool = False, limit: int = Query(1000, ge=1, le=100_000),
                           timeoutSeconds: float | None = Query(None, gt=0, allow_inf_nan=False)):
        name = job_key(namespace, name)
        try:
            await read_job(name)
        except NotFound:  # a deleted job's results are served while they are retained (`work/retention.py`)
            if not await asyncio.to_thread(retention.retained, name):
                raise
            follow = False  # nothing more will come: what is kept, then the end
        if not follow:  # read in a worker thread: a stalled database holds this call, not the loop
            rows = await asyncio.to_thread(feed.trajectories, name, cursor, limit)
            body = "".join(f'{{"seq":{seq},{data[1:]}\n' for seq, data in rows)
            last = rows[-1][0] if rows else cursor
            return StreamingResponse(iter([body.encode()]), media_type="application/x-ndjson",
                                     headers={"X-Rolloutd-Cursor": str(last)})

        slot = slots.take(request, namespace)

        async def stream():
            async for seq, data in feed.follow(name, cursor, lambda: finished(name), timeoutSeconds):
                yield (f'{{"seq":{seq},{data[1:]}\n' if seq else "\n").encode()

        return streams.guard(slot, StreamingResponse(stream(), media_type="application/x-ndjson"))

    @r.delete(f"{JOBS}/{{name}}/trajectories")
    async def purge_results(namespace: str, name: str):
        """Purge a deleted job's retained results now (`rolloutctl delete --purge`), before the retention ends."""
        key = job_key(namespace, name)
        try:
            await read_job(key)
        except NotFound:
            pass
        else:
            raise Conflict(f'rolloutjobs.rolloutd.io "{name}" still exists: delete it first; its results are kept '
                           "for the retention period unless purged then", name=name)
        if not await asyncio.to_thread(retention.retained, key):
            raise NotFound(f'no results of rolloutjobs.rolloutd.io "{name}" are kept', name=name)
        await asyncio.to_thread(purge, key)
        return {"apiVersion": "v1", "kind": "Status", "status": "Success", "details": {"name": name}}

    @r.get(f"{JOBS}/{{name}}/stats")
    async def job_stats_route(namespace: str, name: str):
        """The delivered trajectories by failure kind, the reward mean (infra left out) and each stage's p50/p95 in
        seconds (of the rollouts that ran to the end), as the web UI's job page shows them."""
        key = job_key(namespace, name)
        job = await read_job(key)
        # summed on the event loop in slices (a worker thread would hold the GIL the nodes' calls wait for)
        out = await job_stats.numbers(key, job.metadata.uid or "", finished=job.status.phase.terminal)
        return {**out["counts"], "stages": [{k: s[k] for k in ("stage", "n", "p50", "p95", "seconds")}
                                            for s in out["summary"]["stages"]]}

    @r.get(f"{JOBS}/{{name}}/groups", **typed(PromptGroups))
    async def groups(namespace: str, name: str):
        name = job_key(namespace, name)
        job = await read_job(name)
        return {"items": await asyncio.to_thread(feed.groups, name, job.spec.samples_per_prompt)}

    # ------------------------------------------------------------ batches and policy versions

    @r.post(f"{JOBS}/{{name}}/batches", **typed(BatchOpened))
    async def request_batch(namespace: str, name: str, request: Request):
        name = job_key(namespace, name)
        req = await read_model(request, BatchRequest)
        await scheduler.admit(await read_job(name))  # step by step, before the batch opens
        out = scheduler.request_batch(name, req.batch, req.prompts)
        if await scheduler.fill_batch(name, out["batch"]):  # the rest of its groups, off the loop a step at a time
            out = {k: v for k, v in (await scheduler.batch(name, out["batch"])).items() if k != "groups"}
        return out

    @r.get(f"{JOBS}/{{name}}/batches/{{k}}", **typed(Batch))
    async def get_batch(request: Request, namespace: str, name: str, k: int = Path(ge=0, le=MAX_BATCHES),
                        wait: bool = False, all: bool = False,
                        timeoutSeconds: float | None = Query(None, gt=0, allow_inf_nan=False)):
        name = job_key(namespace, name)
        await read_job(name)  # 404 for an unknown job
        slot = slots.take(request, namespace) if wait else None
        timeout = timeoutSeconds if slot is None else min(timeoutSeconds or streams.STREAM_MAX_SECONDS,
                                                          streams.STREAM_MAX_SECONDS)
        return await streams.long_poll(slot, scheduler.batch(name, k, wait=wait, timeout=timeout, include_all=all))

    @r.post(f"{JOBS}/{{name}}/policy", **typed(PolicyAnnounce))
    async def announce_policy(namespace: str, name: str, request: Request):
        name = job_key(namespace, name)
        req = await read_model(request, PolicyRequest)
        job = await read_job(name)
        pause = job.spec.policy.pause_on_update if req.pause is None else req.pause
        if pause or req.weightsPath:
            check_owned(policies, job, "pause" if pause else "reload", scoped_token(request))
        return await scheduler.announce_policy(name, req.version, req.weightsPath, req.pause)

    @r.get(f"{JOBS}/{{name}}/policy", **typed(JobPolicy))
    async def get_policy(namespace: str, name: str):
        name = job_key(namespace, name)
        await read_job(name)  # 404 for an unknown job, without the store on the loop when it is not cached
        return await asyncio.to_thread(scheduler.policy, name)

    # ------------------------------------------------------------ backends

    async def describe_backends(name: str, token: ScopedToken | None) -> dict[str, Any]:
        """The job's backends; a namespace token sees a backend it does not own as up or down, without reason."""
        job = await read_job(name)
        policy = caller_policy(policies, job, token)[0] if token is not None else None
        shown = (lambda url: True) if policy is None else (lambda url: owns_backend(policy, url))
        return {"items": pool.view(name, [b.url for b in job.spec.llm.backends], shown)}

    @r.get(f"{JOBS}/{{name}}/backends", **typed(BackendList))
    async def list_backends(namespace: str, name: str, request: Request):
        name = job_key(namespace, name)
        return await describe_backends(name, scoped_token(request))

    @r.post(f"{JOBS}/{{name}}/backends", **typed(BackendList))
    async def add_backend(namespace: str, name: str, request: Request):
        name = job_key(namespace, name)
        doc = await read_model(request, BackendSpec)
        url = validate_backend_url(doc.url, "url", allow)

        def add(job: RolloutJob) -> bool:
            if url in [b.url.rstrip("/") for b in job.spec.llm.backends]:
                return False
            job.spec.llm.backends = [*job.spec.llm.backends, BackendSpec(url=url, name=doc.name)]
            policy, label = caller_policy(policies, job, scoped_token(request))
            refused = [(f, why) for f, why in violations(job.spec, policy) if f.startswith("spec.llm.backends")]
            if refused:
                raise Forbidden(f"backend {url[:200]!r} is not allowed by {label}", causes=[
                    {"field": "url", "reason": "FieldValueForbidden", "message": f"{why} ({label})"}
                    for _f, why in refused])
            return True

        await edit_spec(store, policies, name, add, request)
        pool.add(url)
        return await describe_backends(name, scoped_token(request))

    @r.delete(f"{JOBS}/{{name}}/backends", **typed(BackendList))
    async def remove_backend(namespace: str, name: str, url: str, request: Request):
        name = job_key(namespace, name)
        url = validate_backend_url(url, "url", allow)

        def remove(job: RolloutJob) -> bool:
            kept = [b for b in job.spec.llm.backends if b.url.rstrip("/") != url]
            if len(kept) == len(job.spec.llm.backends):
                raise NotFound(f"backend {url} is not in rolloutjob {name}")
            if not kept:
                raise BadRequest("cannot remove the last backend of a job; add another first")
            job.spec.llm.backends = kept
            return True

        await edit_spec(store, policies, name, remove, request)
        return await describe_backends(name, scoped_token(request))

    return r


async def edit_spec(store: Store, policies: Policies, name: str, edit: Callable[[RolloutJob], bool], request: Request | None = None,
                    attempts: int = 5) -> None:
    """Apply `edit` (False: nothing to change) to a fresh copy of the job and store it, admitted as the caller's
    write (`kube/admit.py`: a namespace token's edit is held to its policy whoever wrote the job). The write names
    the resourceVersion it read, so a status write landing in between (the operator's, every few seconds) is a
    conflict: read again and retry, rather than answer 409 to a request that did nothing wrong."""
    for attempt in range(attempts):
        job = (await asyncio.to_thread(store.get, name)).model_copy(deep=True)
        current = job.wire()
        if not edit(job):
            return
        try:
            if request is None:
                await asyncio.to_thread(store.apply, job)
            else:
                await asyncio.to_thread(admit_and_write, request, store, policies, job, current, lambda: store.apply(job))
            return
        except Conflict:
            if attempt == attempts - 1 or (await asyncio.to_thread(store.get, name)).metadata.resource_version \
                    == job.metadata.resource_version:
                raise  # not a write that raced ours (the job is being deleted, say)


def caller_policy(policies: Policies, job: RolloutJob, token: ScopedToken | None) -> tuple[Any, str | None]:
    """(the policy a call on `job` is held to, its name): a namespace token's call its namespace's, whoever wrote
    the job; the admin's call the job's (`Policies.effective_named`: a tenant's job stays the tenant's)."""
    if token is None:
        return policies.effective_named(job)
    spec, name = policies.for_namespace(job.metadata.namespace)
    return spec, describe(name)


def check_owned(policies: Policies, job: RolloutJob, verb: str, token: ScopedToken | None) -> None:
    """403 unless the policy the call is held to (`caller_policy`) owns every backend the job would pause or
    reload: a backend another namespace's job shares is never paused or reloaded by a tenant."""
    policy, label = caller_policy(policies, job, token)
    if policy is None:
        return
    shared = [b.url for b in job.spec.llm.backends if not owns_backend(policy, b.url.rstrip("/"))]
    if shared:
        raise Forbidden(f"rolloutjob {job.metadata.key} may not {verb} backends its namespace does not own "
                        f"(ownedBackends of {label}): {', '.join(u[:200] for u in shared)}",
                        causes=[{"field": f"spec.llm.backends[{i}].url", "reason": "FieldValueForbidden",
                                 "message": f"not owned by namespace {job.metadata.namespace!r} ({label})"}
                                for i, b in enumerate(job.spec.llm.backends) if b.url in shared])


def validate_backend_url(url: str, field: str, allow: AllowLists | None = None) -> str:
    """The URL without its trailing slash, or 422 when the controller's allow-lists (`allowlists.py`) refuse it."""
    if problem := backend_url_problem(url, allow):
        raise Invalid(f"backend url {url[:200]!r}: {problem}",
                      causes=[{"field": field, "reason": "FieldValueForbidden", "message": problem}])
    return url.rstrip("/")
