"""The /ui sub-app: pages (static HTML and script), login and logout, and the JSON the pages read.

Mounted by `api.create_app` at /ui; the API's bearer middleware lets /ui through and this app authenticates
itself (`session.py`: the session cookie, or `Authorization: Bearer` for scripts). Every job it shows passes
the API's scope rule first; the data comes from the same store and scheduler calls the API routes make, summed
up by `work/stats.py`, built for the live pages by `live.py` (on the event loop, in slices), decoded by
`../decode.py` and encoded in a worker thread by `answers.py`. Every response carries a CSP without inline
script, nosniff and frame-ancestors 'none'. Routes (under /ui):
    GET  /login · POST /login (form field `token`) · POST /logout (form field `csrf`)
    GET  /jobs · /jobs/{ns}/{name} · /jobs/{ns}/{name}/t/{seq}        the pages (one shell, `static/app.js`)
    GET  /api/me · /api/jobs[/stream] · /api/jobs/{ns}/{name}[/stream] · …/nodes · …/inflight (`work/inflight.py`)
         · …/config · …/curves · …/trajectories (sortable: `jobview.py`) · …/trajectories/{seq} (with its
         waterfall: `waterfall.py`; the document and its group: `work/trajectory_reads.py`)   JSON, SSE
Next step: throughput per node on the job page.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, HTTPException, Path as ApiPath, Query, Request
from fastapi.responses import FileResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.requests import ClientDisconnect

from rolloutd.crds.names import API_PREFIX, job_key

from ..access.auth import TokenBook
from ..errors import ApiError
from ..http import streams
from ..http.bodies import INT64_MAX
from ..http.login_limit import LoginLimits
from ..store import Store
from ..work import inflight as inflight_rows, stats, trajectory_reads
from ..work.inflight import inflight
from ..executors.base import Executor, ExecutorError
from ..executors.logs import NoLogs
from ..work import tracing as attempt_traces
from ..work.scheduler import Scheduler
from .. import decode
from . import jobview, links
from .answers import json_response, off_loop, with_raw
from .waterfall import waterfall
from .live import Built, JobGone, LivePages, WorkView
from .session import COOKIE, SESSION_SECONDS, Principal, Sessions

STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                 b"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make a form POST's Origin "null"
    (b"cache-control", b"no-store"),
]


class _Headers:
    """Adds SECURITY_HEADERS to every response of the wrapped app (plain ASGI: streams pass untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)
        await self.app(scope, receive, with_headers if scope["type"] == "http" else send)


def create_ui(store: Store, token: str, tokens: TokenBook, slots: streams.Streams, job_stats: stats.JobStats,
              scheduler: Scheduler | None = None, work: WorkView | None = None, busy: Callable[[], float] | None = None,
              observe_step: Callable[[float], None] | None = None, limits: LoginLimits | None = None,
              executors: Mapping[str, Executor] | None = None, trace_url: str | None = None) -> Any:
    """`job_stats`: the API's (`GET …/stats`, rolloutctl describe); `slots`: the scoped tokens' watch slots;
    `scheduler`, `work`: the root's scheduler and what the UI reads of its work core (None without a scheduler);
    `busy`: the event loop's recent largest lag (`looplag.LoopLag.recent_max`), which slows the live pages' refresh
    on a busy controller; `observe_step`: each step of a live page's build, in seconds (a metric); `limits`: the
    login rate limits (`http/login_limit.py`), shared with the API's token checks; `executors`: the root's, by kind
    (a node's logs); `trace_url`: ROLLOUTD_TRACE_URL (the trace links)."""
    limits = limits or LoginLimits()
    executors = executors or {}
    ui = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    sessions = Sessions(token, tokens)
    engine = store.engine
    live = LivePages(store, job_stats, scheduler, work, busy, observe_step)
    curves = jobview.Curves(engine)
    ui.mount("/static", StaticFiles(directory=STATIC), name="static")

    def who(request: Request) -> Principal:
        header = request.headers.get("authorization")
        p = sessions.from_header(header) or sessions.from_cookie(request.cookies.get(COOKIE))
        if p is None and header and (wait := limits.failed(request.client.host if request.client else None)):
            raise HTTPException(429, f"too many failed token checks from this address; retry in {wait} s",
                                headers={"Retry-After": str(wait)})
        if p is None:
            raise HTTPException(401, "log in at /ui/login, or send 'Authorization: Bearer <token>'")
        return p

    def same_origin(request: Request) -> None:
        """A state-changing request must come from this site's own pages (the cookie is SameSite=Strict too)."""
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != request.headers.get("host"):
            raise HTTPException(403, "cross-site request refused")
        if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            raise HTTPException(403, "cross-site request refused")

    def visible(p: Principal, namespace: str, name: str) -> str:
        if problem := p.may_read(namespace, name):
            raise HTTPException(403, problem)
        return job_key(namespace, name)

    async def form(request: Request) -> dict[str, list[str]]:
        """A small urlencoded form (login, logout): 413 beyond 8 KiB."""
        body = b""
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > 8192:
                    raise HTTPException(413, "form too large")
        except ClientDisconnect:  # as `http.bodies.read_body`: a 400, not a traceback in the log
            raise HTTPException(400, "the form did not arrive whole: the connection closed") from None
        return parse_qs(body.decode("utf-8", "replace"))

    def page(request: Request) -> Any:
        try:
            who(request)
        except HTTPException:
            return RedirectResponse("/ui/login", status_code=303)
        return FileResponse(STATIC / "app.html", media_type="text/html")

    @ui.get("/")
    async def root(request: Request):
        return RedirectResponse("/ui/jobs", status_code=303)

    @ui.get("/login")
    async def login_page():
        return FileResponse(STATIC / "login.html", media_type="text/html")

    @ui.post("/login")
    async def login(request: Request):
        same_origin(request)
        token = ((await form(request)).get("token") or [""])[0]
        who = sessions.principal(token.strip())
        wait = limits.failed(request.client.host if request.client else None) if who is None else \
            limits.login(sessions.key(who))
        if wait:
            return PlainTextResponse(f"too many {'failed ' if who is None else ''}logins; retry in {wait} s", 429,
                                     headers={"Retry-After": str(wait)})
        found = sessions.login(token)
        if found is None:
            return RedirectResponse("/ui/login?failed=1", status_code=303)
        resp = RedirectResponse("/ui/jobs", status_code=303)
        resp.set_cookie(COOKIE, found[0], max_age=SESSION_SECONDS, path="/ui", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    @ui.post("/logout")
    async def logout(request: Request):
        same_origin(request)
        sid = request.cookies.get(COOKIE)
        if not sessions.csrf_ok(sid, ((await form(request)).get("csrf") or [None])[0]):
            raise HTTPException(403, "missing or wrong csrf field")
        sessions.logout(sid)
        resp = RedirectResponse("/ui/login", status_code=303)
        resp.delete_cookie(COOKIE, path="/ui")
        return resp

    @ui.get("/jobs")
    async def jobs_page(request: Request):
        return page(request)

    @ui.get("/jobs/{namespace}/{name}")
    async def job_page(request: Request, namespace: str, name: str):
        return page(request)

    @ui.get("/jobs/{namespace}/{name}/t/{seq}")
    async def trajectory_page(request: Request, namespace: str, name: str, seq: int):
        return page(request)

    # ------------------------------------------------------------ JSON

    @ui.get("/api/me")
    async def me(request: Request):
        p = who(request)
        return {"name": p.name, "namespaces": list(p.scoped.namespaces) if p.scoped else [],
                "readOnly": bool(p.scoped and p.scoped.read_only), "csrf": sessions.csrf(request.cookies.get(COOKIE))}

    async def job_summary(p: Principal, namespace: str, name: str) -> Built:
        try:
            return await live.job(visible(p, namespace, name), namespace, name)
        except JobGone as e:
            raise HTTPException(e.code, e.message) from None

    def sse(request: Request, p: Principal, produce: Callable[[], Awaitable[Built]],
            namespace: str | None = None) -> StreamingResponse:
        """A live page's stream: a scoped token's holds one of its watch slots and ends once it is revoked."""
        try:
            slot = slots.take_for(p.scoped, namespace, lambda: _still(request))
        except ApiError as e:  # over quotas.watches: the UI's own error form
            raise HTTPException(e.code, e.message) from None
        async def events():
            ev, last, end = store.subscribe(), None, time.monotonic() + 300  # the browser reconnects after
            try:
                while time.monotonic() < end and not await request.is_disconnected():
                    ev.clear()
                    try:
                        built = await produce()
                    except HTTPException as e:
                        yield f"event: gone\ndata: {json.dumps(e.detail)}\n\n".encode()
                        return
                    yield built.frame if built.version != last else b": tick\n\n"  # the same bytes for every page
                    last = built.version
                    try:  # a store change (status, counts), or every 2 s for trajectories and nodes
                        await asyncio.wait_for(ev.wait(), 2.0)
                    except asyncio.TimeoutError:
                        pass
                    await asyncio.sleep(0.25)  # at most four updates a second (a build is made at most once a second)
            finally:
                store.unsubscribe(ev)
        return streams.guard(slot, StreamingResponse(events(), media_type="text/event-stream"))

    def _still(request: Request) -> bool:
        return (sessions.from_header(request.headers.get("authorization"))
                or sessions.from_cookie(request.cookies.get(COOKIE))) is not None

    @ui.get("/api/jobs")
    async def jobs(request: Request):
        return json_response((await live.jobs(who(request))).body)

    @ui.get("/api/jobs/stream")
    async def jobs_stream(request: Request):
        p = who(request)
        return sse(request, p, lambda: live.jobs(p))

    @ui.get("/api/jobs/{namespace}/{name}")
    async def job(request: Request, namespace: str, name: str):
        return json_response((await job_summary(who(request), namespace, name)).body)

    @ui.get("/api/jobs/{namespace}/{name}/stream")
    async def job_stream(request: Request, namespace: str, name: str):
        p = who(request)
        visible(p, namespace, name)
        return sse(request, p, lambda: job_summary(p, namespace, name), namespace)

    @ui.get("/api/jobs/{namespace}/{name}/nodes")
    async def job_nodes(request: Request, namespace: str, name: str, offset: int = Query(0, ge=0, le=INT64_MAX),
                        limit: int = Query(200, ge=1, le=1000)):
        key = visible(who(request), namespace, name)
        await asyncio.to_thread(existing, namespace, name)  # off the loop: a stalled database holds this call only
        return json_response(await live.nodes(key, offset, limit))

    @ui.get("/api/jobs/{namespace}/{name}/inflight")
    async def job_inflight(request: Request, namespace: str, name: str):
        key = visible(who(request), namespace, name)
        await asyncio.to_thread(existing, namespace, name)
        if work is None:
            raise HTTPException(404, "this controller runs no scheduler: nothing is in flight here")
        leases = work.leases
        out = await inflight(leases, key, work.clock(), leases.stall_seconds, inflight_rows.DEFAULT_LIMIT)
        for row in out["items"]:
            tid = attempt_traces.trace_id(row["attemptId"])
            row.update(traceId=tid, traceUrl=links.trace_url(trace_url, tid),
                       logsUrl=links.logs_page(namespace, name, row["node"], row["attemptId"], tid))
        return out

    @ui.get("/jobs/{namespace}/{name}/logs")
    async def logs_page(request: Request, namespace: str, name: str):
        return page(request)

    @ui.get("/api/jobs/{namespace}/{name}/logs")
    async def attempt_logs(request: Request, namespace: str, name: str, node: str = Query(..., max_length=200),
                           attempt: str | None = Query(None, max_length=200),
                           trace: str | None = Query(None, pattern=r"^[0-9a-f]{32}$")):
        """One attempt's lines in its node's log (all of the node's last lines when no attempt is named)."""
        key = visible(who(request), namespace, name)
        await asyncio.to_thread(existing, namespace, name)  # 404 for an unknown job, in the UI's own error form
        job = await asyncio.to_thread(store.get, key)
        executor = executors.get(job.spec.executor.kind)
        if executor is None or work is None:
            raise HTTPException(409, f"rolloutjob {key} runs on the {job.spec.executor.kind} executor, which this "
                                     "controller does not run: its daemons' logs are not here")
        slot = links.slot_of(work.registry.listing(key), node)
        if slot is None:
            raise HTTPException(404, f"rolloutjob {key} has no node {node}")
        try:
            out = await links.attempt_lines(executor, job, slot, [n for n in (attempt, trace) if n])
        except (NoLogs, ExecutorError) as e:
            raise HTTPException(404, f"no log of node {node}: {e}") from None
        return {"node": node, "slot": slot, "attempt": attempt, "traceId": trace,
                "traceUrl": links.trace_url(trace_url, trace), **out}

    def existing(namespace: str, name: str) -> dict[str, Any]:
        try:
            return store.get_wire(name, namespace)
        except ApiError as e:
            raise HTTPException(e.code, e.message) from None

    @ui.get("/api/jobs/{namespace}/{name}/config")
    async def job_config(request: Request, namespace: str, name: str):
        visible(who(request), namespace, name)
        return await off_loop(lambda: jobview.config(existing(namespace, name)))

    @ui.get("/api/jobs/{namespace}/{name}/curves")
    async def job_curves(request: Request, namespace: str, name: str):
        key = visible(who(request), namespace, name)

        def load() -> dict[str, Any]:
            job = existing(namespace, name)
            return curves.get(key, job["metadata"]["uid"], int(job["spec"].get("samplesPerPrompt") or 1))
        history = scheduler.policy(key)["history"] if scheduler is not None else []

        def answer() -> dict[str, Any]:
            out = load()
            return {**out, "byPolicy": [{**p, "behind": jobview.behind(p["policyVersion"], history)}
                                        for p in out["byPolicy"]]}
        return await off_loop(answer)

    @ui.get("/api/jobs/{namespace}/{name}/trajectories")
    async def trajectories(request: Request, namespace: str, name: str, after: int = Query(0, ge=0, le=INT64_MAX),
                           offset: int = Query(0, ge=0, le=1_000_000), limit: int = Query(50, ge=1, le=500),
                           sort: str = Query("seq", max_length=20), rewardMin: float | None = None,
                           rewardMax: float | None = None, failure: str | None = None, task: str | None = None,
                           q: str | None = Query(None, max_length=500)):
        key = visible(who(request), namespace, name)
        try:
            return await off_loop(lambda: jobview.search(
                engine, key, after=after, offset=offset, limit=limit, sort=sort, reward_min=rewardMin,
                reward_max=rewardMax, failure=failure, task=task, text=q))
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

    @ui.get("/api/jobs/{namespace}/{name}/trajectories/{seq}")
    async def trajectory(request: Request, namespace: str, name: str, seq: int = ApiPath(ge=0, le=INT64_MAX)):
        key = visible(who(request), namespace, name)

        def load() -> dict[str, Any]:
            data = trajectory_reads.trajectory(engine, key, seq)
            if data is None:
                raise HTTPException(404, f"rolloutjob {namespace}/{name} has no trajectory {seq}")
            raw = json.loads(data)
            tokenizer = ((store.get_wire(name, namespace)["spec"].get("llm") or {}).get("tokenizer"))
            view = decode.decode(raw, tokenizer)
            tid = raw.get("traceId")
            view.update(traceId=tid, traceUrl=links.trace_url(trace_url, tid),
                        logsUrl=links.logs_page(namespace, name, raw.get("node"), raw.get("attemptId"), tid))
            view.update(seq=seq, waterfall=waterfall(raw),
                        group=trajectory_reads.group(engine, key, raw.get("prompt", 0), raw.get("group")),
                        api=f"{API_PREFIX}/namespaces/{namespace}/rolloutjobs/{name}/trajectories?cursor={seq - 1}&limit=1")
            return with_raw(view, seq, data)
        return json_response(await asyncio.to_thread(load))

    return _Headers(ui)

