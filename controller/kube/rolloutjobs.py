"""RolloutJob verbs on the Kubernetes paths: get, list (selectors, limit/continue), watch, create, update,
patch (merge, JSON, server-side apply), delete, the status subresource, dryRun and fieldValidation.

Mounted by `api.create_app` at /apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs[/{name}[/status]],
plus the cluster-wide list/watch and rolloutctl's routes at …/v1alpha1/rolloutjobs. Writes go
through `store.py`; bodies are validated by `validate.py`. Next step: kopf handlers as the client.
"""
from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rolloutd.crds.k8s_names import generated_name, validate_name_prefix
from rolloutd.crds.names import API_PREFIX, job_key
from rolloutd.crds.rolloutjob import API_VERSION, RolloutJob

from ..errors import AlreadyExists, BadRequest, Conflict, NotFound
from ..http.bodies import check_bounds, parse_document, parse_text, parse_version, read_body
from ..store import Store
from ..access.tenancy import Policies
from . import patch as patches
from ..http import streams
from .admit import admit_and_write
from .table import table, wants_table
from .validate import Checks, Options, options, validate_job, validate_status
from .watch import watch_response

NS = API_PREFIX + "/namespaces/{namespace}/rolloutjobs"
APPLY_HEADER = "X-Rolloutd-Apply"  # the namespaced PUT creates or updates, as rolloutctl apply wants


@dataclass(frozen=True)
class JobParts:
    """What the RolloutJob verbs use of the composition root (`root.Root.jobs`): the store, the tenancy policies a
    scoped token's write is admitted against, the checks a spec is held to and the scoped tokens' stream slots."""
    store: Store
    policies: Policies
    checks: Checks
    streams: streams.Streams


def respond(request: Request, obj: dict[str, Any], code: int = 200, opts: Options | None = None,
            headers: dict[str, str] | None = None) -> Response:
    headers = dict(headers or {})
    if opts is not None and opts.warnings:
        headers["Warning"] = ", ".join(f'299 - "{w}"' for w in opts.warnings)
    body = table([obj], include_object=request.query_params.get("includeObject", "Metadata")) \
        if wants_table(request.headers.get("accept")) and obj.get("kind") == "RolloutJob" else obj
    return JSONResponse(body, status_code=code, headers=headers or None)


def _continue_token(rv: int, last: dict[str, Any]) -> str:
    raw = json.dumps({"rv": rv, "ns": last["metadata"]["namespace"], "name": last["metadata"]["name"]})
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _parse_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), (str(data["ns"]), str(data["name"]))
    except (ValueError, KeyError, TypeError):
        raise BadRequest("continue key is not valid: list again without it", causes=[
            {"field": "continue", "reason": "FieldValueInvalid", "message": "not a continue token from this server"}
        ]) from None


def _limit(value: str | None) -> int | None:
    if value in (None, "", "0"):
        return None
    if not value.isdigit() or len(value) > 9:
        raise BadRequest(f"limit must be a non-negative integer, got {value[:20]!r}",
                         causes=[{"field": "limit", "reason": "FieldValueInvalid", "message": "not an integer"}])
    return int(value)


def _timeout(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not 0 < t < 1e9:
        raise BadRequest(f"timeoutSeconds must be a positive number, got {value[:20]!r}",
                         causes=[{"field": "timeoutSeconds", "reason": "FieldValueInvalid", "message": "out of range"}])
    return t


async def list_or_watch(parts: JobParts, request: Request, namespace: str | None, *, sse_ok: bool) -> Response:
    store = parts.store
    q = request.query_params
    label_selector, field_selector = q.get("labelSelector"), q.get("fieldSelector")
    if q.get("watch") in ("true", "1", "True"):
        slot = parts.streams.take(request, namespace)
        accept = request.headers.get("accept", "")
        sse_mode = sse_ok and "application/json" not in accept
        as_table = wants_table(accept)
        include = q.get("includeObject", "Metadata")
        response = watch_response(
            store, since=request.headers.get("last-event-id") or q.get("resourceVersion") or None,
            label_selector=label_selector, field_selector=field_selector, namespace=namespace,
            timeout=_timeout(q.get("timeoutSeconds")), bookmarks=q.get("allowWatchBookmarks") == "true",
            sse_mode=sse_mode, send_initial_events=q.get("sendInitialEvents") == "true",
            render=(lambda o: table([o], include_object=include)) if as_table else (lambda o: o))
        return streams.guard(slot, response)
    limit = _limit(q.get("limit"))
    items, rv = await asyncio.to_thread(store.list_wire, label_selector, namespace=namespace,
                                        field_selector=field_selector)
    if q.get("continue"):
        rv, after = _parse_continue(q["continue"])
        items = [i for i in items if (i["metadata"]["namespace"], i["metadata"]["name"]) > after]
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if limit is not None and len(items) > limit:
        meta["remainingItemCount"] = len(items) - limit
        items = items[:limit]
        meta["continue"] = _continue_token(rv, items[-1])
    if wants_table(request.headers.get("accept")):
        return JSONResponse(table(items, str(rv), meta.get("continue"), q.get("includeObject", "Metadata")))
    return JSONResponse({"apiVersion": API_VERSION, "kind": "RolloutJobList", "metadata": meta, "items": items})


def _manager(request: Request, default: str) -> str:
    manager = request.query_params.get("fieldManager")
    if manager is None:
        agent = request.headers.get("user-agent", "")
        manager = agent.split("/")[0] or default
    if not manager or len(manager) > 128:
        raise BadRequest("fieldManager must be 1-128 characters",
                         causes=[{"field": "fieldManager", "reason": "FieldValueInvalid", "message": "bad length"}])
    return manager


async def create(parts: JobParts, request: Request, namespace: str | None) -> Response:
    store = parts.store
    opts = options(request, parts.checks)
    doc = await parse_document(request)
    prefix = _generate_name(doc)
    tries = GENERATE_ATTEMPTS if prefix is not None else 1
    for attempt in range(1, tries + 1):
        if prefix is not None:
            doc["metadata"]["name"] = generated_name(prefix)
        job = validate_job(doc, namespace=namespace, opts=opts)
        managed = patches.record_update({"metadata": {}}, doc, _manager(request, "unknown"))
        try:
            wire = await asyncio.to_thread(admit_and_write, request, store, parts.policies, job, None,
                                           lambda: store.create(job, dry_run=opts.dry_run, managed_fields=managed))
        except AlreadyExists:
            if attempt == tries:
                raise
        else:
            return respond(request, wire, 201, opts, {"X-Rolloutd-Outcome": "created"})


GENERATE_ATTEMPTS = 8  # 27^5 names per prefix: a collision is rare, eight in a row is the store refusing


def _generate_name(doc: Any) -> str | None:
    """`metadata.generateName` of a create that names no job (Kubernetes' rule: a name, when given, wins). None for
    a prefix that is not one too: `validate_job` then refuses the job, naming metadata.generateName (ObjectMeta)."""
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or meta.get("name") or not isinstance(meta.get("generateName"), str):
        return None
    try:
        return validate_name_prefix(meta["generateName"])
    except ValueError:
        return None


async def rolloutctl_apply(parts: JobParts, request: Request, namespace: str | None, name: str) -> Response:
    """rolloutctl's apply, a PUT that creates or updates (`Store.apply`), with X-Rolloutd-Outcome; on a
    namespaced path only when the request carries APPLY_HEADER (a plain PUT replaces, as Kubernetes does)."""
    store = parts.store
    job = validate_job(await parse_document(request), url_name=name, namespace=namespace,
                       opts=Options(checks=parts.checks))
    try:
        current = await asyncio.to_thread(store.get_wire, name, job.metadata.namespace)
    except NotFound:
        current = None
    wire, outcome = await asyncio.to_thread(admit_and_write, request, store, parts.policies, job, current, lambda: store.apply(job))
    return JSONResponse(wire, status_code=201 if outcome == "created" else 200, headers={"X-Rolloutd-Outcome": outcome})


async def replace(parts: JobParts, request: Request, namespace: str, name: str) -> Response:
    store = parts.store
    opts = options(request, parts.checks)
    doc = await parse_document(request)
    job = validate_job(doc, url_name=name, namespace=namespace, opts=opts)
    current = await asyncio.to_thread(store.get_wire, name, namespace)
    managed = patches.record_update(current, doc, _manager(request, "unknown"))
    expect = parse_version(job.metadata.resource_version or None, "metadata.resourceVersion")
    wire = await asyncio.to_thread(admit_and_write, request, store, parts.policies, job, current, lambda: store.update(
        job, expect_rv=expect, dry_run=opts.dry_run, managed_fields=managed))
    return respond(request, wire, 200, opts)


async def replace_status(parts: JobParts, request: Request, namespace: str | None, name: str) -> Response:
    store = parts.store
    opts = options(request, parts.checks)
    doc = await parse_document(request)
    if "status" not in doc or not isinstance(doc["status"], dict):
        raise BadRequest("body must contain a 'status' object", causes=[
            {"field": "status", "reason": "FieldValueRequired", "message": "required"}])
    status = validate_status(doc["status"], name)
    meta = doc.get("metadata")
    expect = parse_version(meta.get("resourceVersion") if isinstance(meta, dict) else None,
                           "metadata.resourceVersion")
    current = await asyncio.to_thread(store.get_wire, name, namespace)
    job = RolloutJob.model_validate({**current, "status": status.wire()})
    wire = await asyncio.to_thread(store.update, job, expect_rv=expect, status_only=True, dry_run=opts.dry_run)
    return respond(request, wire, 200, opts)


async def _patch_body(request: Request, ptype: str) -> Any:
    raw = await read_body(request)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8 text: {e}") from None
    body = parse_text(text, json_=ptype != patches.APPLY or text.lstrip()[:1] in ("{", "["))
    check_bounds(body)
    if ptype != patches.JSON_PATCH and not isinstance(body, dict):
        raise BadRequest(f"expected an object, got {type(body).__name__}")
    return body


async def patch(parts: JobParts, request: Request, namespace: str, name: str, subresource: str = "") -> Response:
    store = parts.store
    opts = options(request, parts.checks)
    ptype = patches.patch_type(request.headers.get("content-type"))
    body = await _patch_body(request, ptype)
    force = request.query_params.get("force") == "true"
    if ptype == patches.APPLY:
        if "fieldManager" not in request.query_params:
            raise BadRequest("fieldManager is required for apply requests (server-side apply)",
                             causes=[{"field": "fieldManager", "reason": "FieldValueRequired", "message": "required"}])
        body.setdefault("metadata", {}).setdefault("name", name)
    elif force:
        raise BadRequest("force is only allowed for apply patches (application/apply-patch+yaml)")
    manager = _manager(request, "unknown")
    for _attempt in range(5):  # a concurrent write between our read and our write: read again
        try:
            current = await asyncio.to_thread(store.get_wire, name, namespace)
        except NotFound:
            if ptype != patches.APPLY or subresource:
                raise
            return await _apply_create(parts, request, namespace, name, body, manager, force, opts)
        rv = int(current["metadata"]["resourceVersion"])
        if ptype == patches.MERGE:
            patched = patches.merge_patch(current, body)
        elif ptype == patches.JSON_PATCH:
            patched = patches.json_patch(current, body)
        else:
            patched = patches.server_side_apply(current, body, manager, force, subresource,
                                                normalize=_normalizer(name, namespace, subresource, opts))
        precondition = parse_version(patched.get("metadata", {}).get("resourceVersion") or None,
                                     "metadata.resourceVersion") if ptype != patches.APPLY else None
        if precondition is not None and precondition != rv:
            raise Conflict(f'Operation cannot be fulfilled on rolloutjobs.rolloutd.io "{name}": the object has been '
                           f"modified (resourceVersion {rv}, the patch expects {precondition})", name=name)
        managed = patched["metadata"].get("managedFields") if ptype == patches.APPLY else \
            patches.record_update(current, patched, manager, subresource)
        try:
            if subresource == "status":
                status = validate_status(patched.get("status") or {}, name)
                job = RolloutJob.model_validate({**current, "status": status.wire()})
                wire = await asyncio.to_thread(store.update, job, expect_rv=rv, status_only=True,
                                               dry_run=opts.dry_run)
            else:
                kept = patched.get("spec") == current.get("spec")  # metadata only: finalizers, annotations, labels
                job = validate_job(patched, url_name=name, namespace=namespace, opts=opts, spec_checks=not kept)
                # a job stored before an upgrade: its spec defaulted by this version asks for nothing new
                before = {**current, "spec": job.spec.wire()} if kept else current
                wire = await asyncio.to_thread(admit_and_write, request, store, parts.policies, job, before, lambda: store.update(
                    job, expect_rv=rv, dry_run=opts.dry_run, managed_fields=managed))
        except Conflict:
            continue
        return respond(request, wire, 200, opts)
    raise Conflict(f'rolloutjobs.rolloutd.io "{name}" kept changing while it was patched; try again', name=name)


async def _apply_create(parts: JobParts, request: Request, namespace: str, name: str, body: dict[str, Any],
                        manager: str, force: bool, opts: Options) -> Response:
    store = parts.store
    created = patches.server_side_apply(None, body, manager, force, normalize=_normalizer(name, namespace, "", opts))
    job = validate_job(created, url_name=name, namespace=namespace, opts=opts)
    wire = await asyncio.to_thread(admit_and_write, request, store, parts.policies, job, None, lambda: store.create(
        job, dry_run=opts.dry_run, managed_fields=created["metadata"]["managedFields"]))
    return respond(request, wire, 201, opts)


def _normalizer(name: str, namespace: str, subresource: str, opts: Options):
    """The defaulted form of a candidate object (422 if it is invalid), for apply's conflict check."""
    def normalize(doc: dict[str, Any]) -> dict[str, Any]:
        if subresource == "status":
            return {**doc, "status": validate_status(doc.get("status") or {}, name).wire()}
        return {**doc, "spec": validate_job(doc, url_name=name, namespace=namespace,
                                            opts=Options(checks=opts.checks)).spec.wire()}
    return normalize


async def delete(parts: JobParts, request: Request, namespace: str | None, name: str, code: int = 200) -> Response:
    """DeleteOptions come as query parameters or as a body (kubectl and the kubernetes client send one):
    `dryRun: [All]` and `preconditions: {uid, resourceVersion}` are honoured."""
    store = parts.store
    opts = options(request, parts.checks)
    raw = await read_body(request)
    body = parse_text(raw.decode("utf-8", "replace"), json_=True) if raw.strip() else {}
    if not isinstance(body, dict):
        raise BadRequest("the body of a delete must be DeleteOptions (an object)")
    dry = body.get("dryRun") or []
    if dry not in ([], ["All"]):
        raise BadRequest(f"dryRun must be ['All'], got {str(dry)[:40]}",
                         causes=[{"field": "dryRun", "reason": "FieldValueNotSupported", "message": "supported: All"}])
    pre = body.get("preconditions") or {}
    if pre:
        current = await asyncio.to_thread(store.get_wire, name, namespace)
        for key in ("uid", "resourceVersion"):
            if pre.get(key) is not None and str(pre[key]) != current["metadata"][key]:
                raise Conflict(f'Precondition failed for rolloutjobs.rolloutd.io "{name}": {key} is '
                               f"{current['metadata'][key]}, the request expects {pre[key]}", name=name)
    wire = await asyncio.to_thread(store.mark_deleted, name, namespace, dry_run=opts.dry_run or bool(dry))
    return respond(request, wire, code, opts)


def namespaced_router(parts: JobParts) -> APIRouter:
    """The namespaced routes (documented by /openapi/v2 and /openapi/v3, not by /openapi.json)."""
    r, store = APIRouter(include_in_schema=False), parts.store

    @r.get(NS)
    async def _list(namespace: str, request: Request):
        return await list_or_watch(parts, request, _ns(namespace), sse_ok=False)

    @r.post(NS)
    async def _create(namespace: str, request: Request):
        return await create(parts, request, _ns(namespace))

    @r.get(NS + "/{name}")
    @r.get(NS + "/{name}/status")
    async def _get(namespace: str, name: str, request: Request):
        return respond(request, await asyncio.to_thread(store.get_wire, name, _ns(namespace)))

    @r.put(NS + "/{name}")
    async def _replace(namespace: str, name: str, request: Request):
        if request.headers.get(APPLY_HEADER):
            return await rolloutctl_apply(parts, request, _ns(namespace), name)
        return await replace(parts, request, _ns(namespace), name)

    @r.get(NS + "/{name}/events")
    async def _events(namespace: str, name: str):  # what `rolloutctl describe` shows
        await asyncio.to_thread(store.get_wire, name, _ns(namespace))  # 404 for unknown jobs
        return {"items": await asyncio.to_thread(store.events, job_key(namespace, name))}

    @r.put(NS + "/{name}/status")
    async def _replace_status(namespace: str, name: str, request: Request):
        return await replace_status(parts, request, _ns(namespace), name)

    @r.patch(NS + "/{name}")
    async def _patch(namespace: str, name: str, request: Request):
        return await patch(parts, request, _ns(namespace), name)

    @r.patch(NS + "/{name}/status")
    async def _patch_status(namespace: str, name: str, request: Request):
        return await patch(parts, request, _ns(namespace), name, "status")

    @r.delete(NS + "/{name}")
    async def _delete(namespace: str, name: str, request: Request):
        return await delete(parts, request, _ns(namespace), name)

    return r


def _ns(namespace: str) -> str:
    from rolloutd.crds.k8s_names import validate_name
    try:
        return validate_name(namespace)
    except ValueError as e:
        raise NotFound(f'namespaces "{namespace[:63]}" not found ({e})') from None
