"""The controller's HTTP API (FastAPI), Kubernetes-shaped.

    /apis/rolloutd.io/v1alpha1/rolloutjobs            POST create · GET list (?labelSelector, ?watch=true)
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}     PUT apply · GET · DELETE
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}/status   GET · PUT (status subresource)
    /apis/rolloutd.io/v1alpha1/rolloutjobs/{name}/events   GET (what `describe` shows)
    /healthz (no auth) · /metrics (Prometheus) · /openapi.json

Built by `create_app(store, token)`; served by `server.py`. Every endpoint but /healthz needs
the bearer token. Errors are Kubernetes `Status` objects (see `errors.py`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

import yaml
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import ValidationError

from rolloutd.crds.names import API_PREFIX as PREFIX
from rolloutd.crds.rolloutjob import API_VERSION, KIND, Phase, RolloutJob, RolloutJobStatus

from .auth import token_matches
from .http.bodies import parse_document, parse_version
from .errors import ApiError, BadRequest, Invalid, Unauthorized, from_validation_error
from .http.openapi import describe
from .policy import backend_url_problem, tokenizer_problem
from .store import Store, matches, parse_selector

KEEPALIVE_SECONDS = 15.0
log = logging.getLogger("rolloutd.api")


def _error(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.code == 401 else None
    return JSONResponse(err.status(), status_code=err.code, headers=headers)


def validate_job(doc: dict[str, Any], url_name: str | None = None) -> RolloutJob:
    causes = []
    if doc.get("apiVersion") != API_VERSION:
        causes.append({"field": "apiVersion", "reason": "FieldValueInvalid",
                       "message": f"must be {API_VERSION!r}, got {doc.get('apiVersion')!r}"})
    if doc.get("kind") != KIND:
        causes.append({"field": "kind", "reason": "FieldValueInvalid",
                       "message": f"must be {KIND!r}, got {doc.get('kind')!r}"})
    if causes:
        raise BadRequest("; ".join(f"{c['field']}: {c['message']}" for c in causes), causes=causes)
    meta = doc.get("metadata")
    body_name = meta.get("name") if isinstance(meta, dict) else None
    if url_name is not None and body_name is not None and body_name != url_name:
        raise BadRequest(
            f"metadata.name {str(body_name)[:100]!r} does not match the name in the URL {url_name!r}",
            causes=[{"field": "metadata.name", "reason": "FieldValueInvalid", "message": "does not match the URL"}],
        )
    if url_name is not None and isinstance(meta, dict) and body_name is None:
        doc = {**doc, "metadata": {**meta, "name": url_name}}
    doc = {k: v for k, v in doc.items() if k != "status"}  # status is written through /status only
    try:
        job = RolloutJob.model_validate(doc)
    except ValidationError as e:
        named = body_name if isinstance(body_name, str) else None  # Status.details.name is a string
        raise from_validation_error(e, name=named or url_name, root=RolloutJob) from None
    check_policy(job)
    return job


def check_policy(job: RolloutJob) -> None:
    """422 for a backend or tokenizer the controller's policy refuses (`policy.py`)."""
    llm = job.spec.llm
    problems = [(f"spec.llm.backends[{i}].url", backend_url_problem(b.url)) for i, b in enumerate(llm.backends)]
    problems.append(("spec.llm.tokenizer", tokenizer_problem(llm.tokenizer)))
    causes = [{"field": f, "reason": "FieldValueForbidden", "message": p} for f, p in problems if p]
    if causes:
        raise Invalid("RolloutJob is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                      causes=causes, name=job.metadata.name)


class _AuthAndMetrics:
    """Bearer-token check and request metrics around every request, as plain ASGI: Starlette's
    `BaseHTTPMiddleware` (`@app.middleware`) runs each request in a task group of its own, which
    cost more CPU than a node's heartbeat itself at a thousand nodes. Latency is observed when the
    response starts (a watch stream is counted once, not for its whole life)."""

    def __init__(self, app, *, token: str, join_token: str | None, requests_total: Counter, latency: Histogram):
        self.app, self.token, self.join_token = app, token, join_token
        self.requests_total, self.latency = requests_total, latency

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, method, path = time.perf_counter(), scope["method"], scope["path"]
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        node_call = self.join_token is not None and path.startswith(PREFIX + "/nodes/") \
            and token_matches(header, self.join_token)
        started = False

        async def send_and_count(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.requests_total.labels(method, str(message["status"])).inc()
                self.latency.labels(method).observe(time.perf_counter() - start)
            await send(message)

        if path != "/healthz" and not node_call and not token_matches(header, self.token):
            err = Unauthorized(
                "missing bearer token: send 'Authorization: Bearer <token>' (the token is in the controller's "
                "data dir, file 'token'; rolloutctl reads it via --token-file or ROLLOUTD_TOKEN)"
                if header is None
                else "invalid bearer token"
            )
            return await _error(err)(scope, receive, send_and_count)
        try:
            await self.app(scope, receive, send_and_count)
        except ApiError as e:
            if started:
                raise
            await _error(e)(scope, receive, send_and_count)


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


def create_app(store: Store, token: str, *, join_token: str | None = None, scheduler=None) -> FastAPI:
    app = FastAPI(
        title="rolloutd controller",
        version="v1alpha1",
        description="Rollout-as-a-Service: RolloutJobs reconciled into rollouts on Slurm or local node daemons.",
        docs_url=None,
        redoc_url=None,
    )
    registry = CollectorRegistry()
    requests_total = Counter("rolloutd_api_requests", "API requests", ["method", "code"], registry=registry)
    latency = Histogram("rolloutd_api_request_seconds", "API request latency", ["method"], registry=registry)
    registry.register(_JobsCollector(store))
    app.state.store = store
    app.state.registry = registry

    app.add_middleware(_AuthAndMetrics, token=token, join_token=join_token, requests_total=requests_total,
                       latency=latency)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return _error(exc)

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
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- collection

    @app.post(f"{PREFIX}/rolloutjobs", status_code=201)
    async def create(request: Request):
        job = validate_job(await parse_document(request))
        wire, _ = await asyncio.to_thread(store.apply, job, create_only=True)
        return JSONResponse(wire, status_code=201, headers={"X-Rolloutd-Outcome": "created"})

    @app.get(f"{PREFIX}/rolloutjobs")
    async def list_or_watch(
        request: Request,
        labelSelector: str | None = None,
        fieldSelector: str | None = None,
        watch: bool = False,
        resourceVersion: str | None = None,
        timeoutSeconds: float | None = Query(default=None, gt=0, allow_inf_nan=False),
    ):
        name = _name_from_field_selector(fieldSelector)
        if watch:
            since = request.headers.get("last-event-id") or resourceVersion
            return _watch_response(store, since, labelSelector, name, timeoutSeconds)
        items, rv = await asyncio.to_thread(store.list_wire, labelSelector)
        if name:
            items = [i for i in items if i["metadata"]["name"] == name]
        return {"apiVersion": API_VERSION, "kind": "RolloutJobList", "metadata": {"resourceVersion": str(rv)},
                "items": items}

    # ---------------------------------------------------------------- one job

    @app.put(f"{PREFIX}/rolloutjobs/{{name}}")
    async def apply(name: str, request: Request):
        job = validate_job(await parse_document(request), url_name=name)
        wire, outcome = await asyncio.to_thread(store.apply, job)
        return JSONResponse(wire, status_code=201 if outcome == "created" else 200,
                            headers={"X-Rolloutd-Outcome": outcome})

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}")
    async def get(name: str):
        return await asyncio.to_thread(store.get_wire, name)

    @app.delete(f"{PREFIX}/rolloutjobs/{{name}}")
    async def delete(name: str):
        wire = await asyncio.to_thread(store.mark_deleted, name)
        return JSONResponse(wire, status_code=202)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}/status")
    async def get_status(name: str):
        return await asyncio.to_thread(store.get_wire, name)

    @app.put(f"{PREFIX}/rolloutjobs/{{name}}/status")
    async def put_status(name: str, request: Request):
        doc = await parse_document(request)
        if "status" not in doc or not isinstance(doc["status"], dict):
            raise BadRequest("body must contain a 'status' object", causes=[
                {"field": "status", "reason": "FieldValueRequired", "message": "required"}])
        try:
            status = RolloutJobStatus.model_validate(doc["status"])
        except ValidationError as e:
            raise from_validation_error(e, prefix=("status",), name=name, root=RolloutJobStatus) from None
        meta = doc.get("metadata")
        expect = parse_version(meta.get("resourceVersion") if isinstance(meta, dict) else None,
                               "metadata.resourceVersion")
        return await asyncio.to_thread(store.update_status, name, status, expect_rv=expect)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}/events")
    async def events(name: str):
        await asyncio.to_thread(store.get_wire, name)  # 404 for unknown jobs
        return {"items": await asyncio.to_thread(store.events, name)}

    if scheduler is not None:
        from .http.nodes import node_router
        from .http.trainer import trainer_router

        app.include_router(node_router(scheduler))
        app.include_router(trainer_router(store, scheduler))
    describe(app)
    return app


def _name_from_field_selector(selector: str | None) -> str | None:
    if not selector:
        return None
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if key.strip() == "metadata.name" and value:
            return value.strip().lstrip("=")
        raise BadRequest(f"unsupported fieldSelector {term!r}; only metadata.name=NAME is supported")
    return None


def _sse(rv: int, type_: str, obj: dict[str, Any]) -> bytes:
    return f"id: {rv}\nevent: {type_}\ndata: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n".encode()


def _watch_response(store: Store, since: str | None, selector: str | None, name: str | None,
                    timeout: float | None) -> StreamingResponse:
    since_rv = parse_version(since, "resourceVersion")
    sel = parse_selector(selector)
    if since_rv is not None:
        store.changes_since(since_rv, name, limit=1)  # 410 now, before the stream starts

    async def events() -> AsyncIterator[bytes]:
        wake = store.subscribe()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            if since_rv is None:  # like Kubernetes: synthetic ADDED for what exists, then changes
                items, rv = await asyncio.to_thread(store.list_wire, selector)
                for item in items:
                    if name is None or item["metadata"]["name"] == name:
                        yield _sse(int(item["metadata"]["resourceVersion"]), "ADDED", item)
                cursor = rv
                yield f"id: {rv}\nevent: BOOKMARK\ndata: {{}}\n\n".encode()
            else:
                cursor = since_rv
            while True:
                wake.clear()
                changes = await asyncio.to_thread(store.changes_since, cursor, name)
                for ch in changes:
                    cursor = ch.rv
                    if matches(ch.object["metadata"].get("labels", {}), sel):
                        try:
                            yield _sse(ch.rv, ch.type, ch.object)
                        except ValueError as e:  # NaN/Infinity in a row an older version stored
                            log.error("watch skips change %d of %s: %s", ch.rv, ch.name, e)
                if changes and len(changes) >= 500:
                    continue
                wait = KEEPALIVE_SECONDS
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                try:
                    await asyncio.wait_for(wake.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    yield b": keepalive\n\n"
        finally:
            store.unsubscribe(wake)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
