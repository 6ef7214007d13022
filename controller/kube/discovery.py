"""Discovery for Kubernetes clients: /version, /api, /api/v1 (namespaces, events), /apis, the rolloutd.io group,
and the OpenAPI documents (`kube/openapi_docs.py`).

Mounted by `api.create_app`. Namespaces are implicit (every valid name exists, as in k3s' kine a
namespace costs nothing here); core/v1 Events are the store's job events, so `kubectl describe`
shows them; a POSTed Event about a RolloutJob (the operator's) joins them. Next step: aggregated discovery (apidiscovery.k8s.io/v2) if a client needs it.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rolloutd.crds.crd import PLURAL
from rolloutd.crds.k8s_names import validate_name
from rolloutd.crds.names import GROUP, VERSION, job_key
from rolloutd.crds.rolloutjob import API_VERSION, KIND
from rolloutd.crds.tenancy import POLICY_KIND, POLICY_PLURAL

from ..errors import Invalid, NotFound
from ..http.bodies import parse_document
from ..store import Store
from .openapi_docs import openapi_routes
from ..selectors import fields_match, parse_field_selector

KUBE_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0+rolloutd", "gitCommit": "", "gitTreeState": "",
                "buildDate": "2026-11-23T00:00:00Z", "goVersion": "python", "compiler": "cpython",
                "platform": "linux/amd64"}
SHORT_NAMES = ["rj"]
CATEGORIES = ["rolloutd"]
EVENT_FIELDS = ("involvedObject.name", "involvedObject.namespace", "involvedObject.kind", "involvedObject.uid",
                "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
                "type", "reason", "source", "metadata.name", "metadata.namespace")
_GROUP_VERSION = {"groupVersion": API_VERSION, "version": VERSION}


def rolloutjob_resources() -> dict[str, Any]:
    verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
    return {
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": API_VERSION,
        "resources": [
            {"name": PLURAL, "singularName": "rolloutjob", "namespaced": True, "kind": KIND, "verbs": verbs,
             "shortNames": SHORT_NAMES, "categories": CATEGORIES, "storageVersionHash": ""},
            {"name": f"{PLURAL}/status", "singularName": "", "namespaced": True, "kind": KIND,
             "verbs": ["get", "patch", "update"]},
            {"name": POLICY_PLURAL, "singularName": "tenantpolicy", "namespaced": False, "kind": POLICY_KIND,
             "verbs": ["create", "delete", "get", "list", "patch", "update"], "shortNames": ["tp"],
             "categories": CATEGORIES, "storageVersionHash": ""},
        ],
    }


def core_resources() -> dict[str, Any]:
    return {
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
        "resources": [
            {"name": "namespaces", "singularName": "namespace", "namespaced": False, "kind": "Namespace",
             "verbs": ["get", "list"], "shortNames": ["ns"]},
            {"name": "events", "singularName": "event", "namespaced": True, "kind": "Event",
             "verbs": ["create", "get", "list"], "shortNames": ["ev"]},
        ],
    }


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "spec": {"finalizers": []},
            "status": {"phase": "Active"}}


def core_events(store: Store, namespace_: str | None) -> list[dict[str, Any]]:
    """The store's job events as core/v1 Events of their RolloutJob."""
    jobs = {job_key(j["metadata"]["namespace"], j["metadata"]["name"]): j["metadata"]
            for j in store.list_wire(namespace=namespace_)[0]}
    out = []
    for e in store.event_records(list(jobs)):
        meta = jobs[e["name"]]
        out.append({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{e['id']:x}", "namespace": meta["namespace"],
                         "resourceVersion": str(e["id"]), "creationTimestamp": e["time"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": e["reason"], "message": e["message"], "type": e["type"], "count": 1,
            "firstTimestamp": e["time"], "lastTimestamp": e["time"],
            "source": {"component": "rolloutd-controller"}, "reportingComponent": "rolloutd-controller",
        })
    return out


def _event_fields(doc: dict[str, Any], ns: str) -> tuple[str, str, str, str]:
    """(object name, type, reason, message) of a posted core/v1 Event; 422 naming the field otherwise."""
    obj = doc.get("involvedObject") if isinstance(doc.get("involvedObject"), dict) else {}
    checks = [("involvedObject.kind", obj.get("kind") == KIND, f"only {KIND} events are kept here"),
              ("involvedObject.name", isinstance(obj.get("name"), str) and obj.get("name"), "required"),
              ("involvedObject.namespace", obj.get("namespace") in (None, ns), "must be the URL's namespace"),
              ("type", doc.get("type", "Normal") in ("Normal", "Warning"), "must be Normal or Warning"),
              ("reason", isinstance(doc.get("reason"), str) and 0 < len(doc["reason"]) <= 128, "1-128 characters"),
              ("message", isinstance(doc.get("message", ""), str) and len(doc.get("message", "")) <= 4096,
               "a string of at most 4096 characters")]
    causes = [{"field": f, "reason": "FieldValueInvalid", "message": m} for f, ok, m in checks if not ok]
    if causes:
        raise Invalid("Event is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes), causes=causes)
    return obj["name"], doc.get("type", "Normal"), doc["reason"], doc.get("message", "")


def discovery_router(store: Store) -> APIRouter:
    r = APIRouter(include_in_schema=False)

    @r.get("/version")
    async def version():
        return KUBE_VERSION

    @r.get("/api")
    async def api():
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}]}

    @r.get("/api/v1")
    async def api_v1():
        return core_resources()

    @r.get("/apis")
    async def apis():
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": GROUP, "versions": [_GROUP_VERSION], "preferredVersion": _GROUP_VERSION}]}

    @r.get(f"/apis/{GROUP}")
    async def group():
        return {"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [_GROUP_VERSION],
                "preferredVersion": _GROUP_VERSION}

    @r.get(f"/apis/{API_VERSION}")
    async def group_version():
        return rolloutjob_resources()

    @r.get("/api/v1/namespaces")
    async def namespaces():
        names = await asyncio.to_thread(store.namespaces)
        return {"apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": ""},
                "items": [namespace(n) for n in names]}

    @r.get("/api/v1/namespaces/{name}")
    async def get_namespace(name: str):
        try:
            return namespace(validate_name(name))
        except ValueError as e:
            raise NotFound(f'namespaces "{name[:63]}" not found ({e})') from None

    async def _events(request: Request, ns: str | None):
        fsel = parse_field_selector(request.query_params.get("fieldSelector"), EVENT_FIELDS)
        items = [e for e in await asyncio.to_thread(core_events, store, ns) if fields_match(e, fsel)]
        return JSONResponse({"apiVersion": "v1", "kind": "EventList", "metadata": {"resourceVersion": ""},
                             "items": items})

    @r.get("/api/v1/events")
    async def all_events(request: Request):
        return await _events(request, None)

    @r.get("/api/v1/namespaces/{ns}/events")
    async def ns_events(ns: str, request: Request):
        return await _events(request, ns)

    @r.post("/api/v1/namespaces/{ns}/events", status_code=201)
    async def post_event(ns: str, request: Request):
        """An Event about a RolloutJob (the operator's, and kopf's when a handler fails) joins the job's events."""
        name, type_, reason, message = _event_fields(await parse_document(request), ns)
        try:
            job = await asyncio.to_thread(store.get_wire, name, ns)
        except NotFound:
            raise NotFound(f'rolloutjobs.rolloutd.io "{name}" not found: an Event needs its object') from None
        # the event belongs to the job of this namespace: its key is (namespace, name), never the bare name
        await asyncio.to_thread(store.add_event, job_key(ns, name), reason, message, type_)
        events = await asyncio.to_thread(core_events, store, job["metadata"]["namespace"])
        return JSONResponse([e for e in events if e["involvedObject"]["name"] == name][-1], status_code=201)

    openapi_routes(r)
    return r
