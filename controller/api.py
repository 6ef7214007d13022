"""The controller's HTTP app (FastAPI): its middleware, metrics, error handling, and the routes mounted on it.

    /version · /api · /apis · /openapi/v2 · /openapi/v3 …        discovery (`kube/discovery.py`)
    /apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs[/{name}[/status]]   the Kubernetes verbs (`kube/rolloutjobs.py`)
    /apis/rolloutd.io/v1alpha1/tenantpolicies[/{ns}]  the admin's TenantPolicies (`kube/tenantpolicies.py`)
    /apis/rolloutd.io/v1alpha1/rolloutjobs            POST create · GET list/watch (all namespaces)
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}     PUT apply (rolloutctl) · GET · DELETE
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}/status   GET · PUT (status subresource)
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}/events   GET (what `rolloutctl describe` shows)
    …/namespaces/{ns}/rolloutjobs/{name}/{trajectories,groups,batches,policy,backends,stats}   trainer (`http/trainer.py`)
    …/namespaces/{ns}/rolloutjobs/{name}/nodes/…       the node protocol (`http/node_protocol.py`)
    …/namespaces/{ns}/rolloutjobs/{name}/logs          the node daemons' logs (`http/logs.py`)
    …/namespaces/{ns}/rolloutjobs/{name}/inflight      the rollouts in flight, stalled ones flagged (`http/inflight.py`)
    The unnamespaced per-job paths above (and the trainer ones, rewritten) are the `default` namespace's: a body
    naming another namespace there is a 400.
    /healthz, /readyz (no auth; the store's disk: `store/faults.py`) · /metrics (Prometheus) · /openapi.json
    /ui/…  the web UI (`ui/app.py`; it authenticates itself: session cookie or the same bearer tokens)

Built by `create_app(root)` over the composition root (`root.py`); served by `server.py`. Every endpoint but the probes needs
a bearer token, checked by `middleware.py`: the admin token, a node credential (node paths only, its own job or node:
`nodeauth.py`) or a scoped one (`http/access.py`: 403 beyond it; never on node paths; its writes of jobs are admitted
against the namespace's TenantPolicy, `kube/admit.py`). Errors are Kubernetes `Status` objects (see `errors.py`).
/metrics serves the request metrics, `collectors.py`'s and the work core's collectors.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from rolloutd.crds.names import API_PREFIX as PREFIX
from rolloutd.crds.names import DEFAULT_NAMESPACE, job_key

from .access.nodeauth import NodeGate
from .collectors import DurableCollector, JobsCollector, RolloutsCollector, StalenessCollector, StatsCollector
from .errors import ApiError, BadRequest
from .http.openapi import describe
from .kube import rolloutjobs
from .kube.discovery import discovery_router
from .kube.tenantpolicies import tenantpolicy_router
from .http.inflight import inflight_router
from .http.logs import logs_router
from .http.node_protocol import node_router
from .http.trainer import trainer_router
from .work.first_tokens import Collector as FirstTokenCollector
from .work import node_calls, workshare
from .middleware import AuthAndMetrics, error_response
from .root import Root
from .ui.app import create_ui
from .ui.live import WorkView


def create_app(root: Root) -> FastAPI:
    """The app over the parts of `root` (`root.assemble`): each router is handed the parts it uses."""
    app = FastAPI(
        title="rolloutd controller",
        version="v1alpha1",
        description="Rollout-as-a-Service: RolloutJobs reconciled into rollouts on Slurm or local node daemons.",
        docs_url=None,
        redoc_url=None,
    )
    store, registry, storage, work = root.store, root.metrics, root.storage, root.work
    requests_total = Counter("rolloutd_api_requests", "API requests", ["method", "code"], registry=registry)
    latency = Histogram("rolloutd_api_request_seconds", "API request latency", ["method"], registry=registry)
    registry.register(jobs_by_phase := JobsCollector(store))
    registry.register(DurableCollector(store.durable))
    registry.register(root.rates)
    gate = NodeGate(root.credentials, work.registry.job_of) if work is not None else None
    app.add_middleware(AuthAndMetrics, token=root.token, nodes=gate, tokens=root.tokens,
                       requests_total=requests_total, latency=latency, storage=storage, limits=root.limits,
                       durable=store.durable.settle, rates=root.rates)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # no such route or method
        err = ApiError(f"the server could not find the requested resource ({request.method} {request.url.path})"
                       if exc.status_code == 404 else str(exc.detail))
        err.code, err.reason = exc.status_code, {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code,
                                                                                                 "BadRequest")
        return error_response(err)

    @app.exception_handler(Exception)
    async def _crash(_request: Request, exc: Exception):  # a bug, not bad input
        return error_response(ApiError(f"internal error: {type(exc).__name__}: {exc}"))

    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _bad_params(_request: Request, exc: RequestValidationError):
        causes = [{"field": ".".join(str(p) for p in e["loc"]), "reason": "FieldValueInvalid", "message": e["msg"]}
                  for e in exc.errors()]
        return error_response(BadRequest("invalid request: " + "; ".join(f"{c['field']}: {c['message']}"
                                                                         for c in causes), causes=causes))

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> PlainTextResponse:  # a lost store file is for good: the process must be looked at
        lost = storage.lost(every=0.0)
        return PlainTextResponse(lost or "ok", status_code=503 if lost else 200)

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> PlainTextResponse:  # a full or read-only disk may pass: not ready meanwhile
        problem = await asyncio.to_thread(storage.problem)
        return PlainTextResponse(problem or "ok", status_code=503 if problem else 200)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        await asyncio.to_thread(jobs_by_phase.refresh)  # the one collector that reads the store: off the loop
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- cluster-wide paths (rolloutctl, clients)
    jobs = root.jobs

    @app.post(f"{PREFIX}/rolloutjobs", status_code=201)
    async def create(request: Request):
        return await rolloutjobs.create(jobs, request, None)

    @app.get(f"{PREFIX}/rolloutjobs")
    async def list_or_watch(
        request: Request,
        labelSelector: str | None = None,
        fieldSelector: str | None = None,
        watch: bool = False,
        resourceVersion: str | None = None,
        timeoutSeconds: float | None = Query(default=None, gt=0, allow_inf_nan=False),
    ):
        return await rolloutjobs.list_or_watch(jobs, request, None, sse_ok=True)

    @app.put(f"{PREFIX}/rolloutjobs/{{name}}")
    async def apply(name: str, request: Request):
        return await rolloutjobs.rolloutctl_apply(jobs, request, DEFAULT_NAMESPACE, name)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}")
    async def get(name: str, request: Request):
        return rolloutjobs.respond(request, await asyncio.to_thread(store.get_wire, name, DEFAULT_NAMESPACE))

    @app.delete(f"{PREFIX}/rolloutjobs/{{name}}")
    async def delete(name: str, request: Request):
        return await rolloutjobs.delete(jobs, request, DEFAULT_NAMESPACE, name, code=202)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}/status")
    async def get_status(name: str):
        return await asyncio.to_thread(store.get_wire, name, DEFAULT_NAMESPACE)

    @app.put(f"{PREFIX}/rolloutjobs/{{name}}/status")
    async def put_status(name: str, request: Request):
        return await rolloutjobs.replace_status(jobs, request, DEFAULT_NAMESPACE, name)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}/events")
    async def events(name: str):
        await asyncio.to_thread(store.get_wire, name, DEFAULT_NAMESPACE)  # 404 for unknown jobs
        return {"items": await asyncio.to_thread(store.events, job_key(DEFAULT_NAMESPACE, name))}

    app.include_router(rolloutjobs.namespaced_router(jobs))
    app.include_router(discovery_router(store))
    app.include_router(tenantpolicy_router(root.policies))
    app.include_router(logs_router(store, root.executors, root.streams))  # the node daemons' logs
    registry.register(StatsCollector(root.stats))
    if work is not None and root.scheduler is not None:
        registry.register(StalenessCollector(work.stale))
        registry.register(RolloutsCollector(work.queue))
        registry.register(FirstTokenCollector(work.first_tokens))
        registry.register(workshare.Collector(work.pool.admission))
        registry.register(node_calls.Collector(work.calls.group))
        app.include_router(node_router(work.jobs, work.registry, work.attempts, work.calls, root.credentials,
                                       store.durable.settle))
        app.include_router(trainer_router(store, root.policies, root.scheduler, feed=work.feed, retention=work.retention,
                                          pool=work.pool, purge=work.purge, job_stats=root.stats, allow=root.allow,
                                          slots=root.streams))
        app.include_router(inflight_router(store, work.queue.leases, work.clock))
    describe(app)
    view = None if work is None else WorkView(work.pool, work.registry, work.queue.leases, work.clock)
    app.mount("/ui", create_ui(store, root.token, root.tokens, root.streams, root.stats, root.scheduler, view,
                               busy=root.loop_lag.recent_max, observe_step=root.ui_steps.observe, limits=root.limits,
                               executors=root.executors, trace_url=root.trace_url))
    return app
