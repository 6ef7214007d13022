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
import time
from typing import Any, AsyncIterator

import yaml
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import ValidationError

from rolloutd.crds.rolloutjob import API_VERSION, KIND, Phase, RolloutJob, RolloutJobStatus

from .auth import token_matches
from .config import API_PREFIX as PREFIX
from .errors import ApiError, BadRequest, TooLarge, Unauthorized, UnsupportedMediaType, from_validation_error
from .store import Store, matches, parse_selector
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a RolloutJob is a few KB; datasets are referenced, not inlined
_TEXT_TYPES = ("application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/plain", "")
KEEPALIVE_SECONDS = 15.0


def _error(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.code == 401 else None
    return JSONResponse(err.status(), status_code=err.code, headers=headers)


async def _read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


async def parse_document(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """YAML or JSON body → a mapping, with a 4xx naming the line for malformed input."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in _TEXT_TYPES:
        raise UnsupportedMediaType(f"content type {ctype!r} not supported; send application/json or application/yaml")
    raw = await _read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8 text: {e}") from None
    if ctype == "application/json" or text.lstrip()[:1] in ("{", "["):
        try:  # JSON bodies (every machine client) take the fast parser; YAML is for people
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRequest(f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        if not isinstance(doc, dict):
            raise BadRequest(f"expected a RolloutJob object, got {type(doc).__name__}")
        return doc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise BadRequest(f"malformed YAML/JSON{where}: {problem}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"expected a RolloutJob object, got {type(doc).__name__}")
    return doc


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
            f"metadata.name {body_name!r} does not match the name in the URL {url_name!r}",
            causes=[{"field": "metadata.name", "reason": "FieldValueInvalid", "message": "does not match the URL"}],
        )
    if url_name is not None and isinstance(meta, dict) and body_name is None:
        doc = {**doc, "metadata": {**meta, "name": url_name}}
    doc = {k: v for k, v in doc.items() if k != "status"}  # status is written through /status only
    try:
        return RolloutJob.model_validate(doc)
    except ValidationError as e:
        raise from_validation_error(e, name=body_name or url_name, root=RolloutJob) from None


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
        timeoutSeconds: float | None = Query(default=None, gt=0),
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
        rv = (doc.get("metadata") or {}).get("resourceVersion")
        expect = int(rv) if rv is not None and str(rv).isdigit() else None
        return await asyncio.to_thread(store.update_status, name, status, expect_rv=expect)

    @app.get(f"{PREFIX}/rolloutjobs/{{name}}/events")
    async def events(name: str):
        await asyncio.to_thread(store.get_wire, name)  # 404 for unknown jobs
        return {"items": await asyncio.to_thread(store.events, name)}

    if scheduler is not None:
        from .nodeapi import node_router

        app.include_router(node_router(store, scheduler))
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
    return f"id: {rv}\nevent: {type_}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _watch_response(store: Store, since: str | None, selector: str | None, name: str | None,
                    timeout: float | None) -> StreamingResponse:
    if since is not None and not str(since).isdigit():
        raise BadRequest(f"resourceVersion must be an integer, got {since!r}")
    sel = parse_selector(selector)
    if since is not None:
        store.changes_since(int(since), name, limit=1)  # 410 now, before the stream starts

    async def events() -> AsyncIterator[bytes]:
        wake = store.subscribe()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            if since is None:  # like Kubernetes: synthetic ADDED for what exists, then changes
                items, rv = await asyncio.to_thread(store.list_wire, selector)
                for item in items:
                    if name is None or item["metadata"]["name"] == name:
                        yield _sse(int(item["metadata"]["resourceVersion"]), "ADDED", item)
                cursor = rv
                yield f"id: {rv}\nevent: BOOKMARK\ndata: {{}}\n\n".encode()
            else:
                cursor = int(since)
            while True:
                wake.clear()
                changes = await asyncio.to_thread(store.changes_since, cursor, name)
                for ch in changes:
                    cursor = ch.rv
                    if matches(ch.object["metadata"].get("labels", {}), sel):
                        yield _sse(ch.rv, ch.type, ch.object)
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
