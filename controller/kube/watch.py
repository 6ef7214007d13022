"""Watch streams of RolloutJobs: Kubernetes JSON-lines `WatchEvent`s, or server-sent events for older clients.

Called by the list routes (`rolloutjobs.py`) on `?watch=true`. Reads the store's change log (each change's
id is its resourceVersion), so a watch resumed from version N sees every later change once.
Next step: a `sendInitialEvents` stream (watch-list) when a client asks for one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from rolloutd.crds.names import job_key
from rolloutd.crds.rolloutjob import API_VERSION, KIND

from ..http.bodies import parse_version
from ..errors import ApiError
from ..store import FIELD_SELECTABLE, Store
from ..store.schema import Change
from ..selectors import fields_match, matches, parse_field_selector, parse_selector

KEEPALIVE_SECONDS = 15.0
log = logging.getLogger("rolloutd.api")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def json_line(type_: str, obj: dict[str, Any]) -> bytes:
    return (_json({"type": type_, "object": obj}) + "\n").encode()


def sse(rv: int, type_: str, obj: dict[str, Any]) -> bytes:
    return f"id: {rv}\nevent: {type_}\ndata: {_json(obj)}\n\n".encode()


def bookmark(rv: int, initial_events_end: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_events_end:  # watch-list (sendInitialEvents=true): the current state has been sent
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta}


def watch_response(store: Store, *, since: str | None, label_selector: str | None, field_selector: str | None,
                   namespace: str | None, timeout: float | None, bookmarks: bool, sse_mode: bool,
                   send_initial_events: bool = False,
                   render: Callable[[dict[str, Any]], dict[str, Any]] = lambda o: o) -> StreamingResponse:
    """`since` None (or "0" in JSON mode): synthetic ADDED for what exists, then changes; "N": every change after N.
    A version older than the kept log: HTTP 410 (SSE) or an ERROR event carrying a 410 Status
    (JSON lines, as Kubernetes streams it). `send_initial_events` (watch-list, what `kubectl wait` asks
    for) ends the current state with a BOOKMARK annotated k8s.io/initial-events-end. `render` turns an object into what the client asked for
    (a Table row for `kubectl get -w`)."""
    since_rv = parse_version(since, "resourceVersion")
    if (since_rv == 0 and not sse_mode) or send_initial_events:  # "0": any version, the current state first
        since_rv = None
    sel = parse_selector(label_selector)
    fsel = parse_field_selector(field_selector, FIELD_SELECTABLE)
    name = next((v for k, op, v in fsel if k == "metadata.name" and op == "="), None)
    in_ns = namespace or next((v for k, op, v in fsel if k == "metadata.namespace" and op == "="), None)
    # the change log names jobs by key: narrow to one only when its namespace is known (`wanted` checks the rest)
    name = job_key(in_ns, name) if name and in_ns else None
    expired: ApiError | None = None
    if since_rv is not None:
        try:
            store.changes_since(since_rv, name, limit=1)
        except ApiError as e:
            if sse_mode:
                raise
            expired = e

    def wanted(obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (namespace is None or meta.get("namespace") == namespace) \
            and matches(meta.get("labels", {}), sel) and fields_match(obj, fsel)

    filtered = bool(sel or fsel or namespace)
    matched: dict[str, bool] = {}  # job key → whether this watcher's last view of it matched

    def matched_before(key: str, rv: int) -> bool:
        if key not in matched:  # after a list, an unlisted object did not match; after a resume, the kept log says
            prior = None if since_rv is None else store.change_before(key, rv)
            matched[key] = prior is not None and prior.type != "DELETED" and wanted(prior.object)
        return matched[key]

    def seen_as(ch: Change) -> str | None:
        """The event this watcher gets for a change, as Kubernetes filters a watch: an object that starts
        matching the selectors is ADDED, one that stops matching is DELETED, others pass unless they never match."""
        now = ch.type != "DELETED" and wanted(ch.object)
        before = matched_before(ch.name, ch.rv - 1)
        matched[ch.name] = now
        if now:
            return "MODIFIED" if before and ch.type == "MODIFIED" else "ADDED"
        return "DELETED" if before else None

    def encode(rv: int, type_: str, obj: dict[str, Any]) -> bytes:
        return sse(rv, type_, obj) if sse_mode else json_line(type_, render(obj) if type_ != "BOOKMARK" else obj)

    async def events() -> AsyncIterator[bytes]:
        if expired is not None:
            yield json_line("ERROR", expired.status())
            return
        wake = store.subscribe()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            if since_rv is None:
                items, rv = await asyncio.to_thread(store.list_wire, label_selector, namespace=namespace,
                                                    field_selector=field_selector)
                for item in items:
                    matched[job_key(item["metadata"]["namespace"], item["metadata"]["name"])] = True
                    yield encode(int(item["metadata"]["resourceVersion"]), "ADDED", item)
                cursor = rv
                if sse_mode:
                    yield f"id: {rv}\nevent: BOOKMARK\ndata: {{}}\n\n".encode()
                elif bookmarks or send_initial_events:
                    yield encode(rv, "BOOKMARK", bookmark(rv, send_initial_events))
            else:
                cursor = since_rv
            while True:
                wake.clear()
                try:
                    changes = await asyncio.to_thread(store.changes_since, cursor, name)
                except ApiError as e:  # trimmed while we lagged behind
                    if not sse_mode:
                        yield json_line("ERROR", e.status())
                    return
                for ch in changes:
                    cursor = ch.rv
                    type_ = await asyncio.to_thread(seen_as, ch) if filtered else ch.type
                    if type_:
                        try:
                            yield encode(ch.rv, type_, ch.object)
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
                    if sse_mode:
                        yield b": keepalive\n\n"
                    elif bookmarks:
                        yield encode(cursor, "BOOKMARK", bookmark(cursor))
        finally:
            store.unsubscribe(wake)

    if sse_mode:
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(events(), media_type="application/json",
                             headers={"Cache-Control": "no-cache"})
