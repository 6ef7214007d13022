"""/openapi/v2 and /openapi/v3 (+ /openapi/v3/apis/rolloutd.io/v1alpha1) for Kubernetes clients, generated from
the same pydantic models as `crds/rolloutjob.yaml` (through `crds/crd.py`).

Mounted by `discovery.py`. kubectl reads them for `explain` and to learn that the PATCH operation takes
`fieldValidation` and `dryRun` (so it validates on the server). /openapi.json (FastAPI's, for the
schemathesis run) stays beside them. Next step: the node and trainer routes once they move under namespaces.
"""
from __future__ import annotations

import copy
import hashlib
import json
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rolloutd.crds.crd import PLURAL, build_crd
from rolloutd.crds.names import GROUP, VERSION
from rolloutd.crds.rolloutjob import API_VERSION, KIND, ObjectMeta

GVK = {"group": GROUP, "version": VERSION, "kind": KIND}
REF_NAME = f"io.rolloutd.{VERSION}.{KIND}"
LIST_NAME = f"io.rolloutd.{VERSION}.{KIND}List"
META_NAME = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
STATUS_NAME = "io.k8s.apimachinery.pkg.apis.meta.v1.Status"
GV_PATH = f"apis/{API_VERSION}"
PATCH_TYPES = ["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]
_QUERY = {
    "dryRun": ("string", "When present (All), the write is validated and answered but not stored."),
    "fieldManager": ("string", "The actor making the change (server-side apply ownership)."),
    "fieldValidation": ("string", "Strict (default here), Warn or Ignore: what to do with unknown fields."),
    "force": ("boolean", "Server-side apply only: take over fields other managers own."),
    "labelSelector": ("string", "Label selector (a=b, a!=b, a, !a, a in (x,y), a notin (x))."),
    "fieldSelector": ("string", "metadata.name and metadata.namespace."),
    "limit": ("integer", "At most this many items; continue with metadata.continue."),
    "continue": ("string", "The continue token of the previous page."),
    "watch": ("boolean", "Stream WatchEvents (JSON lines)."),
    "resourceVersion": ("string", "Watch: changes after this version (410 Expired past the kept window)."),
    "timeoutSeconds": ("integer", "Watch: end the stream after this many seconds."),
    "allowWatchBookmarks": ("boolean", "Watch: send BOOKMARK events."),
}


def _metadata_schema() -> dict[str, Any]:
    from rolloutd.crds.crd import _schema  # the structural schema the CRD uses
    return {**_schema(ObjectMeta), "description": "Standard object metadata (namespace, labels, finalizers, …)."}


def _job_schema(ref_prefix: str) -> dict[str, Any]:
    version = build_crd()["spec"]["versions"][0]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    schema["description"] = "RolloutJob: agent rollouts for RL trainers, reconciled by rolloutd."
    schema["properties"]["apiVersion"]["description"] = "rolloutd.io/v1alpha1"
    schema["properties"]["kind"]["description"] = "RolloutJob"
    schema["properties"]["metadata"] = {"$ref": ref_prefix + META_NAME}
    schema["x-kubernetes-group-version-kind"] = [GVK]
    return schema


def _definitions(ref_prefix: str) -> dict[str, Any]:
    return {
        REF_NAME: _job_schema(ref_prefix),
        LIST_NAME: {"type": "object", "required": ["items"], "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "items": {"type": "array", "items": {"$ref": ref_prefix + REF_NAME}}},
            "x-kubernetes-group-version-kind": [{**GVK, "kind": KIND + "List"}]},
        META_NAME: _metadata_schema(),
        STATUS_NAME: {"type": "object", "description": "Why a request failed (Kubernetes Status).",
                      "properties": {k: {"type": t} for k, t in (("apiVersion", "string"), ("kind", "string"),
                                     ("status", "string"), ("message", "string"), ("reason", "string"),
                                     ("code", "integer"), ("details", "object"))}},
    }


def _operations(v3: bool) -> dict[str, dict[str, Any]]:
    """path → {method: (action, query params, request body types)}."""
    ns = f"/apis/{API_VERSION}/namespaces/{{namespace}}/{PLURAL}"
    reads = ["labelSelector", "fieldSelector", "limit", "continue", "watch", "resourceVersion", "timeoutSeconds",
             "allowWatchBookmarks"]
    writes = ["dryRun", "fieldManager", "fieldValidation"]
    item = {"get": ("get", [], None), "put": ("put", writes, ["application/json", "application/yaml"]),
            "patch": ("patch", writes + ["force"], PATCH_TYPES), "delete": ("delete", ["dryRun"], None)}
    return {
        f"/apis/{API_VERSION}/{PLURAL}": {"get": ("list", reads, None)},
        ns: {"get": ("list", reads, None), "post": ("post", writes, ["application/json", "application/yaml"])},
        ns + "/{name}": item,
        ns + "/{name}/status": {k: v for k, v in item.items() if k != "delete"},
    }


def _document(v3: bool) -> dict[str, Any]:
    ref = "#/components/schemas/" if v3 else "#/definitions/"
    paths: dict[str, Any] = {}
    for path, methods in _operations(v3).items():
        entry: dict[str, Any] = {}
        for method, (action, query, body_types) in methods.items():
            params = [{"name": q, "in": "query", "description": _QUERY[q][1],
                       **({"schema": {"type": _QUERY[q][0]}} if v3 else {"type": _QUERY[q][0]})}
                      for q in query]
            for p in ("namespace", "name"):
                if "{" + p + "}" in path:
                    params.append({"name": p, "in": "path", "required": True,
                                   **({"schema": {"type": "string"}} if v3 else {"type": "string"})})
            target = LIST_NAME if action == "list" else REF_NAME
            op: dict[str, Any] = {"operationId": f"{action}{KIND}", "parameters": params,
                                  "x-kubernetes-action": action, "x-kubernetes-group-version-kind": GVK,
                                  "tags": [f"{GROUP}_{VERSION}"]}
            if v3:
                op["responses"] = {"200": {"description": "OK", "content": {
                    "application/json": {"schema": {"$ref": ref + target}}}}}
                if body_types:
                    op["requestBody"] = {"required": True, "content": {
                        t: {"schema": {"$ref": ref + REF_NAME} if "patch" not in t else {"type": "object"}}
                        for t in body_types}}
            else:
                op["responses"] = {"200": {"description": "OK", "schema": {"$ref": ref + target}}}
                op["produces"] = ["application/json", "application/yaml"]
                if body_types:
                    op["consumes"] = body_types
                    op["parameters"].append({"name": "body", "in": "body", "required": True,
                                             "schema": {"$ref": ref + REF_NAME} if method != "patch"
                                             else {"type": "object"}})
            entry[method] = op
        paths[path] = entry
    info = {"title": "rolloutd", "version": API_VERSION}
    if v3:
        return {"openapi": "3.0.0", "info": info, "paths": paths,
                "components": {"schemas": _definitions(ref)}}
    return {"swagger": "2.0", "info": info, "paths": paths, "definitions": _definitions(ref)}


@lru_cache(maxsize=2)
def document(v3: bool) -> dict[str, Any]:
    return _document(v3)


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload  # length-delimited, payload < 128 bytes


# kubectl asks for /openapi/v2 only as protobuf (gnostic's openapi_v2.Document) to validate on the
# client; we validate on the server (fieldValidation, advertised in /openapi/v3), so the protobuf
# form is the document's header alone and kubectl finds no client-side schema to apply.
PROTO_V2 = _field(1, b"2.0") + _field(2, _field(1, b"rolloutd") + _field(2, API_VERSION.encode()))
PROTO_V2_TYPE = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"


def openapi_routes(r: APIRouter) -> None:
    @r.get("/openapi/v2")
    async def v2(request: Request):
        if "protobuf" in request.headers.get("accept", ""):
            return Response(PROTO_V2, media_type=PROTO_V2_TYPE)
        return document(False)

    @r.get("/openapi/v3")
    async def v3_root():
        digest = hashlib.sha256(json.dumps(document(True), sort_keys=True).encode()).hexdigest()[:32].upper()
        return {"paths": {GV_PATH: {"serverRelativeURL": f"/openapi/v3/{GV_PATH}?hash={digest}"}}}

    @r.get(f"/openapi/v3/{GV_PATH}")
    async def v3_group_version():
        return document(True)
