"""TenantPolicy verbs, cluster-scoped: the admin's per-namespace policy (`crds/tenancy.py`), stored by `tenancy.py`.

    GET    /apis/rolloutd.io/v1alpha1/tenantpolicies            list (a Table for kubectl get)
    POST   /apis/rolloutd.io/v1alpha1/tenantpolicies            create (kubectl apply's first write)
    GET | PUT | PATCH | DELETE  …/tenantpolicies/{namespace}    read, create or replace, merge/JSON patch, delete

Mounted by `api.create_app`. Only the admin token writes (`http/access.py` refuses every scoped token; a
namespace token may read its own namespace's policy). Next step: watch, if a client needs one.
"""
from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rolloutd.crds.k8s_names import validate_name
from rolloutd.crds.names import API_PREFIX
from rolloutd.crds.tenancy import POLICY_KIND, POLICY_PLURAL, TenantPolicySpec

from ..errors import BadRequest, Invalid, UnsupportedMediaType, from_validation_error
from ..http.bodies import parse_document, parse_version
from ..access.tenancy import API_VERSION, Policies
from . import patch as patches
from .rolloutjobs import _patch_body
from .table import wants_table
from .validate import options

POLICIES = f"{API_PREFIX}/{POLICY_PLURAL}"


def _name(name: Any, field: str = "metadata.name") -> str:
    try:
        return validate_name(name if isinstance(name, str) else "")
    except ValueError as e:
        raise Invalid(f"TenantPolicy is invalid: {field}: {e} (the name is the namespace it governs)",
                      causes=[{"field": field, "reason": "FieldValueInvalid", "message": str(e)}]) from None


def validate_policy(doc: dict[str, Any], url_name: str | None) -> tuple[str, TenantPolicySpec, dict[str, Any]]:
    """(namespace, spec, metadata) of a TenantPolicy body; 400/422 naming the field."""
    causes = [{"field": f, "reason": "FieldValueInvalid", "message": f"must be {want!r}, got {doc.get(f)!r}"}
              for f, want in (("apiVersion", API_VERSION), ("kind", POLICY_KIND)) if doc.get(f) != want]
    if causes:
        raise BadRequest("; ".join(f"{c['field']}: {c['message']}" for c in causes), causes=causes)
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    name = meta.get("name", url_name)
    if url_name is not None and name != url_name:
        raise BadRequest(f"metadata.name {str(name)[:63]!r} does not match the name in the URL {url_name!r}",
                         causes=[{"field": "metadata.name", "reason": "FieldValueInvalid",
                                  "message": "does not match the URL"}])
    name = _name(name)
    extra = sorted(set(doc) - {"apiVersion", "kind", "metadata", "spec"})
    if extra:
        raise Invalid(f"TenantPolicy is invalid: unknown field {extra[0]!r}", causes=[
            {"field": f, "reason": "FieldValueUnknown", "message": "unknown field"} for f in extra])
    try:
        spec = TenantPolicySpec.model_validate(doc.get("spec") or {})
    except ValidationError as e:
        err = from_validation_error(e, prefix=("spec",), name=name)
        raise Invalid(err.message.replace("RolloutJob", "TenantPolicy"), causes=err.causes, name=name) from None
    return name, spec, meta


def _age(stamp: str | None) -> str:
    if not stamp:
        return "<unknown>"
    s = int((datetime.now(timezone.utc) - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    return next((f"{s // n}{u}" for u, n in (("d", 86400), ("h", 3600), ("m", 60)) if s >= 2 * n), f"{max(s, 0)}s")


def _table(items: list[dict[str, Any]]) -> dict[str, Any]:
    cols = [("Name", "string"), ("Runtimes", "string"), ("Data roots", "string"), ("Jobs", "integer"),
            ("Nodes", "integer"), ("Age", "date")]
    rows = [{"cells": [i["metadata"]["name"], ",".join(i["spec"]["runtimes"]), ",".join(i["spec"]["dataRoots"]),
                       i["spec"]["quotas"]["jobs"], i["spec"]["quotas"]["nodes"],
                       _age(i["metadata"].get("creationTimestamp"))],
             "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": i["metadata"]}}
            for i in items]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": ""},
            "columnDefinitions": [{"name": n, "type": "string" if t == "date" else t, "format": "name" if n == "Name"
                                   else "", "description": n, "priority": 0} for n, t in cols],
            "rows": rows}


def _respond(request: Request, wire: dict[str, Any], code: int = 200) -> JSONResponse:
    return JSONResponse(_table([wire]) if wants_table(request.headers.get("accept")) else wire, status_code=code)


def tenantpolicy_router(policies: Policies) -> APIRouter:
    r = APIRouter(include_in_schema=False)

    async def put(request: Request, doc: dict[str, Any], url_name: str | None, *, create_only: bool) -> JSONResponse:
        opts = options(request)
        name, spec, meta = validate_policy(doc, url_name)
        expect = parse_version(meta.get("resourceVersion") or None, "metadata.resourceVersion")
        wire, created = await asyncio.to_thread(policies.put, name, spec, meta, create_only=create_only,
                                                expect_rv=expect, dry_run=opts.dry_run)
        return _respond(request, wire, 201 if created else 200)

    @r.get(POLICIES)
    async def _list(request: Request):
        items = await asyncio.to_thread(policies.list_wire)
        if wants_table(request.headers.get("accept")):
            return JSONResponse(_table(items))
        return JSONResponse({"apiVersion": API_VERSION, "kind": f"{POLICY_KIND}List",
                             "metadata": {"resourceVersion": ""}, "items": items})

    @r.post(POLICIES)
    async def _create(request: Request):
        return await put(request, await parse_document(request), None, create_only=True)

    @r.get(POLICIES + "/{name}")
    async def _get(name: str, request: Request):
        return _respond(request, await asyncio.to_thread(policies.get_wire, name))

    @r.put(POLICIES + "/{name}")
    async def _replace(name: str, request: Request):
        return await put(request, await parse_document(request), name, create_only=False)

    @r.patch(POLICIES + "/{name}")
    async def _patch(name: str, request: Request):
        ptype = patches.patch_type(request.headers.get("content-type"))
        if ptype == patches.APPLY:
            raise UnsupportedMediaType("TenantPolicy takes merge and JSON patches (kubectl apply without "
                                       "--server-side); server-side apply is for RolloutJobs")
        body = await _patch_body(request, ptype)
        current = await asyncio.to_thread(policies.get_wire, name)
        patched = patches.merge_patch(current, body) if ptype == patches.MERGE else patches.json_patch(current, body)
        return await put(request, patched, name, create_only=False)

    @r.delete(POLICIES + "/{name}")
    async def _delete(name: str, request: Request):
        return JSONResponse(await asyncio.to_thread(policies.delete, name, dry_run=options(request).dry_run))

    return r
