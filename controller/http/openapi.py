"""The OpenAPI document (/openapi.json): request bodies and every status code each route answers.

The routes read their bodies by hand (YAML or JSON, `http.bodies`), so FastAPI sees none; this module
describes them from the pydantic models, with the Kubernetes `Status` schema for every error code a
route really returns (the schemathesis run in tests/controller/http/test_fuzz.py holds the two together).
Installed by `api.create_app` through `describe(app)`.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from rolloutd.crds.node import (Heartbeat, HeartbeatResponse, LeaseRequest, LeaseResponse, PolicyState, PolicyWatch,
                                RegisterRequest, RegisterResponse, ResultAck, ResultBatch, ReturnRequest)
from rolloutd.crds.job_status import RolloutJobStatus
from rolloutd.crds.k8s_names import DNS1123_LABEL
from rolloutd.crds.names import API_PREFIX
from rolloutd.crds.rolloutjob import API_VERSION, KIND, BackendSpec, RolloutJob
from rolloutd.crds.trainer_api import Batch, BatchOpened, BackendList, JobPolicy, PolicyAnnounce, PromptGroups

from .node_protocol import JOB_NODES, NODES
from .trainer import JOBS as T, BatchRequest, PolicyRequest

J = f"{API_PREFIX}/rolloutjobs"  # the cluster-wide paths (api.py); T: the namespaced trainer routes

BODY_TYPES = ("application/json", "application/yaml")
BODY_ERRORS = (400, 404, 409, 413, 415, 422)
STATUS = {
    "type": "object",
    "required": ["apiVersion", "kind", "status", "message", "reason", "code"],
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "Status"}, "status": {"enum": ["Failure", "Success"]},
        "message": {"type": "string"}, "reason": {"type": "string"}, "code": {"type": "integer"},
        "details": {"type": "object", "properties": {
            "kind": {"type": "string"}, "name": {"type": "string"},
            "causes": {"type": "array", "items": {"type": "object", "required": ["field", "reason", "message"],
                                                  "properties": {"field": {"type": "string"},
                                                                 "reason": {"type": "string"},
                                                                 "message": {"type": "string"}}}}}},
    },
}
OBJECT = {"type": "object"}
NAME_PATTERN = DNS1123_LABEL.pattern  # what crds.k8s_names.validate_name checks
SSE_EVENT = {"type": "object", "description": "ADDED | MODIFIED | DELETED (data: the RolloutJob) or BOOKMARK",
             "properties": {"id": {"type": "string"}, "event": {"type": "string"}, "data": {"type": "string"}}}


class StatusUpdate(BaseModel):
    """The body of PUT …/status: the new status; `metadata.resourceVersion` makes the write conditional."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: RolloutJobStatus


def _ref(model: type[BaseModel], defs: dict[str, Any], mode: str) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode=mode, ref_template="#/components/schemas/{model}")
    defs.update(schema.pop("$defs", {}))
    if model is RolloutJob:  # what the validators check beyond the types (api.validate_job, ObjectMeta)
        schema["properties"]["apiVersion"] |= {"enum": [API_VERSION]}
        schema["properties"]["kind"] |= {"enum": [KIND]}
        defs["ObjectMeta"]["properties"]["name"] |= {"pattern": NAME_PATTERN, "maxLength": 63}
    name = model.__name__ if mode == "validation" else f"{model.__name__}Out"
    defs[name] = schema
    return {"$ref": f"#/components/schemas/{name}"}


def _routes(defs: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(method, path) → {body: schema, ok: {code: {media type: schema}}, errors: codes}."""
    def inp(m):
        return _ref(m, defs, "validation")

    def out(m):
        return {"application/json": _ref(m, defs, "serialization")}

    job_out = out(RolloutJob)
    job_list = {"type": "object", "required": ["items"], "properties": {
        "apiVersion": {"type": "string"}, "kind": {"const": "RolloutJobList"}, "metadata": OBJECT,
        "items": {"type": "array", "items": job_out["application/json"]}}}
    obj = {"application/json": OBJECT}
    nodes = {}
    for N in (JOB_NODES, NODES):  # the namespaced node protocol and the previous version's paths
        nodes.update({
            ("post", N + "/register"): dict(body=inp(RegisterRequest), ok={200: out(RegisterResponse)}, errors=BODY_ERRORS),
            ("post", N + "/{node_id}/lease"): dict(body=inp(LeaseRequest), ok={200: out(LeaseResponse)}, errors=BODY_ERRORS),
            ("post", N + "/{node_id}/heartbeat"): dict(body=inp(Heartbeat), ok={200: out(HeartbeatResponse)},
                                                       errors=BODY_ERRORS),
            ("post", N + "/{node_id}/results"): dict(body=inp(ResultBatch), ok={200: out(ResultAck)}, errors=BODY_ERRORS),
            ("post", N + "/{node_id}/return"): dict(body=inp(ReturnRequest), ok={200: obj}, errors=BODY_ERRORS),
            ("post", N + "/{node_id}/policy-watch"): dict(body=inp(PolicyWatch), ok={200: out(PolicyState)},
                                                          errors=(*BODY_ERRORS, 503)),  # 503: stopping
            ("post", N + "/{node_id}/deregister"): dict(ok={200: obj}, errors=(404,)),
        })
    nodes[("post", JOB_NODES + "/credential")] = dict(ok={200: obj}, errors=(404, 409))  # the admin's, by hand
    return {
        **nodes,
        ("post", J): dict(body=inp(RolloutJob), ok={201: job_out}, errors=(400, 409, 413, 415, 422)),
        ("get", J): dict(ok={200: {"application/json": job_list, "text/event-stream": SSE_EVENT}},
                         errors=(400, 410)),
        ("put", J + "/{name}"): dict(body=inp(RolloutJob), ok={200: job_out, 201: job_out},
                                     errors=(400, 409, 413, 415, 422)),
        ("get", J + "/{name}"): dict(ok={200: job_out}, errors=(404,)),
        ("delete", J + "/{name}"): dict(ok={202: obj}, errors=(404,)),
        ("get", J + "/{name}/status"): dict(ok={200: job_out}, errors=(404,)),
        ("put", J + "/{name}/status"): dict(body=inp(StatusUpdate), ok={200: job_out}, errors=BODY_ERRORS),
        ("get", J + "/{name}/events"): dict(ok={200: obj}, errors=(404,)),
        ("get", T + "/{name}/trajectories"): dict(ok={200: {"application/x-ndjson": {"type": "string"}}},
                                                  errors=(400, 404)),
        ("delete", T + "/{name}/trajectories"): dict(ok={200: obj}, errors=(404, 409)),  # a deleted job's, purged
        ("get", T + "/{name}/logs"): dict(ok={200: {"text/plain": {"type": "string"}}}, errors=(400, 404, 409)),
        ("get", T + "/{name}/groups"): dict(ok={200: out(PromptGroups)}, errors=(404,)),
        ("get", T + "/{name}/stats"): dict(ok={200: obj}, errors=(404,)),
        ("get", T + "/{name}/inflight"): dict(ok={200: obj}, errors=(400, 404)),
        ("post", T + "/{name}/batches"): dict(body=inp(BatchRequest), ok={200: out(BatchOpened)}, errors=BODY_ERRORS),
        ("get", T + "/{name}/batches/{k}"): dict(ok={200: out(Batch)},
                                                 errors=(400, 404, 409, 410, 503)),  # 503: stopping
        ("post", T + "/{name}/policy"): dict(body=inp(PolicyRequest), ok={200: out(PolicyAnnounce)},
                                             errors=BODY_ERRORS),
        ("get", T + "/{name}/policy"): dict(ok={200: out(JobPolicy)}, errors=(400, 404)),
        ("get", T + "/{name}/backends"): dict(ok={200: out(BackendList)}, errors=(404,)),
        ("post", T + "/{name}/backends"): dict(body=inp(BackendSpec), ok={200: out(BackendList)}, errors=BODY_ERRORS),
        ("delete", T + "/{name}/backends"): dict(ok={200: out(BackendList)}, errors=(400, 404, 422)),
    }


def build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    defs: dict[str, Any] = {"Status": STATUS}
    for (method, path), spec in _routes(defs).items():
        op = doc["paths"].get(path, {}).get(method)
        if op is None:  # a route this app does not mount (no scheduler: no node API)
            continue
        if "body" in spec:
            op["requestBody"] = {"required": True, "content": {t: {"schema": spec["body"]} for t in BODY_TYPES}}
        responses = {str(code): {"description": "success", "content": {t: {"schema": s} for t, s in media.items()}}
                     for code, media in spec["ok"].items()}
        for code in (401, *spec["errors"]):
            responses[str(code)] = {"description": "a Kubernetes Status naming the problem",
                                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Status"}}}}
        op["responses"] = responses
    doc["components"] = {"schemas": defs,
                         "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
    doc["security"] = [{"bearer": []}]
    return doc


def describe(app: FastAPI) -> None:
    """Serve `build(app)` (computed once) as the app's OpenAPI document."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi
