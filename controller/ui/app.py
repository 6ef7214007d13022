"""The /ui sub-app: pages (static HTML and script), login and logout, and the JSON the pages read.

Mounted by `api.create_app` at /ui; the API's bearer middleware lets /ui through and this app authenticates
itself (`session.py`: the session cookie, or `Authorization: Bearer` for scripts). Every job it shows passes
the API's scope rule first; the data comes from the same store and scheduler calls the API routes make, summed
up by `work/stats.py` and decoded by `decode.py`. Every response carries a CSP without inline script, nosniff and
frame-ancestors 'none'. Routes (under /ui):
    GET  /login · POST /login (form field `token`) · POST /logout (form field `csrf`)
    GET  /jobs · /jobs/{ns}/{name} · /jobs/{ns}/{name}/t/{seq}        the pages (one shell, `static/app.js`)
    GET  /api/me · /api/jobs[/stream] · /api/jobs/{ns}/{name}[/stream] · …/trajectories[/{seq}]   JSON, SSE
Next step: throughput per node on the job page.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from rolloutd.crds.names import API_PREFIX, job_key

from ..auth import TokenBook
from ..errors import ApiError
from ..store import Store
from ..work import stats
from . import decode
from .session import COOKIE, SESSION_SECONDS, Principal, Sessions

STATIC = Path(__file__).parent / "static"
SUMMARY_SECONDS = 1.0
BUILD_SHARE = 20  # a job's summary is built at most once per 20 × its build time: ≤ 5 % of a core per job
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


def _rate(status: dict[str, Any]) -> tuple[float | None, float | None]:
    """Rollouts per second since the job started, and the seconds left at that rate (None when unknown)."""
    counts, start = status.get("counts") or {}, status.get("startTime")
    if not start:
        return None, None
    begin = datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp()
    end = status.get("completionTime")
    now = datetime.fromisoformat(end.replace("Z", "+00:00")).timestamp() if end else time.time()
    done = counts.get("succeeded", 0) + counts.get("failed", 0) + counts.get("cancelled", 0)
    if now - begin <= 0 or done == 0:
        return None, None
    rate = done / (now - begin)
    left = max(counts.get("total", 0) - done, 0)
    return round(rate, 3), (round(left / rate, 1) if not end else 0.0)


def create_ui(store: Store, token: str, tokens: TokenBook, scheduler=None,
              job_stats: stats.JobStats | None = None) -> Any:
    ui = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    sessions = Sessions(token, tokens)
    engine = store.engine
    job_stats = job_stats or stats.JobStats(engine)  # the API's (`GET …/stats`, rolloutctl describe) when given
    ui.mount("/static", StaticFiles(directory=STATIC), name="static")

    def who(request: Request) -> Principal:
        p = sessions.from_header(request.headers.get("authorization")) or sessions.from_cookie(request.cookies.get(COOKIE))
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
        async for chunk in request.stream():
            body += chunk
            if len(body) > 8192:
                raise HTTPException(413, "form too large")
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
        found = sessions.login(((await form(request)).get("token") or [""])[0])
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

    def jobs_list(p: Principal) -> dict[str, Any]:
        items = []
        for job in store.list_wire()[0]:
            meta, status = job["metadata"], job.get("status") or {}
            if p.may_read(meta["namespace"], meta["name"]):
                continue
            rate, eta = _rate(status)
            counts = job_stats.counts(job_key(meta["namespace"], meta["name"]), meta["uid"])
            items.append({"namespace": meta["namespace"], "name": meta["name"], "phase": status.get("phase", "Pending"),
                          "counts": status.get("counts") or {}, "rolloutsPerSecond": rate, "etaSeconds": eta,
                          "rewardMean": counts["rewardMean"], "infraRate": counts["infraRate"],
                          "delivered": counts["delivered"], "policyVersion": status.get("policyVersion"),
                          "message": status.get("message", "")})
        return {"items": items}

    cache: dict[str, tuple[float, str]] = {}  # job → (monotonic when it may be built again, the summary's JSON)
    building = threading.Lock()  # one build at a time: a page arriving meanwhile waits for it and shares it

    def job_summary(p: Principal, namespace: str, name: str) -> str:
        """The job page's data as JSON, one build shared by every open page of the job. A build holds the GIL the
        event loop needs for the nodes' calls, so what it reads is kept summed (`JobStats`), in memory (pins,
        leases, liveness) or read as plain rows, it is serialised once, and it is made again after SUMMARY_SECONDS
        or BUILD_SHARE times the CPU it took, whichever is longer (the UI's share of a core stays bounded)."""
        key = visible(p, namespace, name)
        with building:
            hit = cache.get(key)
            if hit is None or time.monotonic() >= hit[0]:
                t0, cpu = time.monotonic(), time.thread_time()  # its own CPU: a busy machine does not stretch it
                body = json.dumps(build_summary(key, namespace, name))
                hit = cache[key] = (t0 + max(SUMMARY_SECONDS, BUILD_SHARE * (time.thread_time() - cpu)), body)
        return hit[1]

    def build_summary(key: str, namespace: str, name: str) -> dict[str, Any]:
        try:
            job = store.get_wire(name, namespace)
        except ApiError as e:
            raise HTTPException(e.code, e.message) from None
        status = job.get("status") or {}
        rate, eta = _rate(status)
        uid = job["metadata"]["uid"]
        out: dict[str, Any] = {"namespace": namespace, "name": name, "uid": uid,
                               "phase": status.get("phase", "Pending"), "status": status,
                               "rolloutsPerSecond": rate, "etaSeconds": eta, "events": store.events(key),
                               "tokenizer": (job["spec"].get("llm") or {}).get("tokenizer"),
                               "trajectories": job_stats.counts(key, uid) if scheduler else None,
                               "nodes": [], "backends": []}
        if scheduler is not None:
            out.update(job_stats.summary(key, uid))
            now, held = time.time(), scheduler.leases_held
            out["nodes"] = [{"id": i, "name": n, "host": h, "state": st, "slot": slot, "inflight": held(i),
                             "secondsSinceBeat": round(now - seen, 1)}
                            for i, n, h, st, slot, seen in scheduler.node_listing(key)]
            pinned = scheduler.pinned(key)
            out["backends"] = [{"url": (u := b["url"].rstrip("/")), "healthy": u not in scheduler.pool.unhealthy,
                                "reason": scheduler.pool.unhealthy.get(u, ""), "inflight": scheduler.pool.inflight.get(u, 0),
                                "pinnedToJob": pinned.get(u, 0), "admissionCap": scheduler.pool.admission.cap(u, key)}
                               for b in (job["spec"].get("llm") or {}).get("backends", [])]
            out["policy"] = scheduler.policy(key)
        return out

    def sse(request: Request, produce: Callable[[], str]) -> StreamingResponse:
        async def events():
            ev, last, end = store.subscribe(), None, time.monotonic() + 300  # the browser reconnects after
            try:
                while time.monotonic() < end and not await request.is_disconnected():
                    ev.clear()
                    try:
                        body = await asyncio.to_thread(produce)
                    except HTTPException as e:
                        yield f"event: gone\ndata: {json.dumps(e.detail)}\n\n"
                        return
                    yield f"data: {body}\n\n" if body != last else ": tick\n\n"
                    last = body
                    try:  # a store change (status, counts), or every 2 s for trajectories and nodes
                        await asyncio.wait_for(ev.wait(), 2.0)
                    except asyncio.TimeoutError:
                        pass
                    await asyncio.sleep(0.25)  # at most four updates a second
            finally:
                store.unsubscribe(ev)
        return StreamingResponse(events(), media_type="text/event-stream")

    @ui.get("/api/jobs")
    async def jobs(request: Request):
        p = who(request)
        return await asyncio.to_thread(jobs_list, p)

    @ui.get("/api/jobs/stream")
    async def jobs_stream(request: Request):
        p = who(request)
        return sse(request, lambda: json.dumps(jobs_list(p)))

    @ui.get("/api/jobs/{namespace}/{name}")
    async def job(request: Request, namespace: str, name: str):
        p = who(request)
        return Response(await asyncio.to_thread(job_summary, p, namespace, name), media_type="application/json")

    @ui.get("/api/jobs/{namespace}/{name}/stream")
    async def job_stream(request: Request, namespace: str, name: str):
        p = who(request)
        visible(p, namespace, name)
        return sse(request, lambda: job_summary(p, namespace, name))

    @ui.get("/api/jobs/{namespace}/{name}/trajectories")
    async def trajectories(request: Request, namespace: str, name: str, after: int = Query(0, ge=0),
                           limit: int = Query(50, ge=1, le=500), rewardMin: float | None = None,
                           rewardMax: float | None = None, failure: str | None = None, task: str | None = None,
                           q: str | None = Query(None, max_length=500)):
        key = visible(who(request), namespace, name)
        return await asyncio.to_thread(stats.search, engine, key, after=after, limit=limit, reward_min=rewardMin,
                                       reward_max=rewardMax, failure=failure, task=task, text=q)

    @ui.get("/api/jobs/{namespace}/{name}/trajectories/{seq}")
    async def trajectory(request: Request, namespace: str, name: str, seq: int):
        key = visible(who(request), namespace, name)

        def load() -> dict[str, Any]:
            data = stats.trajectory(engine, key, seq)
            if data is None:
                raise HTTPException(404, f"rolloutjob {namespace}/{name} has no trajectory {seq}")
            raw = json.loads(data)
            tokenizer = ((store.get_wire(name, namespace)["spec"].get("llm") or {}).get("tokenizer"))
            view = decode.decode(raw, tokenizer)
            view.update(seq=seq, raw={"seq": seq, **raw},
                        group=stats.group(engine, key, raw.get("prompt", 0), raw.get("group")),
                        api=f"{API_PREFIX}/namespaces/{namespace}/rolloutjobs/{name}/trajectories?cursor={seq - 1}&limit=1")
            return view
        return await asyncio.to_thread(load)

    return _Headers(ui)
