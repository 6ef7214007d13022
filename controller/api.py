"""The controller's HTTP app (FastAPI): auth, metrics, error handling, and the routes mounted on it.

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
a bearer token: the admin token, a node credential (node paths only, its own job or node: `nodeauth.py`) or a
scoped one (`http/access.py`: 403 beyond it; never on node paths; its writes of jobs are admitted against the
namespace's TenantPolicy, `kube/admit.py`). Errors are Kubernetes `Status` objects (see `errors.py`).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Awaitable, Callable

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rolloutd.crds.names import API_PREFIX as PREFIX
from rolloutd.crds.names import DEFAULT_NAMESPACE, job_key
from rolloutd.crds.rolloutjob import Phase

from .access.auth import TokenBook, token_matches
from .access.nodeauth import NodeGate
from .errors import ApiError, BadRequest, Forbidden, ServiceUnavailable, TooManyRequests, Unauthorized
from .http.access import forbidden
from .http.bodies import parse_document
from .http.login_limit import LoginLimits
from .http.request_rate import RequestRates
from .http.openapi import describe
from .kube import rolloutjobs
from .kube.admit import TOKEN_KEY
from .kube.discovery import discovery_router
from .kube.tenantpolicies import tenantpolicy_router
from .http.inflight import inflight_router
from .http.logs import logs_router
from .http.node_protocol import node_router
from .http.trainer import trainer_router
from .work.first_tokens import Collector as FirstTokenCollector
from .work import workshare
from .root import Root
from .store import Store
from .store.faults import RETRY_AFTER_SECONDS, StorageWatch, storage_reason
from .ui.app import WorkView, create_ui

log = logging.getLogger("rolloutd.api")
# The trainer routes of the previous version (no namespace) are served as the `default` namespace's.
_OLD_TRAINER_PATH = re.compile(PREFIX + r"/rolloutjobs/([^/]+)/(trajectories|groups|batches|policy|backends)(/.*)?")



def _namespaced(path: str) -> str:
    m = _OLD_TRAINER_PATH.fullmatch(path)
    return path if m is None else f"{PREFIX}/namespaces/default/rolloutjobs/{m[1]}/{m[2]}{m[3] or ''}"


def _error(err: ApiError, retry_after: int = RETRY_AFTER_SECONDS) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.code == 401 else \
        {"Retry-After": str(retry_after)} if err.code in (429, 503) else {}
    return JSONResponse(err.status(), status_code=err.code, headers={**headers, **err.headers} or None)


_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_CORE_EVENTS = re.compile(r"/api/v1/namespaces/[^/]+/events")
_ANNOUNCE = re.compile(rf"{PREFIX}/namespaces/[^/]+/rolloutjobs/[^/]+/policy")  # syncs its commit itself, overlapped


def _unsynced(path: str) -> bool:
    """Writes answered without waiting for a sync: the node protocol's (its routes sync results themselves), a policy
    announce (it syncs its commit while the engines resume: `PolicyVersions._live`), and what the operator derives
    and writes again after a restart (a job's status, core/v1 Events)."""
    return NodeGate.is_node_path(path) or path.endswith("/status") or any(
        r.fullmatch(path) is not None for r in (_CORE_EVENTS, _ANNOUNCE))


class _AuthAndMetrics:
    """Bearer-token check and request metrics around every request, as plain ASGI: Starlette's
    `BaseHTTPMiddleware` (`@app.middleware`) runs each request in a task group of its own, which
    cost more CPU than a node's heartbeat itself at a thousand nodes. Latency is observed when the
    response starts (a watch stream is counted once, not for its whole life). A write answered 2xx (other than
    the node protocol's, whose routes settle results themselves) waits for its commit to be on the disk
    (`durable`, `durability.Durable.settle`); a disk that refuses the sync turns the answer into a 503. A namespace
    token's request first waits its turn of its request rate (`rates`, `http/request_rate.py`), before the body."""

    def __init__(self, app, *, token: str, nodes: NodeGate | None, tokens: TokenBook, requests_total: Counter,
                 latency: Histogram, storage: StorageWatch | None = None, limits: LoginLimits | None = None,
                 durable: Callable[[], Awaitable[None]] | None = None, rates: RequestRates):
        self.storage, self.limits, self.durable, self.rates = storage, limits or LoginLimits(), durable, rates
        self._told = 0.0  # when a storage fault was last logged (one line per interval, not a traceback per call)
        self.app, self.token, self.nodes, self.tokens = app, token, nodes, tokens
        self.requests_total, self.latency = requests_total, latency

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, method, path = time.perf_counter(), scope["method"], _namespaced(scope["path"])
        if path != scope["path"]:
            scope = {**scope, "path": path, "raw_path": path.encode()}
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        started = False
        settle = self.durable if method in _WRITES and not _unsynced(path) else None

        async def send_and_count(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                if settle is not None and message["status"] < 300:
                    await settle()  # raises on a disk that refuses: answered 503 below, nothing sent yet
                started = True
                self.requests_total.labels(method, str(message["status"])).inc()
                self.latency.labels(method).observe(time.perf_counter() - start)
            await send(message)

        probe = path in ("/healthz", "/readyz")
        if not probe and self.storage is not None and (lost := self.storage.lost()):
            return await _error(ServiceUnavailable(lost))(scope, receive, send_and_count)
        own_auth = probe or path == "/ui" or path.startswith("/ui/")  # the UI checks its own (`ui/`)
        admin = own_auth or token_matches(header, self.token)
        if not admin and NodeGate.is_node_path(path):
            bearer = header[len("Bearer "):].strip() if header and header.startswith("Bearer ") else None
            allowed, job = self.nodes.check(path, bearer) if self.nodes is not None else (False, None)
            if not allowed:  # a namespace token's 403 here spends its request rate too (`rates`)
                scoped = self.tokens.find(header)
                err: ApiError = Unauthorized("not a node credential of this job, nor this node's token") \
                    if scoped is None else await self.rates.refusal(scoped) or Forbidden(
                        "namespace tokens cannot use the node protocol: nodes use their job's node credential")
                return await _error(err)(scope, receive, send_and_count)
            if job is not None:  # a job credential registering: the route checks the body's job against it
                scope = {**scope, "state": {**(scope.get("state") or {}), "node_job": job}}
        elif not admin:
            scoped = self.tokens.find(header)
            if scoped is None:
                client = scope.get("client")
                if header is not None and (wait := self.limits.failed(client[0] if client else None)):
                    return await _error(TooManyRequests(
                        f"too many failed token checks from this address; retry in {wait} s (a valid token is "
                        "never refused)"), wait)(scope, receive, send_and_count)
                err = Unauthorized(
                    "missing bearer token: send 'Authorization: Bearer <token>' (the token is in the controller's "
                    "data dir, file 'token'; rolloutctl reads it via --token-file or ROLLOUTD_TOKEN)"
                    if header is None
                    else "invalid bearer token"
                )
                return await _error(err)(scope, receive, send_and_count)
            if over := await self.rates.refusal(scoped):  # waits its turn, or 429 past the few waiting
                return await _error(over)(scope, receive, send_and_count)
            if problem := forbidden(scoped, method, path):
                return await _error(Forbidden(problem))(scope, receive, send_and_count)
            scope = {**scope, TOKEN_KEY: scoped}  # admission holds its writes to the namespace's policy
        try:
            await self.app(scope, receive, send_and_count)
        except ApiError as e:
            if started:
                raise
            await _error(e)(scope, receive, send_and_count)
        except Exception as e:
            reason = storage_reason(e) if self.storage is not None else None
            if reason is None or started:
                raise
            self.storage.failed(reason)
            if time.monotonic() - self._told >= RETRY_AFTER_SECONDS:
                self._told = time.monotonic()
                log.error("%s (%s %s answered 503; more such errors in the next %d s are not logged)", reason,
                          method, path, RETRY_AFTER_SECONDS)
            await _error(ServiceUnavailable(f"{reason}; retry later"))(scope, receive, send_and_count)


class _JobsCollector:
    def __init__(self, store: Store):
        self.store = store

    def collect(self):
        g = GaugeMetricFamily("rolloutd_jobs", "RolloutJobs by phase", labels=["phase"])
        counts = {p.value: 0 for p in Phase}
        for item in self.store.list_wire()[0]:
            counts[item["status"].get("phase", "Pending")] += 1
        for phase, n in counts.items():
            g.add_metric([phase], n)
        yield g


class _DurableCollector:
    """The syncs that make acknowledged writes durable (`durability.Durable`), since the controller started."""

    def __init__(self, durable):
        self.durable = durable

    def collect(self):
        d = self.durable
        yield CounterMetricFamily("rolloutd_store_syncs", "fsyncs of the store's WAL before acknowledging writes",
                                  value=d.syncs)
        yield CounterMetricFamily("rolloutd_store_synced_writes", "Acknowledged writes that waited for a sync",
                                  value=d.settled)
        yield CounterMetricFamily("rolloutd_store_sync_seconds", "Seconds spent in those fsyncs", value=d.sync_seconds)
        yield CounterMetricFamily("rolloutd_store_sync_wait_seconds", "Seconds writes waited for their sync, summed",
                                  value=d.wait_seconds)


class _StatsCollector:
    """What the trajectories' running sums (`work/stats.JobStats`) hold in memory."""

    def __init__(self, job_stats):
        self.job_stats = job_stats

    def collect(self):
        kept = self.job_stats.kept()
        g = GaugeMetricFamily("rolloutd_job_stats_jobs", "Jobs whose trajectory numbers the controller keeps in "
                              "memory: running sums, or a finished job's rendered numbers", labels=["kind"])
        for kind in ("running", "final"):
            g.add_metric([kind], kept[kind])
        yield g
        yield GaugeMetricFamily("rolloutd_job_stats_stage_times", "Stage times kept for the running sums' percentiles",
                                value=kept["stage_times"])


class _StalenessCollector:
    """The staleness bound's work since the controller started (`work/staleness.StaleGroups`), all jobs together."""

    def __init__(self, stale):
        self.stale = stale

    def collect(self):
        yield CounterMetricFamily("rolloutd_stale_rollouts_cancelled", "Rollouts in flight cancelled on the daemons "
                                  "at an announce: leased more than spec.policy.maxStaleness versions before it",
                                  value=self.stale.totals["cancelledRollouts"])
        yield CounterMetricFamily("rolloutd_stale_groups_swept", "Counted groups taken out of a running batch at an "
                                  "announce: admitted more than maxStaleness versions before it",
                                  value=self.stale.totals["sweptGroups"])
        yield CounterMetricFamily("rolloutd_stale_groups_gated", "Groups not opened by the capacity gate: (S + v + 1)"
                                  " x the batch's groups accepted or running at most", value=self.stale.totals["gated"])
        yield CounterMetricFamily("rolloutd_stale_rollouts_rerun", "Results that came back more than "
                                  "spec.policy.maxStaleness versions old, their samples run again with the current "
                                  "policy", value=self.stale.totals["rerun"])


class _RolloutsCollector:
    """Retries, masked samples, cleanups and stalls since the controller started, all jobs together
    (`work/queue.ItemQueue.totals`, `work/held_leases.HeldLeases.stalls`): no job or rollout is a label."""

    def __init__(self, queue):
        self.queue = queue

    def collect(self):
        totals = self.queue.totals
        yield CounterMetricFamily("rolloutd_rollout_retries", "Rollout attempts run again after one failed for "
                                  "infrastructure, lost its lease or came back stale", value=totals["retries"])
        yield CounterMetricFamily("rolloutd_rollouts_masked", "Rollouts delivered infra-failed once their attempts "
                                  "were used up: masked samples, no reward", value=totals["masked"])
        yield CounterMetricFamily("rolloutd_rollout_cleanups", "Rollouts in flight cancelled on their nodes (a job "
                                  "deleted or failed, a surplus or stale group): the node stops their sandbox",
                                  value=totals["cleanups"])
        yield CounterMetricFamily("rolloutd_rollout_stalls", "Rollouts that stayed in one stage (or unnamed by their "
                                  "node's beats) for ROLLOUTD_STALLED_AFTER_SECONDS or more, once per stage",
                                  value=self.queue.leases.count_stalls(self.queue.clock()))


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
    registry.register(_JobsCollector(store))
    registry.register(_DurableCollector(store.durable))
    registry.register(root.rates)
    gate = NodeGate(root.credentials, work.registry.job_of) if work is not None else None
    app.add_middleware(_AuthAndMetrics, token=root.token, nodes=gate, tokens=root.tokens,
                       requests_total=requests_total, latency=latency, storage=storage, limits=root.limits,
                       durable=store.durable.settle, rates=root.rates)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # no such route or method
        err = ApiError(f"the server could not find the requested resource ({request.method} {request.url.path})"
                       if exc.status_code == 404 else str(exc.detail))
        err.code, err.reason = exc.status_code, {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code,
                                                                                                 "BadRequest")
        return _error(err)

    @app.exception_handler(Exception)
    async def _crash(_request: Request, exc: Exception):  # a bug, not bad input
        return _error(ApiError(f"internal error: {type(exc).__name__}: {exc}"))

    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _bad_params(_request: Request, exc: RequestValidationError):
        causes = [{"field": ".".join(str(p) for p in e["loc"]), "reason": "FieldValueInvalid", "message": e["msg"]}
                  for e in exc.errors()]
        return _error(BadRequest("invalid request: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                                 causes=causes))

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
    registry.register(_StatsCollector(root.stats))
    if work is not None and root.scheduler is not None:
        registry.register(_StalenessCollector(work.stale))
        registry.register(_RolloutsCollector(work.queue))
        registry.register(FirstTokenCollector(work.first_tokens))
        registry.register(workshare.Collector(work.pool.admission))
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
